"""Control plane: job commands (client -> scheduler), job state, assignments.

Producers and consumers:
- SubmitJob / CancelJob: SDK -> scheduler, request/reply on `ot.ctl.submit` / `ot.ctl.cancel`.
- JobAssigned: scheduler -> learner, JetStream work queue `ot.ctl.assign.learner`.
- JobStateChanged: scheduler and learner -> everyone, `ot.job.<id>.events`.
- JobRecord: the scheduler's record in the `ot_jobs` KV bucket.
"""

from enum import Enum

import msgspec

from opentinker.schemas.base import Message
from opentinker.schemas.job import JobSpec


class JobState(str, Enum):
    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED)


class SubmitJob(Message, frozen=True, kw_only=True):
    """Ask the scheduler to run a job. `job_id` is optional (the scheduler makes one)."""

    spec: JobSpec
    job_id: str = ""


class SubmitReply(Message, frozen=True, kw_only=True):
    """The scheduler's answer: accepted with a job id, or refused naming the field."""

    ok: bool
    job_id: str = ""
    error: str = ""
    field: str = ""


class CancelJob(Message, frozen=True, kw_only=True):
    job_id: str
    reason: str = "cancelled by user"


class CancelReply(Message, frozen=True, kw_only=True):
    ok: bool
    state: str = ""
    error: str = ""


class JobAssigned(Message, frozen=True, kw_only=True):
    """A job handed to a learner. Redelivered (to resume from checkpoint) if the
    learner holding it stops acknowledging progress."""

    job_id: str
    spec: JobSpec


class JobStateChanged(Message, frozen=True, kw_only=True):
    """A job's state changed. `step` is the last finished training step."""

    job_id: str
    state: JobState
    reason: str = ""
    step: int = 0
    time_s: float = 0.0  # unix time, seconds
    source: str = ""


class JobRecord(Message, frozen=True, kw_only=True):
    """A job as the scheduler keeps it in the `ot_jobs` KV bucket."""

    job_id: str
    spec: JobSpec
    state: JobState = JobState.QUEUED
    reason: str = ""
    step: int = 0
    created_s: float = 0.0
    updated_s: float = 0.0
    history: list[str] = msgspec.field(default_factory=list)
