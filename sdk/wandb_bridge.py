"""Weights & Biases for a job: any process that follows the job (this SDK, the CLI's
`opentinker wandb JOB` or `train --wandb`) logs what the job publishes to one wandb run.

- The run's id and name are the job id, so following the job again (after a restart,
  or from another machine) resumes the same run.
- `train/<key>` and `eval/<key>`: every metric the learner publishes, at its step.
- `rollout/*`: figures from the job's trajectories, per step: generation tokens/s,
  episode length, turns, env latency and policy lag.
- Offline mode by default: `WANDB_MODE` when set; else online only with `WANDB_API_KEY`
  (or an explicit mode). Offline runs land under `<dir>/wandb/offline-run-*` and upload
  later with `wandb sync`.
"""

from __future__ import annotations

import asyncio
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import msgspec

from opentinker.schemas import Metrics, Trajectory, decode
from opentinker.schemas import subjects as S
from opentinker.schemas.stats import episode_stats, lag_stats


def default_mode() -> str:
    """WANDB_MODE, else "online" with an API key in the environment, else "offline"."""
    return os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")


def rollout_figures(trajs: list[Trajectory]) -> dict[str, float]:
    """Per-step figures from the step's trajectories: tokens generated per second of
    generation, env latency (ms per turn), and the episode statistics the learner's
    metrics use too (schemas/stats.py: episode length, turns, policy lag, episodes)."""
    gen_tokens = sum(sum(t.loss_mask) for t in trajs)
    gen_s = sum(t.gen_ms for t in trajs) / 1e3
    ep, lag = episode_stats(trajs), lag_stats(trajs)
    return {
        "rollout/gen_tokens_per_s": gen_tokens / gen_s if gen_s > 0 else 0.0,
        "rollout/episode_len_mean": ep["episode_len_mean"],
        "rollout/turns_mean": ep["turns_mean"],
        "rollout/env_ms_per_turn": sum(t.env_ms for t in trajs) / max(1, sum(len(t.turns) for t in trajs)),
        "rollout/policy_lag_mean": lag["policy_lag_mean"],
        "rollout/episodes": ep["episodes"],
    }


class WandbBridge:
    """Log one job to wandb while following it with a Client (see module docstring).

    `project`: the wandb project (default $WANDB_PROJECT, else "opentinker"); `dir`:
    where wandb writes (default <home>/wandb); `mode`: "offline", "online" or
    "disabled" (default `default_mode()`).
    """

    def __init__(self, client, job_id: str, project: str | None = None, dir: str | Path | None = None,
                 mode: str | None = None, config: dict[str, Any] | None = None):
        from opentinker.services.core.config import default_home

        self.client = client
        self.job_id = S.check_job_id(job_id)
        self.project = project or os.environ.get("WANDB_PROJECT") or "opentinker"
        self.dir = Path(dir or Path(default_home()) / "wandb")
        self.mode = mode or default_mode()
        self.config = config or {}
        self.run = None

    def _init(self):
        import wandb

        self.dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=self.project, id=self.job_id, name=self.job_id, resume="allow",
                              dir=str(self.dir), mode=self.mode, config=self.config,
                              settings=wandb.Settings(silent=True, console="off"))
        return self.run

    async def follow(self) -> Any:
        """Log until the job ends; returns the job's final record. The rollout figures
        of a step are logged with that step's train metrics."""
        job = self.client.job(self.job_id)
        rec = await job.record()
        self.config = {**msgspec.to_builtins(rec.spec), **self.config}
        run = await asyncio.to_thread(self._init)
        steps: dict[int, list[Trajectory]] = defaultdict(list)
        q: asyncio.Queue = asyncio.Queue()
        nc = await self.client._live_nc(self.job_id)
        sub = await nc.subscribe(S.job(self.job_id, "traj"), cb=q.put)

        def drain() -> None:
            while not q.empty():
                m = q.get_nowait()
                try:
                    t = decode(m.data, Trajectory)
                except msgspec.MsgspecError:
                    continue  # not ours to judge: the learner dead-letters it
                if t.split == "train":
                    steps[t.step].append(t)

        try:
            async for m in job.metrics():
                drain()
                values = self.values(m)
                if m.split == "train" and steps.get(m.step):
                    values.update(rollout_figures(steps.pop(m.step)))
                await asyncio.to_thread(run.log, values, step=m.step)
            rec = await job.wait(raise_on_failure=False)
            run.summary["state"] = rec.state.value
        finally:
            await sub.unsubscribe()
            await asyncio.to_thread(run.finish)
        return rec

    @staticmethod
    def values(m: Metrics) -> dict[str, float]:
        return {f"{m.split}/{k}": float(v) for k, v in m.values.items()}

