"""Envhost: serves environments (AbstractGame subclasses) to rollout workers over NATS.

Role: runs user (and built-in) environment code; one game instance per episode, held
in this process from reset to done (sticky), so more envhost processes add capacity.
Episodes are keyed by (job id, episode id): a request naming one job never reaches
another job's game, whatever episode id it names.
User code runs in threads (a slow env does not block the host), at most
`envhost_max_concurrency` calls at once; an episode idle for `envhost_episode_ttl_s`
is dropped. A game that ends, or is closed, dropped or replaced, has its `close()`
called when it defines one (AbstractGame.close: let go of what the episode holds), in
the user-code threads; an error there is logged. An exception in user code ends that episode with `error` =
"<ExcType>: <message>" and the host keeps serving; so does an image the env returns
that environment/images.py refuses (unreadable, too many, too large).

Reads (core request/reply):
- `ot.env.<env>.init`  (queue group `envhost-<env>`): EnvInitRequest -> EnvInitReply
- `ot.env.<env>.reset` (queue group `envhost-<env>`): EnvResetRequest -> EnvResetReply;
  the answering host owns the episode and names itself in `host_id`
- `ot.env.host.<host_id>.step`: EnvStepRequest -> EnvStepReply (episode dropped when done)
- `ot.env.host.<host_id>.close`: EnvCloseRequest -> EnvStepReply(done=True) if a reply
  is asked for; closing an unknown episode is not an error
Writes: the replies; `ot.dlq.envhost` for undecodable requests (no reply).

Run: `opentinker envhost [--env module:Class | --env path/file.py:Class | --env arith | --env verifiers:ENV_ID |
--env openenv:module:Class | --env openenv+http://host:port ...]
[--env-path DIR] [--name NAME] [--as-user] [KEY=VALUE ...]`, or `python -m opentinker.services.envhost`.
With `--as-user` (or no service credentials and $OPENTINKER_API_URL set) it serves as the
API key's user, to that user's own jobs only (tenant.py).
With no `--env` it serves every built-in env (registry.py: arith, gsm8k, guess-number,
code-math, gomoku, bandit, gomoku-duel, negotiation, alfworld, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import logging
import os
import random
import secrets
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import msgspec
import nats.errors
from nats.aio.msg import Msg

from opentinker.schemas import (
    AgentOpening,
    EnvCloseRequest,
    EnvInfoReply,
    EnvInfoRequest,
    EnvInitReply,
    EnvInitRequest,
    EnvResetReply,
    EnvResetRequest,
    EnvStepReply,
    EnvServed,
    EnvStepRequest,
    encode,
)
from opentinker.schemas import subjects as S
from opentinker.schemas.env import check_env_reply
from opentinker.schemas.job import ENV_NAME_RE, JOB_ID_RE, SpecError
from opentinker.environment.base_game import AbstractGame, StepResult, opening
from opentinker.environment.images import check_images
from opentinker.environment.multi_agent import MultiAgentGame, PhaseResult
from opentinker.services.core import access
from opentinker.services.core.access import Tenant, key_env_args, path_args, split_setting, url_args
from opentinker.services.core.bus import Bus
from opentinker.services.core.config import Settings, default_nats_url, service_credentials
from opentinker.services.core.runner import run_service
from opentinker.services.envhost.loader import EnvLoadError, load_envs

log = logging.getLogger("opentinker.envhost")


@dataclass
class Episode:
    env: str
    game: AbstractGame
    last_used: float
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    acting: list[str] = field(default_factory=list)  # a multi-agent game's current phase


def user_error(e: BaseException) -> str:
    """The `error` text of a reply when user code raised: "<ExcType>: <message>"."""
    return f"{type(e).__name__}: {e}"


def plain(obj: Any) -> Any:
    """`obj` as MessagePack-safe builtins: numpy scalars and arrays become numbers and
    lists, dict keys become strings, anything else unknown becomes its str()."""

    def fallback(x: Any) -> Any:
        for attr in ("item", "tolist"):  # numpy / torch scalars and arrays
            if callable(getattr(x, attr, None)):
                try:
                    return getattr(x, attr)()
                except (TypeError, ValueError):
                    pass
        return str(x)

    return msgspec.to_builtins(obj, enc_hook=fallback, str_keys=True)


def open_episode(cls: type[AbstractGame], env_args: dict[str, Any],
                 state: dict[str, Any]) -> tuple[AbstractGame, str, str, list[dict[str, Any]]]:
    """Construct the game and reset it. Returns (game, system_prompt, user_message,
    tools). The user message: the class's `get_user_message_with_state(**state)` when it
    overrides that (or `render_state_for_prompt`), asked before `reset` as OpenTinker
    builds its prompts; else the initial user message and the first observation, either
    one alone when the other is empty (OpenTinker's default rendering)."""
    game = cls(**env_args)
    system, user = opening(game, state)
    tools = game.get_tools() or []
    if not isinstance(tools, list) or not all(isinstance(x, dict) for x in tools):
        raise TypeError("get_tools must return a list of dicts (OpenAI-style function schemas)")
    return game, system, user, plain(tools)


def opening_images(game: AbstractGame) -> list[bytes]:
    """The images of the first user message: `game.get_initial_images()` as PNG or JPEG
    bytes. Raises ValueError naming the image that is unreadable or over a limit
    (environment/images.py)."""
    return check_images(game.get_initial_images())


def privileged_context(game: AbstractGame) -> str:
    """What a distillation teacher reads after the first user message (JobSpec
    teacher_context = "privileged"): `game.get_privileged_context()`, asked after
    `reset`. Raises TypeError unless it is a str."""
    text = game.get_privileged_context()
    if not isinstance(text, str):
        raise TypeError(f"get_privileged_context must return a str, got {type(text).__name__}")
    return text


def open_multi_episode(cls: type[MultiAgentGame], env_args: dict[str, Any],
                       state: dict[str, Any]) -> tuple[MultiAgentGame, list[AgentOpening], list[str]]:
    """Construct a multi-agent game and reset it. Returns (game, each seat's opening in
    seat order, the seats acting first). Raises ValueError for seats that are not a
    tuple of two or more distinct names, or first actors that are not seats."""
    game = cls(**env_args)
    game.reset(**state)
    seats = list(game.agents)
    if len(seats) < 2 or len(set(seats)) != len(seats) or not all(isinstance(a, str) and a for a in seats):
        raise ValueError(f"agents: a multi-agent game needs two or more distinct seat names, got {seats!r}")
    openings = [AgentOpening(agent=a, system_prompt=str(game.get_agent_system_prompt(a) or ""),
                             user_message=str(game.get_agent_user_message(a) or "")) for a in seats]
    return game, openings, _acting(game, seats)


def _acting(game: MultiAgentGame, seats: list[str]) -> list[str]:
    acting = list(game.acting_agents())
    if not acting or any(a not in seats for a in acting) or len(set(acting)) != len(acting):
        raise ValueError(f"acting_agents: must name one or more of the seats {seats}, got {acting!r}")
    return acting


def take_phase(game: MultiAgentGame, actions: dict[str, str], expected: list[str]) -> EnvStepReply:
    """One phase of a multi-agent game: `actions` must name exactly the `expected`
    (acting) seats. Raises ValueError naming the seats otherwise, TypeError unless
    step_phase returns a PhaseResult."""
    if sorted(actions) != sorted(expected):
        raise ValueError(f"actions: this phase's acting seats are {expected}, got {sorted(actions)}")
    r = game.step_phase(dict(actions))
    if not isinstance(r, PhaseResult):
        raise TypeError(f"step_phase must return PhaseResult, got {type(r).__name__}")
    seats = list(game.agents)
    unknown = [a for a in (*r.observations, *r.rewards) if a not in seats]
    if unknown:
        raise ValueError(f"step_phase named seats {unknown} that are not among {seats}")
    done = bool(r.done)
    return EnvStepReply(observations={a: str(o) for a, o in r.observations.items()},
                        rewards={a: float(x) for a, x in r.rewards.items()}, done=done,
                        acting=[] if done else _acting(game, seats), info=plain(dict(r.info or {})))


# generate_initial_state() without arguments draws from Python's global `random`, which
# the envhost seeds with the group's seed first; one such call at a time.
_GLOBAL_RANDOM = threading.Lock()


def initial_state(cls: type[AbstractGame], env_args: dict[str, Any], seed: int,
                  split: str) -> dict[str, Any]:
    """The state `reset` gets for a group: the seeded form `generate_initial_state(seed,
    split)` (split only when the method takes it), else OpenTinker's form: `random.seed(seed)`
    then `generate_initial_state()`. Raises TypeError unless the state is a dict."""
    make = cls(**env_args).generate_initial_state
    params = inspect.signature(make).parameters
    if "seed" in params:
        state = make(seed=seed, split=split) if "split" in params else make(seed=seed)
    else:
        with _GLOBAL_RANDOM:
            random.seed(seed)
            state = make()
    if not isinstance(state, dict):
        raise TypeError(f"generate_initial_state must return a dict, got {type(state).__name__}")
    return plain(state)


def take_step(game: AbstractGame, action: str) -> EnvStepReply:
    r = game.step(action)
    if not isinstance(r, StepResult):
        raise TypeError(f"step must return StepResult, got {type(r).__name__}")
    return EnvStepReply(observation=str(r.observation or ""), reward=float(r.reward),
                        done=bool(r.done), info=plain(dict(r.info or {})),
                        images=check_images(r.images))


class EnvHost:
    """The episodes this process holds, and the request handlers that act on them."""

    def __init__(self, envs: dict[str, type[AbstractGame]], host_id: str,
                 max_concurrency: int, episode_ttl_s: float, owner: str = "",
                 max_reply_bytes: int = 0):
        """`owner`: "" for the operator's envhost, else the user whose own envs these
        are (its subjects are then under ot.env.user.<owner>.). `max_reply_bytes`: the
        largest reply the connection may send (0: no limit); a larger one, or one over
        schemas.env's limits, is answered with an `error` naming the field instead."""
        self.envs = envs
        self.owner = owner
        # (job id, env_args) -> env_args with their paths confined to the job owner's
        # places (an operator's host: body() sets it; a user's own host reads its own disk)
        self.confine: Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]] | None = None
        self.max_reply_bytes = max_reply_bytes
        self.max_concurrency = max_concurrency
        self.host_id = host_id
        self.episode_ttl_s = episode_ttl_s
        self.episodes: dict[tuple[str, str], Episode] = {}  # (job id, episode id) -> its game
        # Bounds the user code running at once; calls beyond it wait for a thread.
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="env")

    async def _user(self, fn, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _drop(self, key: tuple[str, str]) -> None:
        """Forget episode `key` (if held) and call its game's `close()`, if it defines one,
        in a user-code thread; not awaited, and whatever it raises is logged (the episode
        is over either way)."""
        ep = self.episodes.pop(key, None)
        closer = getattr(ep and ep.game, "close", None)
        if callable(closer):
            with contextlib.suppress(RuntimeError):  # the pool is shut down: the host is stopping
                self._pool.submit(_close_game, ep.env, closer)

    def _failed(self, what: str, env: str, episode_id: str, e: Exception) -> str:
        log.warning("env %s %s failed (episode %r): %s", env, what, episode_id, user_error(e),
                    exc_info=e)
        return user_error(e)

    def _mismatch(self, name: str, req_env: str) -> str:
        return f"env: the request names {req_env!r} but was sent to env {name!r}"

    async def _confined(self, job_id: str, env_args: dict[str, Any]) -> dict[str, Any]:
        if self.confine is None or not (path_args(env_args) or url_args(env_args) or key_env_args(env_args)):
            return env_args
        return await self.confine(job_id, env_args)

    async def info(self, name: str, req: EnvInfoRequest, m: Msg) -> EnvInfoReply:
        return EnvInfoReply(env=name, host_id=self.host_id if req.env == name else "",
                            multi_agent=issubclass(self.envs[name], MultiAgentGame))

    def bounded(self, reply: Any, episode: tuple[str, str] | None = None) -> Any:
        """`reply`, or a reply of its type with only an `error` (and done) when it is over
        schemas.env's limits or the connection's payload limit: the rollout would refuse
        it, and the env's author reads here why. The episode, if any, is dropped."""
        why = check_env_reply(reply)
        room = self.max_reply_bytes - 4096  # headers (trace context) travel in the same message
        if not why and self.max_reply_bytes and (n := len(encode(reply))) > room:
            why = f"the reply is {n} bytes, over the limit of {room}"
        if not why:
            return reply
        log.warning("env reply refused (episode %r): %s", episode and episode[1], why)
        if episode is not None:
            self._drop(episode)
        return type(reply)(error=f"env reply over a limit: {why}")

    async def init(self, name: str, req: EnvInitRequest, m: Msg) -> EnvInitReply:
        if req.env != name:
            return EnvInitReply(error=self._mismatch(name, req.env))
        try:
            env_args = await self._confined(req.job_id, req.env_args)
        except (SpecError, ValueError) as e:
            return EnvInitReply(error=str(e))
        try:
            state = await self._user(initial_state, self.envs[name], env_args, req.seed, req.split)
        except Exception as e:  # user code: any exception ends this request, not the host
            return EnvInitReply(error=self._failed("generate_initial_state", name, "", e))
        return EnvInitReply(state=state)

    async def reset(self, name: str, req: EnvResetRequest, m: Msg) -> EnvResetReply:
        if req.env != name:
            return EnvResetReply(error=self._mismatch(name, req.env))
        cls = self.envs[name]
        try:
            env_args = await self._confined(req.job_id, req.env_args)
        except (SpecError, ValueError) as e:
            return EnvResetReply(error=str(e))
        try:
            if issubclass(cls, MultiAgentGame):
                game, openings, acting = await self._user(open_multi_episode, cls, env_args, req.state)
            else:
                game, system, user, tools = await self._user(open_episode, cls, env_args, req.state)
                images = await self._user(opening_images, game)
                privileged = await self._user(privileged_context, game) if req.privileged else ""
        except Exception as e:  # user code
            return EnvResetReply(error=self._failed("reset", name, req.episode_id, e))
        key = (req.job_id, req.episode_id)
        self._drop(key)  # a reset again under the same id replaces the game
        if isinstance(game, MultiAgentGame):
            self.episodes[key] = Episode(name, game, time.monotonic(), acting=acting)
            return self.bounded(EnvResetReply(host_id=self.host_id, agents=openings, acting=acting), key)
        self.episodes[key] = Episode(name, game, time.monotonic())
        return self.bounded(EnvResetReply(host_id=self.host_id, system_prompt=system, user_message=user,
                                          tools=tools, images=images, privileged_context=privileged), key)

    async def step(self, req: EnvStepRequest, m: Msg) -> EnvStepReply:
        key = (req.job_id, req.episode_id)
        ep = self.episodes.get(key)
        if ep is None:
            return EnvStepReply(error=f"episode_id: {req.episode_id!r} of job {req.job_id!r} is not open on "
                                      f"host {self.host_id} (never reset here, done, closed or expired)")
        # A retried step must not run user code twice at once on one game.
        async with ep.lock:
            ep.last_used = time.monotonic()
            try:
                if isinstance(ep.game, MultiAgentGame):
                    reply = await self._user(take_phase, ep.game, req.actions, ep.acting)
                    ep.acting = list(reply.acting)
                else:
                    reply = await self._user(take_step, ep.game, req.action)
            except Exception as e:  # user code
                self._drop(key)
                return EnvStepReply(error=self._failed("step", ep.env, req.episode_id, e), done=True)
            ep.last_used = time.monotonic()
        if reply.done:
            self._drop(key)
        return self.bounded(reply, key)

    async def close(self, req: EnvCloseRequest, m: Msg) -> EnvStepReply:
        self._drop((req.job_id, req.episode_id))
        return EnvStepReply(done=True)

    def shutdown(self) -> None:
        """Stop taking user calls; a call still running in a thread is not waited for."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def sweep(self, now: float | None = None) -> int:
        """Drop episodes idle for longer than the TTL; returns how many."""
        cutoff = (time.monotonic() if now is None else now) - self.episode_ttl_s
        stale = [k for k, ep in self.episodes.items() if ep.last_used < cutoff and not ep.lock.locked()]
        for k in stale:
            self._drop(k)
        if stale:
            log.info("dropped %d episodes idle for more than %.0f s", len(stale), self.episode_ttl_s)
        return len(stale)


def _close_game(env: str, closer: Callable[[], Any]) -> None:
    try:
        closer()
    except Exception as e:  # user code: logged, the host goes on
        log.warning("env %s close() failed: %s", env, user_error(e), exc_info=e)


def new_host_id(worker_id: str = "") -> str:
    """`worker_id` if set (it becomes a subject token), else a fresh "envhost-<hex>".

    Raises ValueError if `worker_id` is not [a-z0-9][a-z0-9_-]*.
    """
    if worker_id:
        if not ENV_NAME_RE.match(worker_id):
            raise ValueError(f"worker_id: {worker_id!r} must match {ENV_NAME_RE.pattern}")
        return worker_id
    return f"envhost-{secrets.token_hex(6)}"


OWNER_TTL_S = 60.0  # how long an envhost trusts what it read of a job's owner


async def confine_for_job(bus: Bus, home: str, cache: dict[str, tuple[float, Tenant]], job_id: str,
                          env_args: dict[str, Any], *, allowed_urls: tuple[str, ...] = (),
                          allowed_key_envs: tuple[str, ...] = ()) -> dict[str, Any]:
    """`env_args` with their path arguments confined to the places the owner of job
    `job_id` may name (services/core/access.py), as the scheduler checked at submit, and
    their URL and key-variable arguments checked against this envhost's allowlists
    (access.check_endpoint_args). A request naming no job (an operator's own call: only
    services publish here) and a job with no record count as the operator's, as
    access.tenant_of_job has it. Raises SpecError naming the argument, or `job_id` when
    it is not a job id."""
    if not job_id:
        return env_args
    if not JOB_ID_RE.match(job_id):
        raise SpecError("job_id", f"{job_id[:80]!r} is not a job id")
    now = time.monotonic()
    hit = cache.get(job_id)
    if hit is None or now - hit[0] > OWNER_TTL_S:
        if len(cache) > 10_000:
            cache.clear()
        hit = cache[job_id] = (now, await access.tenant_of_job(bus, job_id))
    out = access.confine_env_args(env_args, **hit[1].rules(home))
    return access.check_endpoint_args(out, admin=hit[1].admin, allowed_urls=allowed_urls,
                                      allowed_key_envs=allowed_key_envs)


async def serve_envs(bus: Bus, host: EnvHost) -> list[Any]:
    """Subscribe `host`'s handlers: init, reset and info of each env (queue groups), and
    the host's own step and close, under the operator's ot.env. or, for a user's own
    host, ot.env.user.<owner>.; returns the subscriptions, live on the server."""
    serve = partial(bus.serve_concurrently, max_in_flight=4 * host.max_concurrency)
    subs = []
    for name in host.envs:
        group = S.env_queue_group(name)
        subs.append(await serve(S.env_init(name, host.owner), EnvInitRequest, partial(host.init, name), queue=group))
        subs.append(await serve(S.env_reset(name, host.owner), EnvResetRequest, partial(host.reset, name),
                                queue=group))
        subs.append(await serve(S.env_info(name, host.owner), EnvInfoRequest, partial(host.info, name), queue=group))
    subs.append(await serve(S.env_step(host.host_id, host.owner), EnvStepRequest, host.step))
    subs.append(await serve(S.env_close(host.host_id, host.owner), EnvCloseRequest, host.close))
    await bus.nc.flush()  # subscriptions are live on the server before we say so
    return subs


async def hold(host: EnvHost, subs: list[Any], stop: asyncio.Event) -> None:
    """Sweep idle episodes until `stop` is set; then unsubscribe and stop user calls."""
    sweep_every_s = min(30.0, max(0.5, host.episode_ttl_s / 4))
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), sweep_every_s)
        except TimeoutError:
            host.sweep()
    for sub in subs:
        with contextlib.suppress(nats.errors.Error):
            await sub.unsubscribe()
    host.shutdown()


async def body(settings: Settings, bus: Bus, stop: asyncio.Event,
               envs: dict[str, type[AbstractGame]]) -> None:
    # Built-in envs find their data under OPENTINKER_HOME; `home` may have come from
    # a settings file or a KEY=VALUE override instead, and then it must win.
    os.environ["OPENTINKER_HOME"] = settings.home
    n = settings.envhost_max_concurrency
    host = EnvHost(envs, new_host_id(settings.worker_id), n, settings.envhost_episode_ttl_s)
    host.confine = partial(confine_for_job, bus, settings.home, {},
                           allowed_urls=split_setting(settings.envhost_allowed_urls),
                           allowed_key_envs=split_setting(settings.envhost_allowed_key_envs))
    subs = await serve_envs(bus, host)
    catalog = await bus.kv(S.KV_ENVS)
    for name in envs:  # the operator's catalog: what a job may name (the scheduler checks)
        await bus._retry("env catalog", catalog.put, name,
                         encode(EnvServed(env=name, host_id=host.host_id, time_s=time.time())))
    log.info("envhost %s (%s pid %d) serving %s", host.host_id, socket.gethostname(), os.getpid(),
             ", ".join(envs))
    await hold(host, subs, stop)


def main(argv: list[str] | None = None) -> None:
    """`opentinker envhost [--env SPEC ...] [--env-path DIR ...] [--name NAME]
    [--config FILE] [--print-config] [KEY=VALUE ...]`. Exits 2 on a bad `--env`."""
    p = argparse.ArgumentParser(
        prog="opentinker envhost", allow_abbrev=False,
        description="Serve environments to rollout workers.",
        epilog="Service settings follow: [--config FILE] [--print-config] [KEY=VALUE ...].")
    p.add_argument("--env", action="append", default=[], metavar="SPEC",
                   help="built-in name, module:Class or path/to/file.py:Class (repeatable; "
                        "default: every built-in)")
    p.add_argument("--env-path", action="append", default=[], metavar="DIR",
                   help="extra folder to import --env modules from (repeatable)")
    p.add_argument("--name", help="serve a single --env under this name instead of its get_interaction_name()")
    p.add_argument("--as-user", action="store_true",
                   help="serve as the API key's user, to that user's own jobs only (the default when "
                        "there are no service credentials and OPENTINKER_API_URL is set)")
    args, rest = p.parse_known_args(argv)
    try:
        envs = load_envs(args.env, args.env_path, args.name)
    except EnvLoadError as e:
        p.error(str(e))
    if args.as_user or tenant_by_default():
        from opentinker.services.envhost.tenant import run_cli

        run_cli(envs, rest)
        return
    run_service("envhost", partial(body, envs=envs), rest)


def tenant_by_default() -> bool:
    """Whether `opentinker envhost` serves as a user: no service credentials for the
    NATS URL (no $NATS_NKEY, $NATS_CREDS or local stack), and a REST API to learn the
    API key's user from ($OPENTINKER_API_URL)."""
    return not service_credentials(default_nats_url(os.environ.get("NATS_URL"))) and bool(
        os.environ.get("OPENTINKER_API_URL"))
