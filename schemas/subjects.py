"""Every subject, stream, KV bucket and object store name. Nowhere else.

| subject                         | stream      | producer   | consumers                 |
|---------------------------------|-------------|------------|---------------------------|
| ot.ctl.submit / ot.ctl.cancel   | (req/reply) | SDK        | scheduler                 |
| ot.ctl.submit.<pool>            | (req/reply) | SDK, tinker API | that pool's scheduler |
| ot.ctl.assign.learner.<worker>  | OT_CTL      | scheduler  | that learner (work queue) |
| ot.job.<id>.events              | OT_EVENTS   | sched/lrn  | scheduler, SDK            |
| ot.job.<id>.rollout.<worker>    | OT_ROLLOUT  | learner    | that rollout worker       |
| ot.job.<id>.traj                | OT_TRAJ     | rollout    | learner, recorder         |
| ot.job.<id>.weights             | OT_WEIGHTS  | learner    | rollout, recorder, SDK    |
| ot.job.<id>.metrics             | OT_METRICS  | learner    | recorder, SDK             |
| ot.job.<id>.ops.<seq>           | OT_TINKER   | tinker API | the session's learner     |
| ot.job.<id>.results.<seq>       | OT_TINKER   | learner    | tinker API                |
| ot.env.<env>.init / .reset      | (req/reply) | rollout    | envhost (queue group)     |
| ot.env.<env>.info               | (req/reply) | scheduler  | envhost (queue group)     |
| ot.env.host.<host>.step/.close  | (req/reply) | rollout    | the envhost holding it    |
| ot.env.user.<user>.<env>.*      | (req/reply) | rollout, scheduler | the user's own envhosts (init, reset, info) |
| ot.env.user.<user>.host.<h>.*   | (req/reply) | rollout    | the user's envhost holding the episode |
| ot.dlq.<service>                | OT_DLQ      | any        | operators                 |

`ot.env.user.<user>.>` is a tenant's own namespace: an envhost run by user U with
their API key (account TENANTS, natsauth.py) may subscribe there and nowhere else, and
publish only replies to the requests it received; the services reach it through a
service import. A job's env requests go to its owner's namespace when the job record's
`env_owner` names them (the scheduler resolved the job's env to the user's own served
env at submit), else to the operator's `ot.env.<env>.`.

KV buckets: `ot_jobs` (JobRecord by job id), `ot_envs` (the operator's env catalog:
EnvServed by env name, written by the operator's envhosts), `ot_workers` (WorkerInfo by
`<pool>.<worker>`, entries expire WORKER_TTL_S after the last heartbeat), `ot_users`
and `ot_keys` (users, and API keys stored as argon2 hashes), `ot_tinker` (the tinker
API's sessions by session id, and its runs' and checkpoints' metadata), `ot_tinker_seqs`
(what a Tinker sampling client with record_stability_info recorded: a request's prompt
and each sampled sequence, by record key; entries expire TINKER_RECORD_TTL_S after their
last write), `ot_locks` (a user's submit lock, held by the scheduler counting that
user's unfinished jobs; entries expire LOCK_TTL_S after their write). Rollout requests name
their worker in the subject: the scheduler places a job's rollouts on its workers, and
each worker's durable consumer filters its own token, so work-queue consumers never
overlap.

Every stream is bounded (STREAM_LIMITS: message size, bytes, age, messages per
subject) and so is every KV value (KV_MAX_VALUE_BYTES).
"""

import msgspec

from opentinker.schemas.job import ENV_NAME_RE, JOB_ID_RE
from opentinker.schemas.users import USER_NAME_RE

SUBMIT = "ot.ctl.submit"
CANCEL = "ot.ctl.cancel"
ASSIGN_LEARNER_ALL = "ot.ctl.assign.learner.*"

FAMILIES = ("events", "traj", "weights", "metrics")  # rollout: see rollout()

