"""Control plane: job commands (client -> scheduler), job state, assignments.

Producers and consumers:
- SubmitJob / CancelJob: SDK -> scheduler, request/reply on `ot.ctl.submit` / `ot.ctl.cancel`.
- JobAssigned: scheduler -> the placed learner, JetStream work queue
  `ot.ctl.assign.learner.<worker_id>`.
- JobStateChanged: scheduler and learner -> everyone, `ot.job.<id>.events`.
- JobRecord: the scheduler's record in the `ot_jobs` KV bucket.
"""

from enum import Enum
from typing import Annotated, Literal

import msgspec

from opentinker.schemas.base import Count, Message
from opentinker.schemas.job import ENV_NAME_RE, Bounded, JobSpec, SamplingParams
from opentinker.schemas.pool import Placement


class JobState(str, Enum):
    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED)


JobKind = Literal["train", "inference"]


class InferencePlan(Message, frozen=True, kw_only=True):
    """The episodes an inference run asks for (sdk/infer.py): `episodes` in groups of
    `group_size` sharing an initial state, group g seeded derived_seed("infer", seed, g)
    (schemas/stats.py), on `split`, sampled with `sampling`, `agents` seats each. The
    scheduler sends them to the placed rollout workers when it places the job (a user
    publishes nothing on the bus); the user follows the trajectories and completes the
    job (POST /v1/jobs/{id}/complete)."""

    episodes: Bounded(int, 1, 4096) = 32
    group_size: Bounded(int, 1, 256) = 1
    split: Annotated[str, msgspec.Meta(pattern=ENV_NAME_RE.pattern)] = "test"
    seed: Count = 0
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    agents: Bounded(int, 1, 8) = 1
    policy_version: Bounded(int, 0, 1) = 0  # set by the scheduler: 1 when the job runs `policy_of`


class SubmitJob(Message, frozen=True, kw_only=True):
    """Ask the scheduler to run a job. `job_id` is optional (the scheduler makes one).

    `kind` "train" places a learner and `spec.rollout_workers` rollout workers;
    "inference" places rollout workers only: the client sends rollout requests, or
    calls the OpenAI-compatible endpoint the placed worker serves (`JobRecord.endpoint`).
    `api_key` authenticates the user (over REST the key travels in a header instead).
    """

    spec: JobSpec
    job_id: str = ""
    kind: JobKind = "train"
    api_key: str = ""
    # inference: serve this (your own) train job's latest policy instead of the base model
    policy_of: str = ""
    # inference: the episodes to run (the scheduler asks the placed workers for them)
    plan: InferencePlan | None = None


class SubmitReply(Message, frozen=True, kw_only=True):
    """The scheduler's answer: accepted with a job id, or refused naming the field."""

    ok: bool
    job_id: str = ""
    error: str = ""
    field: str = ""
    # inference: the bearer token of the job's OpenAI-compatible endpoint (only here;
    # the record keeps its SHA-256)
    endpoint_token: str = ""


class CancelJob(Message, frozen=True, kw_only=True):
    job_id: str
    reason: str = "cancelled by user"
    api_key: str = ""


class CancelReply(Message, frozen=True, kw_only=True):
    ok: bool
    state: str = ""
    error: str = ""


class JobAssigned(Message, frozen=True, kw_only=True):
    """A job handed to a learner. Redelivered (to resume from checkpoint) if the
    learner holding it stops acknowledging progress."""

    job_id: str
    spec: JobSpec
    attempt: Count = 0
    rollout_workers: list[str] = msgspec.field(default_factory=list)


class JobStateChanged(Message, frozen=True, kw_only=True):
    """A job's state changed. `step` is the last finished training step."""

    job_id: str
    state: JobState
    reason: str = ""
    step: Count = 0
    time_s: float = 0.0  # unix time, seconds
    source: str = ""
    attempt: Count = 0     # the placement attempt reporting (0: not known)


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
    kind: JobKind = "train"
    user: str = ""
    pool: str = "default"
    attempt: int = 0          # bumped each time the job is (re)placed
    placement: Placement | None = None  # the current attempt's workers; None while queued
    # inference: the OpenAI-compatible base URL on the placed rollout worker ("" until
    # placed), and the SHA-256 (hex) of its bearer token
    endpoint: str = ""
    endpoint_token_sha256: str = ""
    # whose envhosts serve the job's env: the user's own name when the scheduler found
    # the user's own envhost serving `spec.env` at submit (requests then go to
    # ot.env.user.<user>.<env>.*), "" for the operator's envs (ot.env.<env>.*)
    env_owner: str = ""
    plan: InferencePlan | None = None  # inference: SubmitJob.plan
