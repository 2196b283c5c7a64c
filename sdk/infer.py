"""Inference on any environment with a base model, a LoRA adapter or a job's policy,
through the same services (and the same environment class, unchanged) as training.

    async with await Client.connect() as c:
        result = await c.infer(env="arith", job="my-job", episodes=64, split="test")
        print(result.summary)

An inference run is a job of its own (`infer-...`, kind "inference"): the scheduler
places it on a rollout worker of the pool (no learner), and the run ends it when its
episodes are in. Its policy is announced as a weight event on `ot.job.<run>.weights` (an adapter's bytes go to the
object store; a job's policy is its latest weight event, re-announced), its episodes
are RolloutRequests on `ot.job.<run>.rollout.<worker>`, and its trajectories come back on
`ot.job.<run>.traj` (so the recorder logs them too). The same `seed` gives the same
problems, so two runs (base model, trained policy) compare on identical episodes.

Who sends the requests: a service identity publishes them itself. An API-key user
publishes nothing on the bus, so the run's episodes travel in its SubmitJob as an
InferencePlan, the scheduler asks the placed workers for them, the user follows the
trajectories live (and from the REST API's history) and completes the run over REST
(`POST /v1/jobs/{id}/complete`). A user's run takes a job's policy or a base model, not
an adapter file. An env the user serves from their own envhost is found as in training.

Writes `<out>/episodes.jsonl`, `<out>/episodes.parquet` (when pyarrow is installed)
and `<out>/summary.json`. Imports no torch: adapters are read as bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from opentinker.schemas import (
    DeadLetter,
    JobSpec,
    JobState,
    JobStateChanged,
    RolloutRequest,
    SamplingParams,
    Trajectory,
    WeightsPublished,
    decode,
)
from opentinker.schemas import subjects as S
from opentinker.schemas.control import InferencePlan
from opentinker.schemas.job import SpecError
from opentinker.schemas.stats import derived_seed, episode_stats, game_results

if TYPE_CHECKING:
    from opentinker.sdk.client import Client


class InferError(RuntimeError):
    """An inference run could not start or finish; the message names the cause."""


@dataclass
class InferResult:
    """What `infer` produced. `trajectories` in episode order; `summary` as in summary.json."""

    run_id: str
    trajectories: list[Trajectory]
    summary: dict[str, Any]
    out_dir: Path | None


def episode_seed(seed: int, index: int) -> int:
    """The initial-state seed of group `index`: a pure function of (seed, index)."""
    return derived_seed("infer", seed, index)


def new_run_id() -> str:
    return f"infer-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def read_adapter(path: str | Path) -> tuple[bytes, dict[str, Any]]:
    """(adapter_model.safetensors bytes, adapter_config.json) of a peft adapter folder.

    Raises InferError naming the missing file or a non-LoRA adapter.
    """
    folder = Path(path).expanduser()
    cfg_path, weights = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    for p in (cfg_path, weights):
        if not p.is_file():
            raise InferError(f"adapter: {p} not found (expected a peft LoRA adapter folder)")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise InferError(f"adapter: {cfg_path} is a {cfg.get('peft_type')} adapter; only LoRA is served")
    return weights.read_bytes(), cfg


def summarize(trajs: list[Trajectory]) -> dict[str, Any]:
    """The run's summary: `episode_stats` (episodes, reward_mean/std, correct_frac, ...),
    the game results (win/draw/loss_rate, games only) and totals: gen_tokens_total,
    tokens_total, errors."""
    return {**episode_stats(trajs), **game_results(trajs),
            "gen_tokens_total": sum(sum(t.loss_mask) for t in trajs),
            "tokens_total": sum(len(t.token_ids) for t in trajs),
            "errors": sum(1 for t in trajs if t.error)}


def episode_row(t: Trajectory) -> dict[str, Any]:
    """One JSONL/Parquet row: the episode as text and numbers (no token ids)."""
    return {
        "episode_id": t.episode_id, "request_id": t.request_id, "group_index": t.group_index,
        "split": t.split, "env": t.env, "reward": t.reward, "correct": t.env_info.get("correct"),
        "num_turns": len(t.turns), "gen_tokens": sum(t.loss_mask), "num_tokens": len(t.token_ids),
        "actions": [turn.action for turn in t.turns], "observations": [turn.observation for turn in t.turns],
        "turn_rewards": [turn.reward for turn in t.turns], "policy_version": t.policy_version,
        "env_info": json.dumps(t.env_info, default=str), "error": t.error, "engine": t.engine,
        "worker": t.worker,
    }


def write_results(out_dir: str | Path, trajs: list[Trajectory], summary: dict[str, Any]) -> Path:
    """episodes.jsonl, episodes.parquet (if pyarrow is installed) and summary.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = [episode_row(t) for t in trajs]
    with open(out / "episodes.jsonl", "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        summary["parquet"] = "skipped: pyarrow is not installed"
    else:
        pq.write_table(pa.Table.from_pylist(rows), out / "episodes.parquet")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return out


async def _announce_adapter(client: Client, run_id: str, adapter: str) -> None:
    """Publish a local peft adapter as the run's weight event v1. (A job's policy is
    copied by the scheduler instead: SubmitJob.policy_of.)"""
    bus = client.bus
    data, cfg = read_adapter(adapter)
    name = f"{run_id}/v1"
    await bus.put_object(S.OBJ_WEIGHTS, name, data)
    ev = WeightsPublished(job_id=run_id, policy_version=1, kind="lora",
                          uri=f"nats-os://{S.OBJ_WEIGHTS}/{name}",
                          sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data),
                          lora_rank=int(cfg["r"]), lora_alpha=int(cfg.get("lora_alpha", cfg["r"])),
                          target_modules=list(cfg.get("target_modules") or []), time_s=time.time())
    await bus.publish(S.job(run_id, "weights"), ev, msg_id=f"{run_id}-w1")