STREAM_CTL = "OT_CTL"
STREAM_EVENTS = "OT_EVENTS"
STREAM_ROLLOUT = "OT_ROLLOUT"
STREAM_TRAJ = "OT_TRAJ"
STREAM_WEIGHTS = "OT_WEIGHTS"
STREAM_METRICS = "OT_METRICS"
STREAM_DLQ = "OT_DLQ"
STREAM_TINKER = "OT_TINKER"

# stream name -> (subjects, retention). "workqueue" removes a message once acked.
STREAMS: dict[str, tuple[list[str], str]] = {
    STREAM_CTL: (["ot.ctl.assign.>"], "workqueue"),
    STREAM_EVENTS: (["ot.job.*.events"], "limits"),
    STREAM_ROLLOUT: (["ot.job.*.rollout.*"], "workqueue"),
    STREAM_TRAJ: (["ot.job.*.traj"], "limits"),
    STREAM_WEIGHTS: (["ot.job.*.weights"], "limits"),
    STREAM_METRICS: (["ot.job.*.metrics"], "limits"),
    STREAM_DLQ: (["ot.dlq.>"], "limits"),
    STREAM_TINKER: (["ot.job.*.ops.*", "ot.job.*.results.*"], "limits"),
}


class StreamLimits(msgspec.Struct, frozen=True, kw_only=True):
    """What one stream may hold (nats-server enforces it, bus.ensure_topology sets it).

    max_msg_size: bytes of one message, payload and headers (a larger publish is
        refused: nats.js.errors.BadRequestError "message size exceeds maximum allowed")
    max_bytes:    bytes of the whole stream (reserved on the server's JetStream store)
    max_age_s:    seconds a message is kept (0 = no limit)
    max_msgs_per_subject: messages kept per subject, e.g. per job (-1 = no limit)
    When a stream is full, a "limits" stream drops its oldest messages (discard old);
    a "workqueue" stream refuses new ones, per subject too (discard new), so queued
    work is never dropped to make room.
    """

    max_msg_size: int
    max_bytes: int
    max_age_s: float
    max_msgs_per_subject: int = -1


KIB, MIB, GIB = 1024, 1024**2, 1024**3
DAY_S = 86_400.0

# Sized so that a message of a valid job fits with room to spare (a trajectory of
# sampling.max_total_tokens = 131072 tokens is ~2.5 MiB of msgpack; a JobAssigned with
# 64 KiB env_args and 64 KiB sft_query ~140 KiB), and the streams together reserve
# ~4 GiB of the server's store (nats-server's default store is 75% of the free disk).
# OT_WEIGHTS keeps its (small) events without an age limit: they name a job's policy for
# as long as its weights are kept (inference `policy_of`).
STREAM_LIMITS: dict[str, StreamLimits] = {
    STREAM_CTL: StreamLimits(max_msg_size=256 * KIB, max_bytes=256 * MIB, max_age_s=14 * DAY_S,
                           max_msgs_per_subject=10_000),
    STREAM_EVENTS: StreamLimits(max_msg_size=256 * KIB, max_bytes=256 * MIB, max_age_s=14 * DAY_S,
                              max_msgs_per_subject=10_000),
    STREAM_ROLLOUT: StreamLimits(max_msg_size=1 * MIB, max_bytes=512 * MIB, max_age_s=14 * DAY_S,
                               max_msgs_per_subject=32_768),
    STREAM_TRAJ: StreamLimits(max_msg_size=4 * MIB, max_bytes=2 * GIB, max_age_s=14 * DAY_S),
    STREAM_WEIGHTS: StreamLimits(max_msg_size=256 * KIB, max_bytes=256 * MIB, max_age_s=0.0,
                               max_msgs_per_subject=1_000),
    STREAM_METRICS: StreamLimits(max_msg_size=256 * KIB, max_bytes=512 * MIB, max_age_s=14 * DAY_S),
    STREAM_DLQ: StreamLimits(max_msg_size=1 * MIB, max_bytes=256 * MIB, max_age_s=7 * DAY_S),
    # a forward_backward op holds one chunk of the SDK's data (the API asks for chunks of
    # at most TINKER_CHUNK_BYTES), its result the per-token logprobs
    STREAM_TINKER: StreamLimits(max_msg_size=6 * MIB, max_bytes=512 * MIB, max_age_s=2 * DAY_S),
}
TINKER_CHUNK_BYTES = 4_000_000

