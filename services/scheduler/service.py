"""Scheduler: the control plane. Accepts, validates, records and cancels jobs.

Role: owns job records (KV bucket `ot_jobs`); the per-step data path never passes here.
It keeps no state of its own: every record lives in JetStream, so it restarts freely.

Reads:
- `ot.ctl.submit` (request/reply, queue group "scheduler"): SubmitJob -> SubmitReply.
  A bad spec is refused with the field named.
- `ot.ctl.cancel` (request/reply): CancelJob -> CancelReply.
- `ot.job.*.events` (OT_EVENTS, durable "scheduler-events"): state reported by learners.
Writes:
- KV `ot_jobs`: JobRecord per job id.
- `ot.ctl.assign.learner` (OT_CTL work queue): JobAssigned, taken by one learner.
- `ot.job.<id>.events`: JobStateChanged (queued, cancelled).

Worker pool, placement, users and auth come later (issue 4): placement will replace the
single shared assignment queue with per-worker subjects.

Run: `opentinker serve scheduler` or `python -m opentinker.services.scheduler`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

import msgspec
from nats.aio.msg import Msg
from nats.js.errors import KeyNotFoundError

from opentinker.schemas import (
    CancelJob, CancelReply, JobAssigned, JobRecord, JobState, JobStateChanged, SubmitJob,
    SubmitReply, decode, encode,
)
from opentinker.schemas import subjects as S
from opentinker.schemas.job import JOB_ID_RE, SpecError, error_field, validate_job_spec
from opentinker.services.core.bus import Bus
from opentinker.services.core.config import Settings
from opentinker.services.core.runner import run_service

log = logging.getLogger("opentinker.scheduler")
SERVICE = "scheduler"


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
        validate_job_spec(cmd.spec)
    except SpecError as e:
        return SubmitReply(ok=False, error=str(e), field=e.field)
    if cmd.job_id and not JOB_ID_RE.match(cmd.job_id):
        return SubmitReply(ok=False, error=f"invalid job id {cmd.job_id!r}: must match "
                                           f"{JOB_ID_RE.pattern}", field="job_id")
    return cmd


class Scheduler:
    def __init__(self, bus: Bus):
        self.bus = bus

    async def record(self, job_id: str) -> JobRecord | None:
        kv = await self.bus.kv(S.KV_JOBS)
        try:
            entry = await kv.get(job_id)
        except KeyNotFoundError:
            return None
        return decode(entry.value, JobRecord) if entry.value else None

    async def put(self, rec: JobRecord) -> None:
        await (await self.bus.kv(S.KV_JOBS)).put(rec.job_id, encode(rec))

    async def announce(self, rec: JobRecord) -> None:
        ev = JobStateChanged(job_id=rec.job_id, state=rec.state, reason=rec.reason, step=rec.step,
                             time_s=time.time(), source=SERVICE)
        await self.bus.publish(S.job(rec.job_id, "events"), ev)

    async def on_submit(self, m: Msg) -> None:
        parsed = refuse_submit(m.data)
        if isinstance(parsed, SubmitReply):
            log.info("refused a job: %s", parsed.error)
            reply = parsed
        else:
            reply = await self.submit(parsed)
        if m.reply:
            await self.bus.nc.publish(m.reply, encode(reply))

    async def submit(self, cmd: SubmitJob) -> SubmitReply:
        job_id = cmd.job_id or new_job_id(cmd.spec.name or cmd.spec.env)
        if await self.record(job_id) is not None:
            return SubmitReply(ok=False, error=f"job {job_id} already exists", field="job_id")
        now = time.time()
        rec = JobRecord(job_id=job_id, spec=cmd.spec, state=JobState.QUEUED, created_s=now,
                        updated_s=now, history=[f"{now:.3f} queued"])
        await self.put(rec)
        await self.bus.publish(S.ASSIGN_LEARNER, JobAssigned(job_id=job_id, spec=cmd.spec),
                               msg_id=f"assign-{job_id}")
        await self.announce(rec)
        log.info("accepted job %s (model=%s env=%s steps=%d)", job_id, cmd.spec.model,
                 cmd.spec.env, cmd.spec.steps)
        return SubmitReply(ok=True, job_id=job_id)

    async def on_cancel(self, cmd: CancelJob, _m: Msg) -> CancelReply:
        rec = await self.record(cmd.job_id)
        if rec is None:
            return CancelReply(ok=False, error=f"no job {cmd.job_id}")
        if rec.state.terminal:
            return CancelReply(ok=False, state=rec.state.value,
                               error=f"job {cmd.job_id} already {rec.state.value}")
        now = time.time()
        rec = msgspec.structs.replace(rec, state=JobState.CANCELLED, reason=cmd.reason, updated_s=now,
                                      history=[*rec.history, f"{now:.3f} cancelled: {cmd.reason}"])
        await self.put(rec)
        await self.announce(rec)
        return CancelReply(ok=True, state=rec.state.value)

    async def on_event(self, ev: JobStateChanged, _m: Msg) -> None:
        """Fold a learner's report into the job record. A terminal record never changes."""
        if ev.source == SERVICE:
            return
        rec = await self.record(ev.job_id)
        if rec is None or rec.state.terminal:
            return
        history = rec.history if ev.state == rec.state else [*rec.history, f"{ev.time_s:.3f} {ev.state.value}"]
        rec = msgspec.structs.replace(rec, state=ev.state, reason=ev.reason, step=max(rec.step, ev.step),
                                      updated_s=time.time(), history=history[-50:])
        await self.put(rec)


async def body(settings: Settings, bus: Bus, stop: asyncio.Event) -> None:
    sched = Scheduler(bus)
    await bus.nc.subscribe(S.SUBMIT, queue=SERVICE, cb=sched.on_submit)
    await bus.serve(S.CANCEL, CancelJob, sched.on_cancel, queue=SERVICE)
    events = await bus.pull("OT_EVENTS", "scheduler-events", "ot.job.*.events")
    log.info("scheduler ready on %s", settings.nats_url)
    await bus.consume(events, JobStateChanged, sched.on_event, stop)


def main(argv: list[str] | None = None) -> None:
    run_service(SERVICE, body, argv)
