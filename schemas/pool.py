"""The worker pool: what each worker offers, and where each job runs.

Producers and consumers:
- WorkerInfo: every rollout and learner worker -> the `ot_workers` KV bucket (key
  `<pool>.<worker_id>`), rewritten every heartbeat. The bucket's TTL removes the entry
  of a worker that stops heartbeating; the scheduler reads the bucket to place jobs.
- Placement: scheduler -> JobRecord.placement (KV `ot_jobs`) and JobAssigned.
"""

from typing import Literal

import msgspec

from opentinker.schemas.base import Message

WorkerKind = Literal["rollout", "learner"]


class WorkerCapacity(msgspec.Struct, frozen=True, kw_only=True):
    """What one worker can hold. `slots`: jobs at once (a learner trains one; a rollout
    worker serves several jobs of one base model, each with its own adapter). `ranks`:
    a learner's most data-parallel ranks for one job (JobSpec.learner_ranks)."""

    slots: int = 1
    gpus: int = 0
    cpu_cores: int = 0
    memory_gb: float = 0.0
    engines: list[str] = msgspec.field(default_factory=list)  # "vllm", "hf", "deepspeed"
    ranks: int = 1


class WorkerInfo(Message, frozen=True, kw_only=True):
    """A worker's heartbeat: who it is, what it offers, what it runs now."""

    worker_id: str
    kind: WorkerKind
    pool: str = "default"
    capacity: WorkerCapacity = msgspec.field(default_factory=WorkerCapacity)
    jobs: list[str] = msgspec.field(default_factory=list)
    host: str = ""
    pid: int = 0
    serve_url: str = ""     # a rollout worker's OpenAI-compatible server (inference jobs)
    started_s: float = 0.0  # unix time, seconds
    time_s: float = 0.0     # unix time of this heartbeat, seconds


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    """Where one attempt of a job runs. `attempt` fences stale assignments: a learner
    runs a JobAssigned only while its attempt is the record's."""

    attempt: int
    learner: str = ""  # "" for an inference job (rollout workers only)
    rollout: list[str] = msgspec.field(default_factory=list)
    placed_s: float = 0.0
