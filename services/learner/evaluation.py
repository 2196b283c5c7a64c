"""Periodic evaluation during training: held-out episodes sampled with the current
policy, reported as Metrics of split "eval" beside the training reward.

Every `eval_every` training steps (and before the first and after the last) the
learner asks for `eval_episodes` single-episode groups of the env's `eval_split` at
`eval_temperature` (0 = greedy), pinned to the policy version it just published. The
problems are the same at every evaluation (their seeds depend only on the job's seed
and the episode index), so the curve compares policies, not problem sets. The
episodes travel the job's own rollout and trajectory subjects (the recorder logs them
with their split); the learner tells them apart by request id
(`<job>-eval-v<version>-r<run>-e<i>`, with the learner run that asked), so they never
enter a training step, and a resumed run never counts a lost run's episodes.

Metric keys: reward_mean, reward_std, correct_frac (episodes whose env info says
`correct`, or, without that key, whose reward is > 0), episodes, gen_tokens_mean,
turns_mean, error_frac. The Metrics message's `step` is the number of training steps
done, which is also the evaluated policy version.
"""

from __future__ import annotations

import hashlib
import statistics
import time

import msgspec

from opentinker.schemas import JobSpec, Metrics, RolloutRequest, Trajectory

EVAL_SPLIT_METRICS = "eval"


def eval_seed(seed: int, index: int) -> int:
    """The initial-state seed of eval episode `index`: fixed for the whole job."""
    h = hashlib.blake2b(f"eval:{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & 0x7FFFFFFF


def eval_prefix(job_id: str, version: int, run: str = "") -> str:
    return f"{job_id}-eval-v{version}-" + (f"r{run}-" if run else "")


def parse_eval_request_id(job_id: str, request_id: str) -> int | None:
    """The policy version of an eval request id, or None for a training request."""
    head = f"{job_id}-eval-v"
    if not request_id.startswith(head):
        return None
    version, _, rest = request_id[len(head):].partition("-")
    return int(version) if version.isdigit() and rest else None


def summarize(trajs: list[Trajectory]) -> dict[str, float]:
    """The eval metric values of a set of episodes (see the module docstring)."""
    rewards = [t.reward for t in trajs]
    return {
        "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards),
        "correct_frac": sum(t.correct for t in trajs) / len(trajs),
        "episodes": float(len(trajs)),
        "gen_tokens_mean": statistics.fmean(sum(t.loss_mask) for t in trajs),
        "turns_mean": statistics.fmean(len(t.turns) for t in trajs),
        "error_frac": sum(1 for t in trajs if t.error) / len(trajs),
    }


class Evaluator:
    """The evaluations of one job: which are due, their requests, and their results."""

    def __init__(self, job_id: str, spec: JobSpec, run: str = "", attempt: int = 0):
        self.job_id = job_id
        self.spec = spec
        self.run_id = run       # the learner run asking (its weights are the ones evaluated)
        self.attempt = attempt  # the placement attempt it runs under
        self.pending: dict[int, dict[str, Trajectory]] = {}  # version -> episode id -> traj
        self.started_s: dict[int, float] = {}

    @property
    def enabled(self) -> bool:
        return self.spec.eval_every > 0

    def due(self, version: int) -> bool:
        """Evaluate policy `version` (= steps trained)? At 0, every eval_every, and at the end."""
        if not self.enabled or version in self.pending:
            return False
        return version % self.spec.eval_every == 0 or version == self.spec.steps

    def requests(self, version: int) -> list[RolloutRequest]:
        """The eval requests for policy `version`; marks the evaluation pending."""
        spec = self.spec
        sampling = msgspec.structs.replace(spec.sampling, temperature=spec.eval_temperature,
                                           top_p=1.0 if spec.eval_temperature == 0 else spec.sampling.top_p)
        self.pending[version] = {}
        self.started_s[version] = time.monotonic()
        prefix = eval_prefix(self.job_id, version, self.run_id)
        return [RolloutRequest(job_id=self.job_id, request_id=f"{prefix}e{i}", step=version, group_index=i,
                               group_seed=eval_seed(spec.seed, i), policy_version=version, model=spec.model,
                               env=spec.env, env_args=spec.env_args, group_size=1, sampling=sampling,
                               engine=spec.engine, split=spec.eval_split, attempt=self.attempt,
                               policy_run=self.run_id)
                for i in range(spec.eval_episodes)]

    def add(self, traj: Trajectory) -> Metrics | None:
        """Keep an eval episode; returns the evaluation's Metrics once all its episodes
        are in (and forgets it), else None. Episodes of an evaluation this run did not
        ask for (a lost run's, replayed after a resume) are ignored."""
        v = parse_eval_request_id(self.job_id, traj.request_id)
        if v is None or v not in self.pending or not traj.request_id.startswith(eval_prefix(self.job_id, v, self.run_id)):
            return None
        got = self.pending[v]
        got[traj.episode_id] = traj
        if len(got) < self.spec.eval_episodes:
            return None
        del self.pending[v]
        values = summarize(list(got.values()))
        values["eval_time_s"] = time.monotonic() - self.started_s.pop(v)
        return Metrics(job_id=self.job_id, step=v, policy_version=v, split=EVAL_SPLIT_METRICS,
                       values=values, time_s=time.time())