async def infer(client: Client, *, env: str, model: str | None = None, adapter: str | None = None,
                job: str | None = None, env_args: dict[str, Any] | None = None, episodes: int = 32,
                group_size: int = 1, split: str = "test", seed: int = 0,
                sampling: SamplingParams | None = None, engine: str = "auto",
                out_dir: str | Path | None = None, run_id: str = "", timeout_s: float = 1800.0,
                on_episode: Any = None, agents: int = 1) -> InferResult:
    """Run `episodes` episodes of `env` (in groups of `group_size` sharing an initial
    state) with `model`, plus `adapter` (a peft LoRA folder) or `job`'s latest policy.

    With `job` and no `model`, the job's own model is used. `agents`: the seats of a
    multi-agent env (each episode gives one trajectory per seat, all played by the one
    policy; a job's own `agents` when `job` is given and `agents` is 1). `sampling` defaults to
    greedy (temperature 0) with 256 new tokens per turn. `on_episode(traj)` is called
    as each episode arrives. Raises InferError for a bad adapter or job, a request the
    rollout service refused (its dead-letter reason), or a run not done within
    `timeout_s`; SpecError-like ValueError for bad arguments. An API-key user's run is
    sent by the scheduler (InferencePlan), and may not take an `adapter`.
    """
    if client.is_user and adapter:
        raise InferError("adapter: an API-key user cannot put weights on the bus; run a job's policy "
                         "(job=...) or a base model (model=...), or train the adapter as a job here")
    if adapter and job:
        raise ValueError("adapter and job: pass one, not both")
    if episodes < 1 or group_size < 1 or episodes % group_size:
        raise ValueError(f"episodes ({episodes}) must be a positive multiple of group_size ({group_size})")
    run_id = S.check_job_id(run_id or new_run_id())
    if not 1 <= agents <= 8:
        raise ValueError(f"agents: must be 1..8, got {agents}")
    if job and (not model or agents == 1):
        try:
            spec = (await client.job(job).record()).spec
        except KeyError:
            raise InferError(f"job: no job {job!r} on this bus") from None
        model, agents = model or spec.model, agents if agents > 1 else spec.agents
    model = model or "smollm2-135m-instruct"
    sampling = sampling or SamplingParams(temperature=0.0, max_new_tokens=256, max_total_tokens=2048)
    if adapter:
        await _announce_adapter(client, run_id, adapter)
    version = 1 if adapter or job else 0

    t0 = time.monotonic()
    if client.is_user:  # the scheduler asks the workers for the plan's episodes (see module doc)
        trajs = await _run_as_user(client, run_id, JobSpec(name="infer", model=model, env=env, engine=engine,
                                                          env_args=dict(env_args or {})),
                                   InferencePlan(episodes=episodes, group_size=group_size, split=split, seed=seed,
                                                 sampling=sampling, agents=agents),
                                   job or "", timeout_s, on_episode)
    else:
        trajs = await _run_as_service(client, run_id, model, env, engine, env_args, episodes, group_size, split,
                                      seed, sampling, agents, job, version, timeout_s, on_episode)
    summary = summarize(trajs)
    summary.update(run_id=run_id, env=env, env_args=dict(env_args or {}), split=split, seed=seed,
                   model=model, adapter=str(adapter) if adapter else None, job=job,
                   policy_version=version, sampling=msgspec.to_builtins(sampling),
                   wall_s=round(time.monotonic() - t0, 2))
    out = write_results(out_dir, trajs, summary) if out_dir else None
    return InferResult(run_id, trajs, summary, out)


