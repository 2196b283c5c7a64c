"""Every message on the OpenTinker bus, as msgspec Structs (MessagePack on the wire).
Imports only msgspec and the standard library, so clients depend on it freely. (The
environment API users implement is `opentinker.environment.base_game`.)

    base.py        the message base class and bounded integer types
    codec.py       encode / typed decode
    job.py         JobSpec, its bounds and descriptions (msgspec Meta on the fields) and validation
    options.py     the options table of docs/job-spec.md, generated from JobSpec's fields
    control.py     submit / cancel, job records and state changes, assignments
    rollout.py     RolloutRequest (one group) and Trajectory (one episode)
    weights.py     weight events (a policy version and where its bytes are)
    metrics.py     one record per training or evaluation step
    env.py         envhost request/reply messages
    stats.py       episode statistics, policy lag, derived seeds: each defined once
    pool.py        workers and placements
    users.py       users and API keys as stored
    deadletter.py  what a service could not process, and why
    subjects.py    every subject, stream, durable consumer, bucket and header name
"""

from opentinker.schemas.base import SCHEMA_VERSION, Message
from opentinker.schemas.codec import decode, encode, schema_name
from opentinker.schemas.control import (
    CancelJob,
    CancelReply,
    JobAssigned,
    JobRecord,
    JobState,
    JobStateChanged,
    SubmitJob,
    SubmitReply,
)
from opentinker.schemas.deadletter import DeadLetter
from opentinker.schemas.env import (
    AgentOpening,
    EnvCloseRequest,
    EnvInfoReply,
    EnvInfoRequest,
    EnvInitReply,
    EnvInitRequest,
    EnvResetReply,
    EnvResetRequest,
    EnvServed,
    EnvStepReply,
    EnvStepRequest,
)
from opentinker.schemas.job import JobSpec, SamplingParams, SpecError, validate_job_spec
from opentinker.schemas.metrics import Metrics
from opentinker.schemas.rollout import RolloutRequest, Trajectory, TurnRecord
from opentinker.schemas.weights import WeightsPublished



def schema_by_name(name: str) -> type | None:
    """The message type named `name` (the `Ot-Schema` header), or None. Covers every
    Message subclass the schemas define (pool and user records included)."""
    from opentinker.schemas import pool, users  # noqa: F401  (registers their types)

    seen, todo = {}, [Message]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            seen.setdefault(sub.__name__, sub)
            todo.append(sub)
    return seen.get(name)


__all__ = [
    "SCHEMA_VERSION", "Message", "decode", "encode", "schema_name", "schema_by_name",
    "CancelJob", "CancelReply", "JobAssigned", "JobRecord", "JobState", "JobStateChanged",
    "SubmitJob", "SubmitReply", "DeadLetter",
    "AgentOpening", "EnvCloseRequest", "EnvInitReply", "EnvInitRequest", "EnvResetReply", "EnvResetRequest",
    "EnvStepReply", "EnvStepRequest", "EnvInfoRequest", "EnvInfoReply", "EnvServed",
    "JobSpec", "SamplingParams", "SpecError", "validate_job_spec",
    "Metrics", "RolloutRequest", "Trajectory", "TurnRecord", "WeightsPublished",
]
