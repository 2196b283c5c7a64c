"""Metrics (learner -> recorder, SDK, dashboards): one record per training step."""

import msgspec

from opentinker.schemas.base import Message


class Metrics(Message, frozen=True, kw_only=True):
    """Scalars for one step (subject `ot.job.<id>.metrics`).

    Standard keys: reward_mean, reward_std, kl, entropy, clip_frac, loss,
    policy_lag_mean, policy_lag_max, tokens_per_s, step_time_s, grad_norm,
    dropped_stale.
    """

    job_id: str
    step: int
    policy_version: int
    values: dict[str, float] = msgspec.field(default_factory=dict)
    split: str = "train"
    time_s: float = 0.0
