"""Periodic evaluation during training: held-out episodes sampled with the current
policy, reported as Metrics of split "eval" beside the training reward.

Every `eval_every` training steps (and before the first and after the last) the
learner asks for `eval_episodes` single-episode groups of the env's `eval_split` at
`eval_temperature` (0 = greedy), pinned to the policy version it just published. The
problems are the same at every evaluation (their seeds depend only on the job's seed
and the episode index), so the curve compares policies, not problem sets. The
episodes travel the job's own rollout and trajectory subjects (the recorder logs them
with their split). The learner routes by the trajectory's typed `purpose` ("eval",
copied from the request): an evaluation's episode never enters a training step
(Evaluator.claims); its `step` is the evaluated policy version. An evaluation counts
only the episodes of the requests this run asked for (ids
`<job>-eval-v<version>-r<run>-e<i>`, looked up, not parsed), so a resumed run never
counts a lost run's.

Metric keys: schemas.stats.episode_stats (reward_mean, reward_std, correct_frac,
episodes, episode_len_mean, gen_tokens_mean, turns_mean, error_frac), win/draw/loss_rate
for games, win/draw/loss_rate/<seat>, result_rate/<result> and reward_mean/<seat> for
multi-agent games, reward_se and correct_se
(standard errors of the means), off_version_frac (the episodes not sampled by exactly
the evaluated version: the rollout worker pins an evaluation's requests to it,
services/rollout/policy.py event_at), eval_time_s. The Metrics message's `step` is the
number of training steps done, which is also the evaluated policy version.
"""

from __future__ import annotations

import math
import statistics
import time

import msgspec

from opentinker.schemas import JobSpec, Metrics, RolloutRequest, Trajectory
from opentinker.schemas.stats import derived_seed, episode_stats, game_results, seat_results, seat_stats

EVAL_SPLIT_METRICS = "eval"


def eval_seed(seed: int, index: int) -> int:
    """The initial-state seed of eval episode `index`: fixed for the whole job."""
    return derived_seed("eval", seed, index)


def standard_error(xs: list[float]) -> float:
    """The standard error of the mean of `xs`: sample sd / sqrt(n) (0.0 below 2 values).
    It counts the sampling noise of this problem set and policy only, not the spread
    across training seeds (report that from several runs)."""
    return statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else 0.0


def eval_stats(trajs: list[Trajectory], version: int) -> dict[str, float]:
    """An evaluation's metrics: episode_stats, game_results (win/draw/loss rates, for
    games), seat_results and seat_stats (per seat win/draw/loss rates, result rates and
reward_mean/<seat>, for multi-agent games), `reward_se` and
    `correct_se` (standard_error), and `off_version_frac`, the
    fraction of the job's own episodes with a turn sampled by another policy version
    than `version` (0 when the rollout honours the pin; an opponent's seat is not
    counted)."""
    values = episode_stats(trajs)
    values.update(game_results(trajs))
    values.update(seat_results(trajs))
    values.update(seat_stats(trajs))
    values["reward_se"] = standard_error([t.reward for t in trajs])
    values["correct_se"] = standard_error([float(t.correct) for t in trajs])
    own = [t for t in trajs if not t.policy_of and t.turns]
    values["off_version_frac"] = (sum(any(turn.policy_version != version for turn in t.turns) for t in own)
                                  / len(own) if own else 0.0)
    return values


def eval_prefix(job_id: str, version: int, run: str = "") -> str:
    return f"{job_id}-eval-v{version}-" + (f"r{run}-" if run else "")


class Evaluator:
    """The evaluations of one job: which are due, their requests, and their results."""

    def __init__(self, job_id: str, spec: JobSpec, run: str = "", attempt: int = 0):
        self.job_id = job_id
        self.spec = spec
        self.run_id = run       # the learner run asking (its weights are the ones evaluated)
        self.attempt = attempt  # the placement attempt it runs under
        self.pending: dict[int, dict[str, Trajectory]] = {}  # version -> episode id -> traj
        self.started_s: dict[int, float] = {}
        self.asked: set[str] = set()  # the request ids of this run's evaluations

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
        reqs = [RolloutRequest(job_id=self.job_id, request_id=f"{prefix}e{i}", step=version, group_index=i,
                               group_seed=eval_seed(spec.seed, i), policy_version=version, model=spec.model,
                               env=spec.env, env_args=spec.env_args, group_size=1, sampling=sampling,
                               engine=spec.engine, sampler_dtype=spec.sampler_dtype, split=spec.eval_split,
                               attempt=self.attempt, policy_run=self.run_id, purpose="eval", agents=spec.agents,
                               opponents=spec.opponents)
                for i in range(spec.eval_episodes)]
        self.asked.update(r.request_id for r in reqs)
        return reqs

    def claims(self, traj: Trajectory) -> bool:
        """Is `traj` an evaluation episode (this run's or a lost run's), never to be
        trained on? Its `purpose` says so."""
        return traj.purpose == "eval"

    def add(self, traj: Trajectory) -> Metrics | None:
        """Keep an eval episode; returns the evaluation's Metrics once all its episodes
        are in (and forgets it), else None. Episodes of an evaluation this run did not
        ask for (a lost run's, replayed after a resume) are ignored."""
        v = traj.step  # an eval request's step is the policy version it evaluates
        got = self.pending.get(v)
        if got is None or traj.request_id not in self.asked:
            return None
        got[traj.episode_id] = traj
        if len(got) < self.spec.eval_episodes * self.spec.agents:  # one trajectory per seat
            return None
        del self.pending[v]
        values = eval_stats(list(got.values()), v)
        values["eval_time_s"] = time.monotonic() - self.started_s.pop(v)
        return Metrics(job_id=self.job_id, step=v, policy_version=v, split=EVAL_SPLIT_METRICS,
                       values=values, time_s=time.time())