async def _run_as_user(client: Client, run_id: str, spec: JobSpec, plan: InferencePlan, job: str,
                       timeout_s: float, on_episode) -> list[Trajectory]:
    """An API-key user's run: submit it with its plan, follow its trajectories (live and
    from the REST API's history), then complete it. Raises InferError."""
    try:
        placed = await client.submit(spec, job_id=run_id, kind="inference", policy_of=job, plan=plan)
    except SpecError as e:
        if e.field != "policy_of":
            raise
        raise InferError(f"job: {e} (no such job, or not trained yet)") from None
    episodes = plan.episodes * plan.agents
    got: dict[str, Trajectory] = {}

    async def take() -> None:
        async for t in placed._follow("traj", Trajectory, True):
            if t.episode_id not in got:
                got[t.episode_id] = t
                if on_episode is not None:
                    on_episode(t)
            if len(got) >= episodes:
                return

    deadline = time.monotonic() + timeout_s
    task = asyncio.ensure_future(take())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=2.0)
            if task.done():
                break
            rec = await placed.record()
            if rec.state.terminal:
                raise InferError(f"inference job {run_id} {rec.state.value}: {rec.reason}")
            if time.monotonic() > deadline:
                raise InferError(f"{len(got)} of {episodes} episodes after {timeout_s:.0f} s: is a rollout worker "
                                 f"and an envhost serving {spec.env!r} running?")
        task.result()
        await placed.complete(f"{len(got)} episodes")
    except BaseException as e:
        with contextlib.suppress(Exception):
            await placed.cancel(f"inference run failed: {type(e).__name__}: {e}"[:500])
        raise
    finally:
        task.cancel()
    return sorted(got.values(), key=lambda t: (t.group_index, t.episode_id))