KV_JOBS = "ot_jobs"
KV_WORKERS = "ot_workers"
KV_USERS = "ot_users"
KV_KEYS = "ot_keys"
KV_TINKER = "ot_tinker"
KV_ENVS = "ot_envs"
KV_TINKER_SEQS = "ot_tinker_seqs"
# a user's submit lock, held across every scheduler on this NATS while one counts the
# user's unfinished jobs and writes the new record; a holder that died frees it at TTL
KV_LOCKS = "ot_locks"
LOCK_TTL_S = 30.0
TINKER_RECORD_TTL_S = 86_400.0  # a recorded sequence unused this long is gone (Tinker's "one day")
WORKER_TTL_S = 10.0       # a worker missing heartbeats this long is gone
WORKER_HEARTBEAT_S = 2.0
KV_MAX_VALUE_BYTES = 1 * MIB  # one value of any KV bucket (a JobRecord holds a spec of < 200 KiB)
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


def check_worker_id(worker_id: str) -> str:
    """Return worker_id if it is a valid subject token; raises ValueError otherwise."""
    if not ENV_NAME_RE.match(worker_id):
        raise ValueError(f"invalid worker id {worker_id!r}: must match {ENV_NAME_RE.pattern}")
    return worker_id


def submit_subject(pool: str = "") -> str:
    """Where a SubmitJob goes: `ot.ctl.submit.<pool>`, answered by a scheduler of that
    pool only; `ot.ctl.submit` (pool ""), by a scheduler of any pool (every scheduler
    answers both). With several pools on one NATS, a job submitted without a pool lands
    in whichever pool's scheduler takes it. Raises ValueError for a pool that is not a
    subject token."""
    return f"{SUBMIT}.{check_worker_id(pool)}" if pool else SUBMIT


def assign_learner(worker_id: str) -> str:
    """`ot.ctl.assign.learner.<worker>`: the assignments of one learner."""
    return f"ot.ctl.assign.learner.{check_worker_id(worker_id)}"


def rollout(job_id: str, worker_id: str) -> str:
    """`ot.job.<job>.rollout.<worker>`: the job's rollout requests for one worker."""
    return f"ot.job.{check_job_id(job_id)}.rollout.{check_worker_id(worker_id)}"


def rollout_all(job_id: str) -> str:
    """Every rollout request of a job, whatever its worker (for purges)."""
    return f"ot.job.{check_job_id(job_id)}.rollout.*"


def rollout_of_worker(worker_id: str) -> str:
    """Every rollout request for one worker, whatever its job (its consumer's filter)."""
    return f"ot.job.*.rollout.{check_worker_id(worker_id)}"


def tinker_op(job_id: str, seq_id: int) -> str:
    """`ot.job.<job>.ops.<seq_id>`: operation `seq_id` on a tinker session's model."""
    return f"ot.job.{check_job_id(job_id)}.ops.{int(seq_id)}"


def tinker_close(job_id: str) -> str:
    """`ot.job.<job>.ops.close`: the session of a tinker job is over (schemas/tinker.py)."""
    return f"ot.job.{check_job_id(job_id)}.ops.close"


def tinker_result(job_id: str, seq_id: int) -> str:
    """`ot.job.<job>.results.<seq_id>`: what operation `seq_id` gave (0: the session is ready)."""
    return f"ot.job.{check_job_id(job_id)}.results.{int(seq_id)}"


def tinker_results(job_id: str) -> str:
    """Every result of a tinker job or sampling session (for purges)."""
    return f"ot.job.{check_job_id(job_id)}.results.*"


