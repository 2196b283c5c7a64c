"""JetStream stream layout: which streams hold a subject, and each stream's config
(subjects, retention and limits from schemas.subjects), as `Bus.ensure_topology` creates
them."""

from __future__ import annotations

from nats.js import api

from opentinker.schemas import subjects as S

DUPLICATE_WINDOW_S = 120.0


def _overlap(a: str, b: str) -> bool:
    """Whether NATS subjects/wildcards `a` and `b` can match a common subject."""
    ta, tb = a.split("."), b.split(".")
    for i in range(max(len(ta), len(tb))):
        x, y = (ta[i] if i < len(ta) else None), (tb[i] if i < len(tb) else None)
        if x == ">" or y == ">":
            return x is not None and y is not None
        if x is None or y is None:
            return False
        if x != y and "*" not in (x, y):
            return False
    return True


def streams_of(subject: str) -> list[str]:
    """The streams (schemas.subjects.STREAMS) that can hold messages on `subject`."""
    return [stream for stream, (subjects, _) in S.STREAMS.items() if any(_overlap(subject, x) for x in subjects)]


def stream_config(name: str, max_bytes_scale: float = 1.0, max_age_scale: float = 1.0,
                  replicas: int = 1) -> api.StreamConfig:
    """The JetStream config of stream `name`: its subjects and retention (S.STREAMS) and
    its limits (S.STREAM_LIMITS), `max_bytes` and `max_age_s` times the scales, on
    `replicas` nodes of a cluster. Discard policy: a full limits stream drops its oldest
    messages; a work queue refuses new ones (per subject too), never dropping work."""
    subjects, retention = S.STREAMS[name]
    lim = S.STREAM_LIMITS[name]
    work = retention == "workqueue"
    return api.StreamConfig(
        name=name, subjects=subjects,
        retention=api.RetentionPolicy.WORK_QUEUE if work else api.RetentionPolicy.LIMITS,
        storage=api.StorageType.FILE, duplicate_window=DUPLICATE_WINDOW_S, max_msg_size=lim.max_msg_size,
        max_bytes=int(lim.max_bytes * max_bytes_scale),
        max_age=lim.max_age_s * max_age_scale,
        max_msgs_per_subject=lim.max_msgs_per_subject,
        discard=api.DiscardPolicy.NEW if work else api.DiscardPolicy.OLD,
        discard_new_per_subject=work and lim.max_msgs_per_subject > 0,
        num_replicas=replicas,
    )