async def _run_as_service(client: Client, run_id: str, model: str, env: str, engine: str, env_args, episodes: int,
                          group_size: int, split: str, seed: int, sampling: SamplingParams, agents: int,
                          job: str | None, version: int, timeout_s: float, on_episode) -> list[Trajectory]:
    """A service identity's run: it sends the requests and reads the trajectories on
    JetStream itself, and reports the run's end. Raises InferError."""
    t0 = time.monotonic()
    try:
        placed = await client.submit(JobSpec(name="infer", model=model, env=env, engine=engine,
                                             env_args=dict(env_args or {})), job_id=run_id, kind="inference",
                                     policy_of=S.check_job_id(job) if job else "")
    except SpecError as e:
        if e.field != "policy_of":
            raise
        raise InferError(f"job: {e} (no such job, or not trained yet)") from None
    requests = [RolloutRequest(job_id=run_id, request_id=f"{run_id}-g{g}", step=0, group_index=g,
                               group_seed=episode_seed(seed, g), policy_version=version, model=model,
                               env=env, env_args=dict(env_args or {}), group_size=group_size,
                               sampling=sampling, engine=engine, split=split, purpose="inference",
                               agents=agents)
                for g in range(episodes // group_size)]
    try:
        workers, attempt = await _placement(placed, timeout_s)
        # a worker serves only the attempt the job's record names
        requests = [msgspec.structs.replace(r, attempt=attempt) for r in requests]
        trajs = await _collect(client.bus, run_id, workers, requests, env,
                               timeout_s - (time.monotonic() - t0), on_episode)
        await client.bus.publish(S.job(run_id, "events"), JobStateChanged(
            job_id=run_id, state=JobState.COMPLETED, reason=f"{len(trajs)} episodes", time_s=time.time(),
            source="sdk", attempt=attempt))
    except BaseException as e:
        with contextlib.suppress(Exception):
            await placed.cancel(f"inference run failed: {type(e).__name__}: {e}"[:500])
        raise
    return trajs


async def _placement(job, timeout_s: float) -> tuple[list[str], int]:
    """The rollout workers the scheduler placed an inference job on, and the attempt."""
    deadline = time.monotonic() + timeout_s
    while True:
        rec = await job.record()
        if rec.state.terminal:
            raise InferError(f"inference job {job.id} {rec.state.value}: {rec.reason}")
        if rec.placement is not None:
            return list(rec.placement.rollout), rec.attempt
        if time.monotonic() > deadline:
            raise InferError(f"inference job {job.id} not placed within {timeout_s:.0f} s: "
                             "is a rollout worker in the scheduler's pool?")
        await asyncio.sleep(0.2)


async def _collect(bus, run_id: str, workers: list[str], requests: list[RolloutRequest], env: str,
                   timeout_s: float, on_episode) -> list[Trajectory]:
    """Send `requests` to the placed workers in turn; return every episode, in order.
    Raises InferError on a refused request or after `timeout_s`."""
    episodes = sum(r.group_size * r.agents for r in requests)  # trajectories: one per seat
    got: dict[str, Trajectory] = {}
    done = asyncio.Event()
    refused: list[str] = []

    async def on_traj(m) -> None:
        t = decode(m.data, Trajectory)
        if t.episode_id in got:
            return
        got[t.episode_id] = t
        if on_episode is not None:
            on_episode(t)
        if len(got) >= episodes:
            done.set()

    async def on_dead(m) -> None:
        with contextlib.suppress(msgspec.MsgspecError):
            dl = decode(m.data, DeadLetter)
            if S.job_id_of(dl.subject) == run_id and ".rollout." in dl.subject:
                refused.append(dl.reason)
                done.set()

    traj_sub = await bus.js.subscribe(S.job(run_id, "traj"), ordered_consumer=True, cb=on_traj)
    dlq_sub = await bus.nc.subscribe(S.dead_letter("rollout"), cb=on_dead)
    try:
        for req in requests:
            await bus.publish(S.rollout(run_id, workers[req.group_index % len(workers)]), req,
                              msg_id=req.request_id)
        try:
            await asyncio.wait_for(done.wait(), timeout_s)
        except asyncio.TimeoutError:
            raise InferError(f"{len(got)} of {episodes} episodes after {timeout_s:.0f} s: is a rollout "
                             f"worker and an envhost serving {env!r} running?") from None
        if refused:
            raise InferError(f"the rollout service refused the run: {refused[0]}")
    finally:
        await traj_sub.unsubscribe()
        await dlq_sub.unsubscribe()
    return sorted(got.values(), key=lambda t: (t.group_index, t.episode_id))
