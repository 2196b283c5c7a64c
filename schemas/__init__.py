"""Every message on the OpenTinker bus, as msgspec Structs (MessagePack on the wire).

One module per message family; subject and stream names live in `subjects`.
Imports only msgspec and the standard library, so clients can depend on it freely.
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
    EnvCloseRequest,
    EnvInitReply,
    EnvInitRequest,
    EnvResetReply,
    EnvResetRequest,
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
    "EnvCloseRequest", "EnvInitReply", "EnvInitRequest", "EnvResetReply", "EnvResetRequest",
    "EnvStepReply", "EnvStepRequest",
    "JobSpec", "SamplingParams", "SpecError", "validate_job_spec",
    "Metrics", "RolloutRequest", "Trajectory", "TurnRecord", "WeightsPublished",
]
