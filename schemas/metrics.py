"""Metrics (learner -> recorder, SDK, dashboards): one record per training step."""

import msgspec

from opentinker.schemas.base import Count, Message


class Metrics(Message, frozen=True, kw_only=True):
    """Scalars for one step (subject `ot.job.<id>.metrics`).

    Standard keys: reward_mean, reward_std, kl, entropy, clip_frac, loss,
    policy_lag_mean, policy_lag_max, tokens_per_s, step_time_s, grad_norm,
    dropped_stale.
    """

    job_id: str
    step: Count
    policy_version: Count
    values: dict[str, float] = msgspec.field(default_factory=dict)
    split: str = "train"
    time_s: float = 0.0
    # a train step of an RL job: the request ids of the groups it was trained on (the
    # log's `steps` view), so what trained each step can be audited and replayed
    groups: list[str] = msgspec.field(default_factory=list)