def worker_key(pool: str, worker_id: str) -> str:
    """The `ot_workers` KV key of a worker."""
    return f"{check_worker_id(pool)}.{check_worker_id(worker_id)}"


def job_id_of(subject: str) -> str:
    """The job id in an `ot.job.<id>.<family>` subject."""
    return subject.split(".")[2]


class Durable(msgspec.Struct, frozen=True):
    """A durable JetStream consumer: its stream, its name and the subjects it filters.
    Every service's durable is made here and bound by `Bus.durable`."""

    stream: str
    name: str
    subject: str


def assignments_durable(worker_id: str) -> Durable:
    """A learner's assignments (work queue): one durable per learner worker."""
    return Durable(STREAM_CTL, f"learner-{check_worker_id(worker_id)}", assign_learner(worker_id))


def rollout_durable(worker_id: str) -> Durable:
    """A rollout worker's requests, of every job placed on it (work queue)."""
    return Durable(STREAM_ROLLOUT, f"rollout-{check_worker_id(worker_id)}", rollout_of_worker(worker_id))


def traj_durable(job_id: str) -> Durable:
    """A job's trajectories, read by the learner that trains it (one per job)."""
    return Durable(STREAM_TRAJ, f"learner-{check_job_id(job_id)}", job(job_id, "traj"))


def tinker_ops_durable(job_id: str) -> Durable:
    """A tinker session's operations, read by the learner that holds it (one per job)."""
    return Durable(STREAM_TINKER, f"learner-ops-{check_job_id(job_id)}", f"ot.job.{job_id}.ops.*")


def scheduler_events_durable(pool: str) -> Durable:
    """Every job's events, read by the scheduler of `pool`."""
    return Durable(STREAM_EVENTS, f"scheduler-events-{check_worker_id(pool)}", STREAMS[STREAM_EVENTS][0][0])


def recorder_durable(name: str, stream: str) -> Durable:
    """All of `stream`, read by the recorder into one of its Parquet tables."""
    return Durable(stream, f"recorder-{name}", STREAMS[stream][0][0])


TENANT_ENVS = "ot.env.user"  # tenants' own env namespaces: ot.env.user.<user>.>


def _env_base(owner: str) -> str:
    """`ot.env` for the operator's envs (owner ""), `ot.env.user.<owner>` for a user's."""
    return f"{TENANT_ENVS}.{check_user(owner)}" if owner else "ot.env"


def env_init(env: str, owner: str = "") -> str:
    """`ot.env.<env>.init`, or `ot.env.user.<owner>.<env>.init` for user `owner`'s env."""
    return f"{_env_base(owner)}.{_env(env)}.init"


def env_reset(env: str, owner: str = "") -> str:
    return f"{_env_base(owner)}.{_env(env)}.reset"


def env_info(env: str, owner: str = "") -> str:
    """Where an envhost says it serves `env` (EnvInfoRequest -> EnvInfoReply)."""
    return f"{_env_base(owner)}.{_env(env)}.info"


def env_queue_group(env: str) -> str:
    return f"envhost-{_env(env)}"


def env_step(host_id: str, owner: str = "") -> str:
    return f"{_env_base(owner)}.host.{host_id}.step"


def env_close(host_id: str, owner: str = "") -> str:
    return f"{_env_base(owner)}.host.{host_id}.close"


def tenant_envs(user: str) -> str:
    """`ot.env.user.<user>.>`: every subject of user `user`'s own envhosts."""
    return f"{TENANT_ENVS}.{check_user(user)}.>"


def check_user(user: str) -> str:
    """Return `user` if it is a valid user name (a subject token); ValueError otherwise."""
    if not USER_NAME_RE.match(user):
        raise ValueError(f"invalid user name {user!r}: must match {USER_NAME_RE.pattern}")
    return user


def dead_letter(service: str) -> str:
    return f"ot.dlq.{service}"


def _env(env: str) -> str:
    if not ENV_NAME_RE.match(env):
        raise ValueError(f"invalid env name {env!r}: must match {ENV_NAME_RE.pattern}")
    return env
