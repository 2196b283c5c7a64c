"""Every subject, stream, KV bucket and object store name. Nowhere else.

| subject                         | stream      | producer   | consumers                 |
|---------------------------------|-------------|------------|---------------------------|
| ot.ctl.submit / ot.ctl.cancel   | (req/reply) | SDK        | scheduler                 |
| ot.ctl.assign.learner           | OT_CTL      | scheduler  | learner (work queue)      |
| ot.job.<id>.events              | OT_EVENTS   | sched/lrn  | scheduler, SDK            |
| ot.job.<id>.rollout             | OT_ROLLOUT  | learner    | rollout (work queue)      |
| ot.job.<id>.traj                | OT_TRAJ     | rollout    | learner, recorder         |
| ot.job.<id>.weights             | OT_WEIGHTS  | learner    | rollout, recorder, SDK    |
| ot.job.<id>.metrics             | OT_METRICS  | learner    | recorder, SDK             |
| ot.env.<env>.init / .reset      | (req/reply) | rollout    | envhost (queue group)     |
| ot.env.host.<host>.step/.close  | (req/reply) | rollout    | the envhost holding it    |
| ot.dlq.<service>                | OT_DLQ      | any        | operators                 |
"""

from opentinker.schemas.job import ENV_NAME_RE, JOB_ID_RE

SUBMIT = "ot.ctl.submit"
CANCEL = "ot.ctl.cancel"
ASSIGN_LEARNER = "ot.ctl.assign.learner"

FAMILIES = ("events", "rollout", "traj", "weights", "metrics")

# stream name -> (subjects, retention). "workqueue" removes a message once acked.
STREAMS: dict[str, tuple[list[str], str]] = {
    "OT_CTL": (["ot.ctl.assign.>"], "workqueue"),
    "OT_EVENTS": (["ot.job.*.events"], "limits"),
    "OT_ROLLOUT": (["ot.job.*.rollout"], "workqueue"),
    "OT_TRAJ": (["ot.job.*.traj"], "limits"),
    "OT_WEIGHTS": (["ot.job.*.weights"], "limits"),
    "OT_METRICS": (["ot.job.*.metrics"], "limits"),
    "OT_DLQ": (["ot.dlq.>"], "limits"),
}

KV_JOBS = "ot_jobs"
OBJ_WEIGHTS = "ot_weights"
OBJ_CHECKPOINTS = "ot_checkpoints"

# headers
H_MSG_ID = "Nats-Msg-Id"
H_SCHEMA = "Ot-Schema"
H_CONTENT_TYPE = "Content-Type"
CONTENT_TYPE = "application/msgpack"
H_TRACEPARENT = "traceparent"


def check_job_id(job_id: str) -> str:
    """Return job_id if it is a valid subject token ([a-z0-9-], 1-63 chars).

    Raises ValueError otherwise, so a job id can never forge a subject.
    """
    if not JOB_ID_RE.match(job_id):
        raise ValueError(f"invalid job id {job_id!r}: must match {JOB_ID_RE.pattern}")
    return job_id


def job(job_id: str, family: str) -> str:
    """`ot.job.<job_id>.<family>` for one of FAMILIES."""
    if family not in FAMILIES:
        raise ValueError(f"unknown subject family {family!r}")
    return f"ot.job.{check_job_id(job_id)}.{family}"


def job_id_of(subject: str) -> str:
    """The job id in an `ot.job.<id>.<family>` subject."""
    return subject.split(".")[2]


def env_init(env: str) -> str:
    return f"ot.env.{_env(env)}.init"


def env_reset(env: str) -> str:
    return f"ot.env.{_env(env)}.reset"


def env_queue_group(env: str) -> str:
    return f"envhost-{_env(env)}"


def env_step(host_id: str) -> str:
    return f"ot.env.host.{host_id}.step"


def env_close(host_id: str) -> str:
    return f"ot.env.host.{host_id}.close"


def dead_letter(service: str) -> str:
    return f"ot.dlq.{service}"


def _env(env: str) -> str:
    if not ENV_NAME_RE.match(env):
        raise ValueError(f"invalid env name {env!r}: must match {ENV_NAME_RE.pattern}")
    return env
