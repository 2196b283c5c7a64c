"""Scheduler: the control plane. Accepts jobs, places them on the worker pool, requeues
them when a worker is lost, and cancels them.

Role: owns job records (KV `ot_jobs`) and placement; the per-step data path never
passes here. It keeps no state of its own: records, the pool (`ot_workers`) and
learners' reports all live in JetStream, so it can be killed and restarted at any time.

Reads:
- `ot.ctl.submit` and `ot.ctl.submit.<pool>` (request/reply, queue group "scheduler"):
  SubmitJob -> SubmitReply. The first is any pool's, the second this pool's only.
  A bad spec is refused with the field named. Only services publish here (API-key users
  submit over the REST API, which calls the same `submit`); the key in the body names
  the user, and the answer goes only to an `_INBOX.` reply subject, never to a stream,
  KV or service subject a sender chose.
- `ot.ctl.cancel` (request/reply): CancelJob -> CancelReply, answered the same way.
- `ot.job.*.events` (OT_EVENTS, durable "scheduler-events"): state reported by
  learners and inference clients; a report whose body names another job than its
  subject is dead-lettered, one from a past attempt is ignored.
- KV `ot_workers`: the live workers of its pool (placement.py decides).
- `$SYS.REQ.USER.AUTH` (with `nats_callout_issuer_file`): the NATS auth callout
  (natsauth.py): an API key becomes a user JWT in the TENANTS account.
Writes:
- KV `ot_jobs`: JobRecord per job id (compare-and-set on the revision it read).
- `ot.ctl.assign.learner.<worker>` (OT_CTL work queue): JobAssigned for the placed learner.
- `ot.job.<id>.events`: JobStateChanged (queued, requeued, running for inference, cancelled).

Every RECONCILE_S (and at once after a submit or a report) it requeues the placed jobs
of workers that left the pool (missed heartbeats: a training job resumes from its last
checkpoint) and places queued jobs on free workers (placement.py). A training job that
loses only some of its rollout workers is not requeued: its record keeps the attempt
with the survivors (`fail_over`) and its learner asks the lost workers' groups again.

Every RETENTION_EVERY_S it deletes finished job records past retention (settings
`job_retention_days`, `finished_jobs_per_user`; retention.py) with the jobs' objects.

Run: `opentinker serve scheduler` or `python -m opentinker.services.scheduler`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
import time
from pathlib import Path

import msgspec
from nats.aio.msg import Msg
from nats.js.errors import KeyWrongLastSequenceError

from opentinker.schemas import (
    CancelJob, CancelReply, JobAssigned, JobRecord, JobState, JobStateChanged, SubmitJob,
    SubmitReply, WeightsPublished, decode, encode,
)
from opentinker.schemas import subjects as S
from opentinker.schemas.job import JOB_ID_RE, SpecError, error_field, validate_job_spec
from opentinker.schemas.pool import Placement, WorkerInfo
from opentinker.services.core.bus import Bus, MessageRefused
from opentinker.services.core.config import Settings
from opentinker.services.core.pool import live_workers
from opentinker.services.core.runner import run_service
from opentinker.schemas.users import User
from opentinker.services.scheduler.placement import (
    inference_requests, Quota, holders, lost_by_job, plan, without_lost_rollout,
)
from opentinker.services.scheduler.locks import submit_lock
from opentinker.services.scheduler.retention import expired_records, forget_jobs, named_jobs
from opentinker.services.core.users import AuthError, Users

log = logging.getLogger("opentinker.scheduler")
SERVICE = "scheduler"
RECONCILE_S = 1.0
RETENTION_EVERY_S = 60.0  # how often finished records past retention are deleted (forget_finished)
HISTORY_KEPT = 50


def new_job_id(name: str) -> str:
    """`<slug of name>-<6 hex>`, a valid subject token."""
    slug = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")[:40] or "job"
    return f"{slug}-{secrets.token_hex(3)}"


def refuse_submit(data: bytes) -> SubmitReply | SubmitJob:
    """Decode a SubmitJob, or the refusal naming the field that failed."""
    try:
        cmd = decode(data, SubmitJob)
    except msgspec.ValidationError as e:
        return SubmitReply(ok=False, error=f"invalid job spec: {e}",
                           field=error_field(e).removeprefix("spec."))
    except msgspec.DecodeError as e:
        return SubmitReply(ok=False, error=f"undecodable SubmitJob: {e}", field="")
    try:
        validate_job_spec(cmd.spec, cmd.kind)
    except SpecError as e:
        return SubmitReply(ok=False, error=str(e), field=e.field)
    if cmd.job_id and not JOB_ID_RE.match(cmd.job_id):
        return SubmitReply(ok=False, error=f"invalid job id {cmd.job_id!r}: must match "
                                           f"{JOB_ID_RE.pattern}", field="job_id")
    return cmd


def with_state(rec: JobRecord, state: JobState, reason: str = "", **changes) -> JobRecord:
    """`rec` moved to `state`, the move noted in its history."""
    now = time.time()
    note = f"{now:.3f} {state.value}" + (f": {reason}" if reason else "")
    return msgspec.structs.replace(rec, state=state, reason=reason, updated_s=now,
                                   history=[*rec.history, note][-HISTORY_KEPT:], **changes)


def visible(rec: JobRecord, user: User) -> bool:
    """Whether `user` may see and act on the job: their own, or any for an admin."""
    return user.role == "admin" or rec.user == user.name


class Conflict(Exception):
    """A record changed between read and write (another writer won); retry next round."""


class Scheduler:
    def __init__(self, bus: Bus, settings: Settings):
        self.bus = bus
        self.settings = settings
        self.users = Users(bus)
        self.quotas: dict[str, Quota] = {}
        self.pool = settings.pool
        self.lock = asyncio.Lock()   # one writer of records at a time in this process
        self.wake = asyncio.Event()
        self.system = None           # natsauth.SystemClient, with a system-account nkey
        self._reconnects = 0
        self._trust_after = time.monotonic() + S.WORKER_TTL_S  # see settled()

    async def connect_system(self, url: str, seed_file: str) -> None:
        """Connect to the system account (natsauth.SystemClient): revoked keys' live
        connections are then kicked at once."""
        import nats

        from opentinker.services.core.config import server_list
        from opentinker.services.core.natsauth import SystemClient

        nc = await nats.connect(server_list(url), nkeys_seed=seed_file, name="opentinker-scheduler-system",
                                max_reconnect_attempts=-1, connect_timeout=5)
        self.system = SystemClient(nc)

    async def revoke_key(self, kid: str):
        """Revoke API key `kid` (Users.revoke) and disconnect its live NATS connections.
        Raises UserError (404) for an unknown key."""
        rec = await self.users.revoke(kid)
        if self.system is not None:
            n = await self.system.kick(rec.user, kid)
            log.info("key %s of %r revoked; %d live NATS connections closed", kid, rec.user, n)
        return rec

    # -- records --

    async def record(self, job_id: str) -> tuple[JobRecord, int] | None:
        """(record, KV revision), or None."""
        return await self.bus.job_record(job_id)

    async def put(self, rec: JobRecord, revision: int | None) -> int:
        """Write `rec` if the stored revision is still `revision` (None: a new key).
        Raises Conflict otherwise."""
        kv = await self.bus.kv(S.KV_JOBS)
        try:
            if revision is None:
                return await kv.create(rec.job_id, encode(rec))
            return await kv.update(rec.job_id, encode(rec), last=revision)
        except KeyWrongLastSequenceError:
            raise Conflict(rec.job_id) from None

    async def nats_grant(self, token: str) -> tuple[str, list[str] | None, str]:
        """The auth callout's grant for a NATS connection presenting API key `token`:
        (user name, the jobs it may reach or None for an admin, key id). The jobs are the
        user's unfinished ones and those finished in the last GRANT_FINISHED_S, in any
        pool. Raises PermissionError with the reason (a wrong, revoked or missing key)."""
        from opentinker.services.core.natsauth import GRANT_FINISHED_S
        from opentinker.services.core.users import key_id

        try:
            user = await self.users.authenticate(token)
        except AuthError as e:
            raise PermissionError(e.reason) from None
        if user.role == "admin":
            return user.name, None, key_id(token)
        now = time.time()
        jobs = [rec.job_id for rec, _ in await self.records(every_pool=True)
                if rec.user == user.name and (not rec.state.terminal or now - rec.updated_s < GRANT_FINISHED_S)]
        return user.name, jobs, key_id(token)

    async def records(self, every_pool: bool = False) -> list[tuple[JobRecord, int]]:
        """Every readable record of this scheduler's pool (of every pool, with
        `every_pool`)."""
        out = []
        for key, (value, rev) in (await self.bus.kv_values(S.KV_JOBS)).items():
            try:
                rec = decode(value, JobRecord)
            except msgspec.MsgspecError as e:
                log.warning("unreadable job record %s: %s", key, e)
                continue
            if every_pool or rec.pool == self.pool:
                out.append((rec, rev))
        return out

    async def announce(self, rec: JobRecord) -> None:
        ev = JobStateChanged(job_id=rec.job_id, state=rec.state, reason=rec.reason, step=rec.step,
                             time_s=time.time(), source=SERVICE, attempt=rec.attempt)
        await self.bus.publish(S.job(rec.job_id, "events"), ev)

    async def load_quotas(self) -> None:
        """Each user's quota: their own limits, else the scheduler's defaults."""
        self.quotas = {u.name: Quota(u.max_jobs or self.settings.max_jobs_per_user,
                                     u.max_workers or self.settings.max_workers_per_user,
                                     self.settings.learner_share_per_user)
                       for u in await self.users.users()}

    def quota_of(self, user: str) -> Quota:
        return self.quotas.get(user) or Quota(self.settings.max_jobs_per_user, self.settings.max_workers_per_user,
                                              self.settings.learner_share_per_user)

    # -- commands --

    async def on_submit(self, m: Msg) -> None:
        if not self.bus.reply_allowed(m.reply):
            await self.bus.dead_letter(m, f"SubmitJob: reply subject {m.reply!r} refused (an _INBOX. subject only)")
            return
        parsed = refuse_submit(m.data)
        if isinstance(parsed, SubmitReply):
            log.info("refused a job: %s", parsed.error)
            reply = parsed
        else:
            try:
                user = await self.users.authenticate(parsed.api_key)
            except AuthError as e:
                reply = SubmitReply(ok=False, error=e.reason, field="api_key")
            else:
                reply = await self.submit(parsed, user)
        await self.bus.nc.publish(m.reply, encode(reply))

    async def submit(self, cmd: SubmitJob, user: User) -> SubmitReply:
        """Record a checked job as QUEUED (placement follows). Refuses, naming the field:
        a path in the spec outside the user's own area (access.check_spec_paths), an env
        served neither by the user's own envhost nor the operator's (envs.py), a
        tinker_init save of another user's job, an opponent that is not the user's job of
        the same model, more than `max_unfinished_jobs_per_user` unfinished jobs, a taken
        job id. The unfinished jobs are counted, on a fresh read of the records, under the
        user's submit lock with the new record's write (submit_lock), so parallel submits
        (the REST API's and `ot.ctl.submit`'s, to this scheduler or another pool's)
        cannot all pass one count."""
        from opentinker.services.core.access import check_spec_paths, confine_env_args, path_args
        from opentinker.services.scheduler.envs import resolve_env_owner

        every = [r for r, _ in await self.records(every_pool=True)]
        mine = [r for r in every if r.user == user.name]
        rules = dict(user=user.name, admin=user.role == "admin", home=self.settings.home,
                     own_jobs={r.job_id for r in mine})
        try:
            # the checked form is what every service is given (a relative path resolved
            # in the user's area, symlinks resolved): what runs is what was checked
            changes = check_spec_paths(cmd.spec, **rules)
            source = cmd.spec.tinker_init.partition("/")[0]
            if source and not rules["admin"] and source not in rules["own_jobs"]:
                raise SpecError("tinker_init", f"no job {source!r} of yours saved it")
            models = {r.job_id: r.spec.model for r in (every if rules["admin"] else mine)}
            # the jobs whose policies this one uses: the user's own, of the same model
            named = [("init_from", "", cmd.spec.init_from, "a job starts from a policy of its own model"),
                     ("teacher_job", "", cmd.spec.teacher_job, "a teacher scores tokens of its own model"),
                     *(("opponents", f"seat {seat!r}: ", other, "a seat's policy must be of the same model")
                       for seat, other in cmd.spec.opponents.items())]
            for field, where, other, why in named:
                if not other:
                    continue
                if other not in models:
                    raise SpecError(field, f"{where}no job {other!r} of yours")
                if models[other] != changes["model"]:
                    raise SpecError(field, f"{where}job {other!r} trains {models[other]!r}, "
                                           f"this job {changes['model']!r}: {why}")
            env_owner = await resolve_env_owner(self.bus, cmd.spec, cmd.kind, user.name)
            if not env_owner and path_args(cmd.spec.env_args):  # an operator's env reads them on a service host
                changes["env_args"] = confine_env_args(cmd.spec.env_args, **rules)
        except SpecError as e:
            return SubmitReply(ok=False, error=str(e), field=e.field)
        cmd = msgspec.structs.replace(cmd, spec=msgspec.structs.replace(cmd.spec, **changes))
        if refused := self.unfinished_refusal(user, mine):  # early; checked again under the lock
            return refused
        job_id = cmd.job_id or new_job_id(cmd.spec.name or cmd.spec.env)
        now = time.time()
        token = ""
        if cmd.kind == "inference":
            token = "otj-" + secrets.token_urlsafe(32)
        elif cmd.policy_of or cmd.plan:
            field = "policy_of" if cmd.policy_of else "plan"
            return SubmitReply(ok=False, error=f"only an inference job takes `{field}`", field=field)
        if cmd.plan and cmd.plan.episodes % cmd.plan.group_size:
            return SubmitReply(ok=False, field="plan", error=f"episodes ({cmd.plan.episodes}) must be a multiple "
                                                            f"of group_size ({cmd.plan.group_size})")
        rec = JobRecord(job_id=job_id, spec=cmd.spec, state=JobState.QUEUED, created_s=now,
                        updated_s=now, history=[f"{now:.3f} queued"], kind=cmd.kind, user=user.name,
                        pool=self.pool, env_owner=env_owner,
                        plan=cmd.plan and msgspec.structs.replace(cmd.plan, policy_version=int(bool(cmd.policy_of))),
                        endpoint_token_sha256=hashlib.sha256(token.encode()).hexdigest() if token else "")
        policy = None
        if cmd.policy_of:
            policy = await self.policy_event(cmd.policy_of, job_id, user)
            if isinstance(policy, SubmitReply):
                return policy
        # the user's lock first: waiting for another scheduler's hold keeps no other work waiting
        async with submit_lock(self.bus, user.name, user.role == "admin", self.settings.submit_lease_s) as held, \
                self.lock:
            if not held:
                return SubmitReply(ok=False, field="job_id", error=f"another submit of user {user.name!r} "
                                                                    "holds the submit lock; try again")
            if user.role != "admin":  # a fresh count: records written since the read above
                now_mine = [r for r, _ in await self.records(every_pool=True) if r.user == user.name]
                if refused := self.unfinished_refusal(user, now_mine):
                    return refused
            if held.expired():  # the lock's TTL may free it for another scheduler's count
                return SubmitReply(ok=False, field="job_id", error="the submit took too long under the submit "
                                   f"lock of user {user.name!r} (NATS slow?); try again")
            try:
                await self.put(rec, None)
            except Conflict:
                return SubmitReply(ok=False, error=f"job {job_id} already exists", field="job_id")
        if policy is not None:
            await self.bus.publish(S.job(job_id, "weights"), policy, msg_id=f"{job_id}-w1")
        await self.announce(rec)
        self.wake.set()
        log.info("accepted %s job %s of %r (model=%s env=%s steps=%d)", cmd.kind, job_id, user.name,
                 cmd.spec.model, cmd.spec.env, cmd.spec.steps)
        return SubmitReply(ok=True, job_id=job_id, endpoint_token=token)

    def unfinished_refusal(self, user: User, mine: list[JobRecord]) -> SubmitReply | None:
        """The refusal of one more job of `user` (an admin: none) when `mine`, the user's
        records, hold `max_unfinished_jobs_per_user` unfinished jobs already; else None."""
        unfinished = sum(1 for r in mine if not r.state.terminal)
        limit = self.settings.max_unfinished_jobs_per_user
        if user.role == "admin" or unfinished < limit:
            return None
        return SubmitReply(ok=False, field="job_id", error=(
            f"user {user.name!r} has {unfinished} unfinished jobs, the most one user may queue "
            f"(max_unfinished_jobs_per_user = {limit}); cancel one or wait"))

    async def policy_event(self, source: str, job_id: str, user: User) -> WeightsPublished | SubmitReply:
        """The newest weight event of train job `source` (the user's own), re-addressed
        to `job_id` as its policy version 1; a refusal naming `policy_of` otherwise."""
        got = await self.record(source) if JOB_ID_RE.match(source) else None
        if got is None or not visible(got[0], user):
            return SubmitReply(ok=False, error=f"no job {source}", field="policy_of")
        raw = await self.bus.last_message(S.job(source, "weights"))
        try:
            ev = decode(raw.data, WeightsPublished) if raw is not None else None
        except msgspec.MsgspecError:
            ev = None
        if ev is None:
            return SubmitReply(ok=False, error=f"job {source} has published no weights yet", field="policy_of")
        return msgspec.structs.replace(ev, job_id=job_id, policy_version=1, time_s=time.time())

    async def on_cancel(self, cmd: CancelJob, _m: Msg) -> CancelReply:
        try:
            user = await self.users.authenticate(cmd.api_key)
        except AuthError as e:
            return CancelReply(ok=False, error=e.reason)
        return await self.cancel(cmd.job_id, cmd.reason, user)

    async def cancel(self, job_id: str, reason: str, user: User,
                     state: JobState = JobState.CANCELLED) -> CancelReply:
        """Cancel a job of `user` (any job, for an admin); with `state` COMPLETED, end an
        inference job its client is done with (the API's /complete)."""
        async with self.lock:
            got = await self.record(job_id)
            if got is None or not visible(got[0], user):
                return CancelReply(ok=False, error=f"no job {job_id}")
            rec, rev = got
            if rec.state.terminal:
                return CancelReply(ok=False, state=rec.state.value,
                                   error=f"job {job_id} already {rec.state.value}")
            rec = with_state(rec, state, reason)
            try:
                await self.put(rec, rev)
            except Conflict:
                return CancelReply(ok=False, state=rec.state.value, error="job changed meanwhile; try again")
        await self.announce(rec)
        await self.bus.purge_subject(S.STREAM_ROLLOUT, S.rollout_all(job_id))
        self.wake.set()
        return CancelReply(ok=True, state=rec.state.value)

    async def complete(self, job_id: str, user: User) -> CancelReply:
        """End inference job `job_id` of `user` as COMPLETED (its workers are free)."""
        return await self.cancel(job_id, "completed by its client", user, JobState.COMPLETED)

    async def on_event(self, ev: JobStateChanged, m: Msg) -> None:
        """Fold a learner's (or inference client's) report into the job record. A
        terminal record never changes; a report from a past attempt is ignored. Raises
        MessageRefused (dead-lettered) for a report whose body names another job than
        its subject."""
        if ev.job_id != S.job_id_of(m.subject):
            raise MessageRefused(f"JobStateChanged.job_id: {ev.job_id!r} on {m.subject}")
        if ev.source == SERVICE:
            return
        async with self.lock:
            got = await self.record(ev.job_id)
            if got is None:
                raise MessageRefused(f"JobStateChanged.job_id: no job {ev.job_id!r}")
            rec, rev = got
            if rec.state.terminal or rec.placement is None or ev.attempt not in (0, rec.attempt):
                return
            if ev.state == JobState.QUEUED:
                return  # only the scheduler requeues
            history = rec.history if ev.state == rec.state else \
                [*rec.history, f"{ev.time_s:.3f} {ev.state.value}" + (f": {ev.reason}" if ev.reason else "")]
            rec = msgspec.structs.replace(rec, state=ev.state, reason=ev.reason, step=max(rec.step, ev.step),
                                          updated_s=time.time(), history=history[-HISTORY_KEPT:])
            try:
                await self.put(rec, rev)
            except Conflict:
                raise RuntimeError(f"job {ev.job_id} changed meanwhile") from None  # redelivered
        if rec.state.terminal:
            self.wake.set()  # its workers are free

    # -- placement --

    def settled(self) -> bool:
        """Whether the pool's heartbeats can be trusted now: not within WORKER_TTL_S of
        this process connecting, or reconnecting, to NATS. Across a NATS outage every
        heartbeat fails and expires; workers beat again within WORKER_HEARTBEAT_S of the
        server's return, and no healthy job must be requeued meanwhile."""
        reconnects = self.bus.nc.stats.get("reconnects", 0)
        if reconnects != self._reconnects:
            self._reconnects = reconnects
            self._trust_after = time.monotonic() + S.WORKER_TTL_S
        return time.monotonic() >= self._trust_after

    async def reconcile(self) -> None:
        """One round: requeue the jobs of lost workers, then place queued jobs."""
        await self.load_quotas()
        async with self.lock:
            live = await live_workers(self.bus, self.pool)
            recs = await self.records()
            records = [r for r, _ in recs]
            lost = lost_by_job(records, live) if self.settled() else {}
            if lost:
                # a worker is lost when a second listing misses it too: a listing once
                # missed a worker that beat on time (core/kvlist.py says why; fixed there)
                live = {**await live_workers(self.bus, self.pool), **live}
                lost = lost_by_job(records, live)
            for i, names in lost.items():
                rec, rev = recs[i]
                kept = without_lost_rollout(rec, names)
                with contextlib.suppress(Conflict):  # changed meanwhile: next round
                    recs[i] = await (self.requeue(rec, rev, names) if kept is None
                                     else self.fail_over(rec, rev, names, kept))
            active = [r for r, _ in recs if not r.state.terminal and r.placement is not None]
            queued = {r.job_id: (r, v) for r, v in recs if r.state == JobState.QUEUED and r.placement is None}
            for rec, p in plan([r for r, _ in queued.values()], active, live, self.quota_of, time.time()):
                with contextlib.suppress(Conflict):
                    await self.place(rec, queued[rec.job_id][1], p, live)

    async def requeue(self, rec: JobRecord, rev: int, lost: list[str]) -> tuple[JobRecord, int]:
        """Put a placed job back in the queue; returns the new record and revision."""
        why = f"worker {', '.join(lost)} left the pool; requeued from the last checkpoint"
        rec = with_state(rec, JobState.QUEUED, why, placement=None)
        rev = await self.put(rec, rev)
        log.warning("job %s: %s", rec.job_id, why)
        await self.announce(rec)  # a surviving learner of the job stops on this
        await self.bus.purge_subject(S.STREAM_ROLLOUT, S.rollout_all(rec.job_id))
        for w in lost:
            await self.forget_worker(w)
        return rec, rev

    async def fail_over(self, rec: JobRecord, rev: int, lost: list[str], kept: Placement) -> tuple[JobRecord, int]:
        """Keep a training job whose learner and some rollout workers survive on those:
        same attempt, fewer rollout workers. The announcement tells its learner, which
        asks the lost workers' unfinished groups again on the survivors (no requeue, no
        step lost). Returns the new record and revision."""
        why = (f"rollout worker {', '.join(lost)} left the pool; the job goes on with "
               f"{', '.join(kept.rollout)}")
        rec = with_state(rec, rec.state, why, placement=kept)
        rev = await self.put(rec, rev)
        log.warning("job %s: %s", rec.job_id, why)
        for w in lost:
            await self.forget_worker(w)
        await self.announce(rec)
        return rec, rev

    # -- retention --

    async def forget_finished(self, now: float) -> int:
        """Delete this pool's finished job records past retention (retention.py), each
        with the job's objects, weight events and rollout work; returns how many."""
        every = await self.records(every_pool=True)
        mine = {r.job_id: (r, v) for r, v in every if r.pool == self.pool}
        gone = expired_records([r for r, _ in mine.values()], now, self.settings.job_retention_days,
                               self.settings.finished_jobs_per_user, in_use=named_jobs(r for r, _ in every))
        if not gone:
            return 0
        deleted, objects = await forget_jobs(self.bus, [(r.job_id, mine[r.job_id][1]) for r in gone])
        log.info("deleted %d finished job records of pool %s and their %d objects (older than "
                 "job_retention_days = %g, or past a user's newest finished_jobs_per_user = %d)",
                 deleted, self.pool, objects, self.settings.job_retention_days,
                 self.settings.finished_jobs_per_user)
        return deleted

    async def forget_worker(self, worker: str) -> None:
        """Drop a lost worker's consumers and the work addressed to it."""
        for d in (S.assignments_durable(worker), S.rollout_durable(worker)):
            await self.bus.delete_durable(d)
            await self.bus.purge_subject(d.stream, d.subject)

    async def place(self, rec: JobRecord, rev: int, p: Placement, live: dict[str, WorkerInfo]) -> None:
        """Record placement `p` of a queued job (`live`: the round's pool, where an
        inference job's endpoint is its first rollout worker's serve_url), then assign
        its learner or send its requests, and announce it."""
        where = ", ".join(holders(msgspec.structs.replace(rec, placement=p)))
        state = JobState.RUNNING if rec.kind == "inference" else JobState.QUEUED
        endpoint = ""
        if rec.kind == "inference" and p.rollout:
            info = live.get(p.rollout[0])
            if info is not None and info.serve_url:
                endpoint = f"{info.serve_url.rstrip('/')}/jobs/{rec.job_id}/v1"
        rec = with_state(rec, state, f"placed on {where} (attempt {p.attempt})", placement=p, attempt=p.attempt,
                         endpoint=endpoint)
        await self.put(rec, rev)
        if rec.kind == "train":
            await self.bus.publish(S.assign_learner(p.learner),
                                   JobAssigned(job_id=rec.job_id, spec=rec.spec, attempt=p.attempt,
                                               rollout_workers=list(p.rollout)),
                                   msg_id=f"assign-{rec.job_id}-a{p.attempt}")
        if rec.kind == "inference" and rec.plan is not None and p.rollout:
            for req in inference_requests(rec, p):
                await self.bus.publish(S.rollout(rec.job_id, p.rollout[req.group_index % len(p.rollout)]), req,
                                       msg_id=f"{req.request_id}-a{p.attempt}")
        await self.announce(rec)
        log.info("job %s placed on %s (attempt %d)", rec.job_id, where, p.attempt)

    async def run_placement(self, stop: asyncio.Event) -> None:
        """Reconcile every RECONCILE_S (or when woken); forget finished jobs past
        retention at once and then every RETENTION_EVERY_S."""
        forget_at = 0.0
        while not stop.is_set():
            try:
                await self.reconcile()
            except Exception:
                log.exception("placement round failed; retrying")
            if time.monotonic() >= forget_at:
                forget_at = time.monotonic() + RETENTION_EVERY_S
                try:
                    await self.forget_finished(time.time())
                except Exception:
                    log.exception("deleting finished jobs failed; retrying in %.0f s", RETENTION_EVERY_S)
            self.wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.wake.wait(), RECONCILE_S)


async def body(settings: Settings, bus: Bus, stop: asyncio.Event) -> None:
    S.check_worker_id(settings.pool)
    sched = Scheduler(bus, settings)
    await sched.users.bootstrap_admin()
    await bus.nc.subscribe(S.SUBMIT, queue=SERVICE, cb=sched.on_submit)
    # a submit naming this pool (SDK `pool=`, $OPENTINKER_POOL; the tinker API's own pool)
    await bus.nc.subscribe(S.submit_subject(settings.pool), queue=SERVICE, cb=sched.on_submit)
    await bus.serve(S.CANCEL, CancelJob, sched.on_cancel, queue=SERVICE)
    if settings.nats_callout_issuer_file:
        from opentinker.services.core.natsauth import AuthCallout

        seed = Path(settings.nats_callout_issuer_file).read_bytes().strip()
        xkey = Path(settings.nats_callout_xkey_file).read_bytes().strip() if settings.nats_callout_xkey_file else None
        await AuthCallout(bus.nc, seed, sched.nats_grant, xkey, on_unreadable=bus.dead_letter).start()
        log.info("answering the NATS auth callout%s: users connect with their API key",
                 " (sealed with an xkey)" if xkey else "")
    if settings.nats_system_nkey_file:
        await sched.connect_system(settings.nats_url, settings.nats_system_nkey_file)
    events = await bus.durable(S.scheduler_events_durable(settings.pool))
    placing = asyncio.create_task(sched.run_placement(stop))
    server = None
    if settings.api_port:
        from opentinker.services.scheduler.api import serve_api

        server = await serve_api(sched, settings.api_host, settings.api_port, settings.api_fd)
        log.info("REST API and dashboard on http://%s:%d/", settings.api_host, server.port)
    log.info("scheduler of pool %s ready on %s", settings.pool, settings.nats_url)
    try:
        await bus.consume(events, JobStateChanged, sched.on_event, stop)
    finally:
        if sched.system is not None:
            await sched.system.nc.close()
        placing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await placing
        if server is not None:
            await server.stop()


def main(argv: list[str] | None = None) -> None:
    run_service(SERVICE, body, argv)
