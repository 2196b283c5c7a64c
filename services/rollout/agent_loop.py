"""The agent loop: run groups of episodes against an engine and an environment client,
token-exact: the trajectory's token ids are exactly what the policy saw and sampled.

Each episode moves PENDING -> GENERATING <-> INTERACTING -> TERMINATED:

- PENDING: the group's initial state comes from one `EnvInitRequest`; each episode is
  reset (`EnvResetRequest`) and its prompt is the chat template of [system, user].
- GENERATING: every GENERATING episode of every group goes into ONE engine call per
  round (CPU throughput grows with batch size).
- INTERACTING: the action text goes to `env.step`; unless the episode ends, the
  observation's tokens (a user turn in the chat template) are appended.
- TERMINATED: env `done`, an env error, the turn limit or the token budget.
  A request that names a distillation teacher has its ended episodes scored by the
  teacher (teacher.py) before the group is handed on.

A multi-agent env (JobSpec.agents > 1) plays each episode as a game of seats;
coordinator.py runs its phases, and each seat joins the GENERATING rounds as an
episode of its own.

The trajectory keeps exactly the ids the engine was fed and produced: policy tokens
are never detokenized and retokenized. Only observations are tokenized.

Vision-language models: the env's images (with the first user message and with
observations) become image parts of the message ahead of its text, rendered by the
model's processor's chat template; the processor expands each image's placeholder
into the model's image tokens, so token_ids hold exactly what the model reads, and the
images travel with the prompt to the engine and, in the trajectory, to the learner.

The engine and the env client are passed in (protocols below), so this module is
tested with the transformers engine and an in-process env, and served by service.py
with either engine and the NATS env client.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from opentinker.schemas import (
    EnvCloseRequest,
    EnvInitReply,
    EnvInitRequest,
    EnvResetReply,
    EnvResetRequest,
    EnvStepReply,
    EnvStepRequest,
    RolloutRequest,
    SamplingParams,
    Trajectory,
    TurnRecord,
)
from opentinker.schemas.rollout import SEATS_MISMATCH
from opentinker.schemas.stats import derived_seed
from opentinker.services.core import tracing
from opentinker.services.rollout.chat import ChatRenderer
from opentinker.services.rollout.coordinator import Coordinator, Game
from opentinker.services.rollout.teacher import ScoreByModel, score_by_teachers, teacher_prompt


@dataclass(frozen=True)
class GenOut:
    """One engine completion.

    token_ids: [n] int    the sampled ids, the stop token included when it was sampled
    logprobs:  [n] float  the sampler's logprob of each id under the temperature/top-p
                          processed distribution (what the learner's ratio needs)
    finish_reason: "stop" (a stop token) or "length" (hit max_new_tokens)
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


class Engine(Protocol):
    """What the agent loop needs from a generation engine."""

    name: str
    max_model_len: int
    tokenizer: Any

    def generate(self, prompts: list[list[int]], sampling: SamplingParams | Sequence[SamplingParams],
                 max_new_tokens: Sequence[int] | None = None,
                 images: Sequence[Sequence[bytes]] | None = None,
                 seeds: Sequence[int | None] | None = None) -> list[GenOut]: ...


class EnvError(Exception):
    """An environment RPC failed (no responder, timeout, unreadable reply)."""


class EnvClient(Protocol):
    """Environment RPC. Implementations raise EnvError on transport failures; errors
    inside the user's env come back in the reply's `error` field."""

    async def init(self, req: EnvInitRequest) -> EnvInitReply: ...
    async def reset(self, req: EnvResetRequest) -> EnvResetReply: ...
    async def step(self, host_id: str, req: EnvStepRequest) -> EnvStepReply: ...
    async def close(self, host_id: str, req: EnvCloseRequest) -> None: ...


class Phase(str, Enum):
    PENDING = "pending"
    GENERATING = "generating"
    INTERACTING = "interacting"
    TERMINATED = "terminated"


def episode_id(request_id: str, index: int) -> str:
    """Deterministic, so a redelivered request publishes the same ids (and dedups)."""
    return f"{request_id}-e{index}"


def sample_seed(group_seed: int, episode_id: str, request_id: str, turn: int) -> int:
    """The sampling seed of an episode's `turn`-th reply (0-based): a pure function of
    the group's seed, the episode's place in its group (its id after the request id:
    `-e3`, or `-e3-white` for a game's seat) and the turn. A job's seed so fixes its
    samples as well as its prompts: two runs of a job draw the same completions where
    their policies agree, and a redelivered request draws what the lost one did."""
    return derived_seed("sample", group_seed, episode_id.removeprefix(request_id), turn)


def seeds_per_prompt(seeds: Sequence[int | None] | None, n: int) -> list[int | None]:
    """An engine's `seeds` argument as one seed (or None: the engine's generator) per
    prompt of `n`; None gives n Nones. Raises ValueError unless one seed per prompt."""
    if seeds is None:
        return [None] * n
    if len(seeds) != n:
        raise ValueError(f"{len(seeds)} seeds for {n} prompts")
    return [None if x is None else int(x) for x in seeds]


@dataclass
class _Episode:
    req: RolloutRequest
    index: int
    episode_id: str
    phase: Phase = Phase.PENDING
    host_id: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)
    images: list[bytes] = field(default_factory=list)  # in placeholder order
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_len: int = 0
    turns: list[TurnRecord] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    gen_ms: float = 0.0
    env_ms: float = 0.0
    span: Any = None  # rollout.episode (tracing.py), from reset to the trajectory
    agent: str = ""  # the seat of a multi-agent game
    game: Game | None = None
    policy_of: str = ""  # the job whose policy plays this seat ("" = the request's job)
    # a distillation teacher's first prompt when it differs from the policy's (privileged
    # context), and the teacher's logprobs of token_ids once scored (Trajectory.teacher_logprobs)
    teacher_prompt: list[int] | None = None
    teacher_logprobs: list[float] = field(default_factory=list)

    def fail(self, error: str) -> None:
        self.error = error
        self.phase = Phase.TERMINATED

    def open_prompt(self, renderer: ChatRenderer, system: str, user: str,
                    tools: list[dict[str, Any]] | None = None, images: Sequence[bytes] = ()) -> None:
        """The first prompt: [system,] user (with `images` ahead of its text, and
        `tools`) rendered with the generation prompt; no policy token. Raises
        ValueError for images the model cannot take (ChatRenderer.ids)."""
        self.messages += renderer.opening(system, user, len(images))
        self.tools = list(tools or [])
        self.images = list(images)
        self.token_ids = renderer.prompt_ids(self.messages, self.tools, self.images)
        self.prompt_len = len(self.token_ids)
        self.loss_mask = [0] * self.prompt_len
        self.logprobs = [0.0] * self.prompt_len

    def prompt_too_long(self, budget: int) -> str:
        """The error for a first prompt at or past the token budget; "" when it fits."""
        if self.prompt_len < budget:
            return ""
        return (f"prompt has {self.prompt_len} tokens; the token budget "
                f"(sampling.max_total_tokens, engine max_model_len) is {budget}")

    def add_action(self, out: GenOut, gen_ms: float, tokenizer: Any) -> str:
        """Append a completion as sampled (loss mask 1, its logprobs) and the assistant
        message; returns the action text."""
        self.token_ids.extend(out.token_ids)
        self.loss_mask.extend([1] * len(out.token_ids))
        self.logprobs.extend(out.logprobs)
        self.gen_ms += gen_ms
        action = tokenizer.decode(out.token_ids, skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": action})
        return action

    def add_observation(self, renderer: ChatRenderer, obs_ids: list[int], role: str, text: str,
                        images: Sequence[bytes] = ()) -> None:
        """Append an observation's ids (loss mask 0), its images and its message."""
        self.token_ids.extend(obs_ids)
        self.loss_mask.extend([0] * len(obs_ids))
        self.logprobs.extend([0.0] * len(obs_ids))
        self.images.extend(images)
        self.messages.append(renderer.message(role, text, len(images)))


@dataclass
class _Group:
    req: RolloutRequest
    episodes: list[_Episode]  # a multi-agent group's: every game's seats, after the reset
    done: bool = False
    span: Any = None
    games: list[Game] = field(default_factory=list)


PolicyVersion = Callable[..., Awaitable[int]]
GroupDone = Callable[[RolloutRequest, list[Trajectory]], Awaitable[None]]


class AgentLoop:
    """Runs RolloutRequests to Trajectories with one engine and one env client.

    engine: see `Engine`; its `generate` runs in `executor` (a thread), so the event
    loop keeps serving the bus meanwhile. `worker` is recorded in each trajectory.
    score_by_model: how a `teacher = "model"` request's teacher scores (teacher.py's
    ScoreByModel; the rollout service's engine of that model); None: such episodes end
    with an error naming it.
    """

    def __init__(self, engine: Engine, env: EnvClient, *, worker: str = "",
                 executor: Executor | None = None, score_by_model: ScoreByModel | None = None):
        self.engine = engine
        self.env = env
        self.score_by_model = score_by_model
        self.worker = worker
        self.executor = executor
        self.renderer = ChatRenderer(engine.tokenizer, getattr(engine, "processor", None))
        self.spans: dict[str, Any] = {}  # episode id -> its rollout.episode span
        self.coordinator = Coordinator(self)

    async def run(self, requests: Sequence[RolloutRequest], policy_version: PolicyVersion,
                  on_group_done: GroupDone | None = None,
                  parents: Mapping[str, Any] | None = None,
                  engine_lock: asyncio.Lock | None = None) -> list[list[Trajectory]]:
        """Run every request's group to the end; returns one list of `group_size`
        trajectories per request, in order.

        policy_version: awaited before each generation round; it makes sure the
        engine holds the policy to use and returns its version (recorded per turn).
        Awaited with a job id (`policy_version(job_id)`) before the round's generation
        for the seats that job's policy plays (RolloutRequest.opponents), and before a
        distillation teacher's scoring (`policy_version(teacher_job)`, or
        `policy_version(base=True)` for the model's own weights; teacher.py).
        on_group_done: awaited as soon as a group's episodes have all ended (publish
        and ack there, before slower groups finish).
        parents: request id -> the trace context its message carried (tracing.py);
        each group's span continues it, and each episode's span is the group's child.
        engine_lock: held around each round's policy load and generation only (None:
        the caller holds the engine for the whole run); a run whose env calls are not to
        be trusted to return soon (a tenant's own envhost) so never holds an engine that
        other jobs share while it waits on the env.
        Env failures end the affected episodes with `error` set; engine errors raise.
        """
        groups = []
        for r in requests:
            if r.agents > 1:
                groups.append(_Group(r, [], games=[Game(r, episode_id(r.request_id, i)) for i in range(r.group_size)]))
            else:
                groups.append(_Group(r, [_Episode(r, i, episode_id(r.request_id, i)) for i in range(r.group_size)]))
        for g in groups:
            r = g.req
            g.span = tracing.start("rollout.group", (parents or {}).get(r.request_id),
                                   {"ot.job_id": r.job_id, "ot.request_id": r.request_id, "ot.step": r.step,
                                    "ot.group_index": r.group_index, "ot.env": r.env})
            for e in g.episodes:
                self._trace(g, e)
        results: dict[int, list[Trajectory]] = {}

        async def finish_ready() -> None:
            ready = [gi for gi, g in enumerate(groups)
                     if not g.done and all(e.phase is Phase.TERMINATED for e in g.episodes)]
            await score_by_teachers(self.engine, self.executor, [e for gi in ready for e in groups[gi].episodes],
                                    policy_version, engine_lock, self.score_by_model)
            for gi in ready:
                g = groups[gi]
                g.done = True
                results[gi] = [self._trajectory(e) for e in g.episodes]
                if on_group_done is not None:
                    with tracing.within(g.span):
                        await on_group_done(g.req, results[gi])
                g.span.end()

        await asyncio.gather(*(self._start(g) for g in groups))
        await finish_ready()
        while active := [e for g in groups for e in g.episodes if e.phase is Phase.GENERATING]:
            # one engine call per policy: the job's own, then each opponent job's
            by_policy: dict[str, list[_Episode]] = {}
            for e in active:
                by_policy.setdefault(e.policy_of, []).append(e)
            done: list[tuple[_Episode, GenOut, int, float]] = []
            for of, part in sorted(by_policy.items()):
                async with engine_lock or contextlib.nullcontext():
                    version = await (policy_version(of) if of else policy_version())
                    outs, gen_ms = await self._generate(part, version)
                done += [(e, o, version, gen_ms) for e, o in zip(part, outs)]
            phases: dict[str, tuple[Game, dict[str, tuple[GenOut, int]], float]] = {}
            for e, o, version, gen_ms in done:
                if e.game is not None:
                    game, got, ms = phases.setdefault(e.game.game_id, (e.game, {}, 0.0))
                    got[e.agent] = (o, version)
                    phases[e.game.game_id] = (game, got, max(ms, gen_ms))
            await asyncio.gather(*(self._interact(e, o, version, gen_ms)
                                   for e, o, version, gen_ms in done if e.game is None),
                                 *(self.coordinator.phase(game, got, gen_ms) for game, got, gen_ms in phases.values()))
            await finish_ready()
        return [results[i] for i in range(len(groups))]

    async def _generate(self, active: list[_Episode], version: int) -> tuple[list[GenOut], float]:
        """One batched engine call for `active` (in the executor); returns the
        completions in order and the call's milliseconds."""
        limits = [self._budget(e.req) - len(e.token_ids) for e in active]
        seeds = [sample_seed(e.req.group_seed, e.episode_id, e.req.request_id, len(e.turns)) for e in active]
        t0 = time.perf_counter()
        # one batched call for many episodes: its own span, linked to each of them
        with tracing.span("rollout.generate", attrs={"ot.prompts": len(active), "ot.policy_version": version},
                          links=[tracing.link(e.span) for e in active]):
            # images only where some prompt has them: a text engine keeps its signature
            vision = {"images": [e.images for e in active]} if any(e.images for e in active) else {}
            outs = await asyncio.get_running_loop().run_in_executor(
                self.executor, functools.partial(self.engine.generate, **vision, seeds=seeds),
                [e.token_ids for e in active], [e.req.sampling for e in active], limits)
        if len(outs) != len(active):
            raise RuntimeError(f"engine returned {len(outs)} completions for {len(active)} prompts")
        return outs, (time.perf_counter() - t0) * 1e3

    def _budget(self, req: RolloutRequest) -> int:
        return min(req.sampling.max_total_tokens, self.engine.max_model_len)

    def _trace(self, g: _Group, e: _Episode) -> None:
        r = g.req
        e.span = tracing.start("rollout.episode", tracing.child_of(g.span),
                               {"ot.episode_id": e.episode_id, "ot.job_id": r.job_id, "ot.step": r.step,
                                **({"ot.agent": e.agent} if e.agent else {})})
        self.spans[e.episode_id] = e.span

    def _seat_up(self, g: _Group, game: Game, agents: list[str]) -> None:
        """The game's seat episodes (episode id `<game id>-<seat>`), one per seat."""
        for a in agents:
            e = _Episode(g.req, len(g.episodes), f"{game.game_id}-{a}", agent=a, game=game,
                         policy_of=g.req.opponents.get(a, ""))
            game.seats[a] = e
            g.episodes.append(e)
            self._trace(g, e)

    async def _start(self, g: _Group) -> None:
        r = g.req
        try:
            with tracing.within(g.span), tracing.span("rollout.env_init", kind=tracing.SpanKind.CLIENT):
                init = await self.env.init(EnvInitRequest(env=r.env, env_args=r.env_args, job_id=r.job_id,
                                                          seed=r.group_seed, split=r.split))
            error = f"env init: {init.error}" if init.error else ""
        except EnvError as e:
            init, error = None, f"env init: {e}"
        if error:
            for game in g.games:  # each seat still answers, with the error
                self._seat_up(g, game, [f"seat{k}" for k in range(r.agents)])
            for e in g.episodes:
                e.fail(error)
            return
        if g.games:
            await asyncio.gather(*(self._reset_game(g, game, init.state) for game in g.games))
            return
        await asyncio.gather(*(self._reset(e, init.state) for e in g.episodes))

    async def _reset_game(self, g: _Group, game: Game, state: dict[str, Any]) -> None:
        """Reset a multi-agent game; its seats must number the job's `agents`."""
        r = g.req
        t0 = time.perf_counter()
        error, reply = "", None
        try:
            with tracing.within(g.span), tracing.span("rollout.env_reset", kind=tracing.SpanKind.CLIENT):
                reply = await self.env.reset(EnvResetRequest(env=r.env, episode_id=game.game_id, job_id=r.job_id,
                                                             env_args=r.env_args, state=state))
        except EnvError as err:
            error = f"env reset: {err}"
        if reply is not None and reply.error:
            error = f"env reset: {reply.error}"
        elif reply is not None and len(reply.agents) != r.agents:
            error = (f"{SEATS_MISMATCH}env {r.env!r} is single-agent; set agents = 1" if not reply.agents else
                     f"{SEATS_MISMATCH}env {r.env!r} has {len(reply.agents)} seats "
                     f"({', '.join(o.agent for o in reply.agents)}); the job's agents is {r.agents}")
        elif reply is not None and (stray := sorted(set(r.opponents) - {o.agent for o in reply.agents})):
            error = (f"{SEATS_MISMATCH}opponents name seats {stray} that env {r.env!r} does not have "
                     f"(its seats: {', '.join(o.agent for o in reply.agents)})")
        seats = [o.agent for o in reply.agents] if reply is not None and not error else \
            [f"seat{k}" for k in range(r.agents)]
        self._seat_up(g, game, seats)
        game.host_id = reply.host_id if reply is not None else ""
        for e in game.seats.values():
            e.env_ms += (time.perf_counter() - t0) * 1e3
            e.host_id = game.host_id
        if error:
            for e in game.seats.values():
                e.fail(error)
            await self._close(next(iter(game.seats.values())))  # nothing to close without a host
            return
        game.opening = {o.agent: (o.system_prompt, o.user_message) for o in reply.agents}
        game.acting = list(reply.acting)
        self.coordinator.start(game)
        if all(e.phase is Phase.TERMINATED for e in game.seats.values()):
            await self._close(next(iter(game.seats.values())))

    async def _reset(self, e: _Episode, state: dict[str, Any]) -> None:
        r = e.req
        t0 = time.perf_counter()
        try:
            with tracing.within(e.span), tracing.span("rollout.env_reset", kind=tracing.SpanKind.CLIENT):
                reply = await self.env.reset(EnvResetRequest(
                    env=r.env, episode_id=e.episode_id, job_id=r.job_id, env_args=r.env_args, state=state,
                    privileged=r.teacher_context == "privileged"))
        except EnvError as err:
            e.fail(f"env reset: {err}")
            return
        finally:
            e.env_ms += (time.perf_counter() - t0) * 1e3
        if reply.error:
            e.fail(f"env reset: {reply.error}")
            return
        e.host_id = reply.host_id
        if reply.agents:
            e.fail(f"{SEATS_MISMATCH}env {r.env!r} is a multi-agent game with seats "
                   f"{[o.agent for o in reply.agents]}; set agents = {len(reply.agents)} in the job spec")
            await self._close(e)
            return
        try:
            e.open_prompt(self.renderer, reply.system_prompt, reply.user_message, reply.tools, reply.images)
            if r.teacher_context == "privileged":
                e.teacher_prompt = teacher_prompt(self.renderer, r.env, reply)
        except ValueError as err:  # images the model cannot take, no privileged context
            e.fail(f"env reset: {err}")
            await self._close(e)
            return
        if too_long := e.prompt_too_long(self._budget(r)):
            e.fail(too_long)
            await self._close(e)
            return
        e.phase = Phase.GENERATING

    async def _interact(self, e: _Episode, out: GenOut, version: int, gen_ms: float) -> None:
        e.phase = Phase.INTERACTING
        gen_start = len(e.token_ids)
        action = e.add_action(out, gen_ms, self.engine.tokenizer)
        gen_end = len(e.token_ids)

        t0 = time.perf_counter()
        reply: EnvStepReply | None = None
        try:
            with tracing.within(e.span), tracing.span("rollout.env_step", kind=tracing.SpanKind.CLIENT,
                                                      attrs={"ot.turn": len(e.turns)}):
                reply = await self.env.step(e.host_id, EnvStepRequest(episode_id=e.episode_id, action=action,
                                                                      job_id=e.req.job_id))
        except EnvError as err:
            e.error = f"env step: {err}"
        env_ms = (time.perf_counter() - t0) * 1e3
        e.env_ms += env_ms
        if reply is not None and reply.error:
            e.error = f"env step: {reply.error}"
        if reply is not None:
            e.info = dict(reply.info)
        observation = reply.observation if reply is not None else ""
        images = list(reply.images) if reply is not None else []

        ended_by_env = reply is not None and (reply.done or bool(reply.error))
        next_phase = Phase.TERMINATED
        shown = 0  # images of the observation, once it is appended
        if not e.error and not ended_by_env and len(e.turns) + 1 < e.req.sampling.max_turns:
            last = out.token_ids[-1] if out.token_ids else None
            role = self.renderer.observation_role(e.tools)
            try:
                obs_ids = self.renderer.observation_ids(e.messages, observation, last, out.finish_reason,
                                                        role, e.tools, images)
            except ValueError as err:  # images the model cannot take
                e.error, obs_ids = f"env step: {err}", None
            if obs_ids is not None and len(e.token_ids) + len(obs_ids) < self._budget(e.req):
                e.add_observation(self.renderer, obs_ids, role, observation, images)
                shown = len(images)
                next_phase = Phase.GENERATING
        e.turns.append(TurnRecord(
            gen_start=gen_start, gen_end=gen_end, obs_end=len(e.token_ids),
            reward=reply.reward if reply is not None else 0.0, policy_version=version,
            finish_reason=out.finish_reason, action=action, observation=observation,
            gen_ms=gen_ms, env_ms=env_ms, images=shown))
        e.phase = next_phase
        if next_phase is Phase.TERMINATED and not ended_by_env:
            # turn/token limit or a failed RPC: the host still holds the episode
            await self._close(e)

    async def _close(self, e: _Episode) -> None:
        if not e.host_id:
            return
        try:
            with tracing.within(e.span):
                await self.env.close(e.host_id, EnvCloseRequest(
                    episode_id=e.game.game_id if e.game is not None else e.episode_id, job_id=e.req.job_id))
        except EnvError:
            pass  # best effort: a close only frees the host early; the trajectory is complete

    def _trajectory(self, e: _Episode) -> Trajectory:
        r = e.req
        if e.span is not None:
            e.span.set_attributes({"ot.reward": sum(t.reward for t in e.turns), "ot.turns": len(e.turns),
                                   "ot.tokens": len(e.token_ids), **({"ot.error": e.error} if e.error else {})})
            e.span.end()
        return Trajectory(
            job_id=r.job_id, request_id=r.request_id, episode_id=e.episode_id, step=r.step,
            group_index=r.group_index, group_size=r.group_size,
            token_ids=e.token_ids, loss_mask=e.loss_mask, logprobs=e.logprobs,
            prompt_len=e.prompt_len, turns=e.turns, reward=sum(t.reward for t in e.turns),
            policy_version=min((t.policy_version for t in e.turns), default=r.policy_version),
            env=r.env, split=r.split, purpose=r.purpose, env_info=e.info, error=e.error, worker=self.worker,
            engine=self.engine.name, gen_ms=e.gen_ms, env_ms=e.env_ms, created_s=time.time(),
            agent=e.agent, game_id=e.game.game_id if e.game is not None else "", images=e.images,
            policy_of=e.policy_of, teacher_logprobs=e.teacher_logprobs)
