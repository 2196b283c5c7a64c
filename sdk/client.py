"""The client API: submit a job, follow it, cancel it, attach to it later.

    client = await Client.connect("nats://127.0.0.1:4222")
    job = await client.submit({"env": "arith", "steps": 20})
    async for m in job.metrics():
        print(m.step, m.values["reward_mean"])
    record = await job.wait()

`SyncClient` wraps the same calls for notebooks and scripts. Imports schemas and the NATS
client only (never torch or vLLM).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from nats.js import api

from opentinker.schemas import (
    CancelJob, CancelReply, JobRecord, JobSpec, JobState, JobStateChanged, Metrics, SubmitJob,
    SubmitReply, decode,
)
from opentinker.schemas import subjects as S
from opentinker.schemas.job import SpecError, spec_from_dict
from opentinker.services.core.bus import Bus


class AuthenticationError(PermissionError):
    """The scheduler refused the API key (missing, wrong or revoked)."""


def default_api_key() -> str:
    """$OPENTINKER_API_KEY, else the file named by $OPENTINKER_API_KEY_FILE, else the
    local stack's admin key (`<home>/admin.key`, written by `opentinker up`), else ""."""
    import os
    from pathlib import Path

    if os.environ.get("OPENTINKER_API_KEY"):
        return os.environ["OPENTINKER_API_KEY"]
    path = os.environ.get("OPENTINKER_API_KEY_FILE")
    if not path:
        from opentinker.services.core.config import default_home

        path = str(Path(default_home()) / "admin.key")
    p = Path(path)
    return p.read_text().strip() if p.is_file() else ""


class JobFailed(RuntimeError):
    """`Job.wait` saw the job end FAILED or CANCELLED. `.record` holds the JobRecord."""

    def __init__(self, record: JobRecord):
        super().__init__(f"job {record.job_id} {record.state.value}: {record.reason}")
        self.record = record


class Job:
    """A handle on one job, by id. Cheap: holds no server-side state."""

    def __init__(self, client: Client, job_id: str):
        self.client = client
        self.id = S.check_job_id(job_id)

    def __repr__(self) -> str:
        return f"Job({self.id!r})"

    async def record(self) -> JobRecord:
        """The scheduler's record. Raises KeyError if the job does not exist."""
        got = await self.client.bus.job_record(self.id)
        if got is None:
            raise KeyError(f"no job {self.id}")
        return got[0]

    async def _subscribe(self, family: str, from_start: bool) -> tuple[Any, asyncio.Queue]:
        """An ordered JetStream consumer on the job's `family` subject feeding a queue."""
        q: asyncio.Queue = asyncio.Queue()

        async def cb(m) -> None:
            q.put_nowait(m)

        policy = api.DeliverPolicy.ALL if from_start else api.DeliverPolicy.NEW
        sub = await self.client.bus.js.subscribe(S.job(self.id, family), ordered_consumer=True,
                                                 deliver_policy=policy, cb=cb)
        return sub, q

    async def events(self, from_start: bool = True) -> AsyncIterator[JobStateChanged]:
        """Every state change of the job, ending after a terminal one."""
        sub, q = await self._subscribe("events", from_start)
        try:
            while True:
                ev = decode((await q.get()).data, JobStateChanged)
                yield ev
                if ev.state.terminal:
                    return
        finally:
            await sub.unsubscribe()

    async def metrics(self, from_start: bool = True, until_done: bool = True) -> AsyncIterator[Metrics]:
        """Metrics as the learner publishes them (from step 0 by default). With
        `until_done`, the iterator ends once the job is terminal and what was published
        before the end has arrived."""
        sub, q = await self._subscribe("metrics", from_start)
        done = asyncio.ensure_future(self._terminal()) if until_done else None
        try:
            while done is None or not done.done():
                get = asyncio.ensure_future(q.get())
                await asyncio.wait({get} | ({done} if done else set()),
                                   return_when=asyncio.FIRST_COMPLETED)
                if get.done():
                    yield decode(get.result().data, Metrics)
                else:
                    get.cancel()
            while True:  # the job is over: drain, then stop
                try:
                    m = await asyncio.wait_for(q.get(), 1.0)
                except asyncio.TimeoutError:
                    return
                yield decode(m.data, Metrics)
        finally:
            if done:
                done.cancel()
            await sub.unsubscribe()

    async def _terminal(self) -> JobRecord:
        async for ev in self.events():
            if ev.state.terminal:
                break
        # the scheduler folds the final event into the record; read it once it has
        for _ in range(50):
            rec = await self.record()
            if rec.state.terminal:
                return rec
            await asyncio.sleep(0.1)
        return rec

    async def wait(self, timeout_s: float | None = None, raise_on_failure: bool = True) -> JobRecord:
        """Block until the job is completed, failed or cancelled; return its record.

        Raises JobFailed (failed/cancelled, unless raise_on_failure=False) and
        asyncio.TimeoutError after `timeout_s`.
        """
        rec = await asyncio.wait_for(self._terminal(), timeout_s)
        if raise_on_failure and rec.state != JobState.COMPLETED:
            raise JobFailed(rec)
        return rec

    async def cancel(self, reason: str = "cancelled by user") -> CancelReply:
        """Ask the scheduler to cancel. Raises nats.errors.NoRespondersError if none runs."""
        return await self.client.bus.request(
            S.CANCEL, CancelJob(job_id=self.id, reason=reason, api_key=self.client.api_key), CancelReply)


class Client:
    """An OpenTinker client over one NATS connection."""

    def __init__(self, bus: Bus, api_key: str = ""):
        self.bus = bus
        self.api_key = api_key

    @classmethod
    async def connect(cls, nats_url: str | None = None, api_key: str | None = None) -> Client:
        """Connect to `nats_url` (default $NATS_URL, then nats://127.0.0.1:4222) with
        `api_key` (default: `default_api_key()`)."""
        return cls(await Bus.connect(nats_url, "sdk"), default_api_key() if api_key is None else api_key)

    async def close(self) -> None:
        await self.bus.close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def submit(self, spec: JobSpec | dict[str, Any], job_id: str = "",
                     timeout_s: float = 10.0, kind: str = "train") -> Job:
        """Submit a job. `spec` is a JobSpec or plain data (a parsed TOML file). `kind`
        "inference" asks for rollout workers only (see `infer`).

        Raises SpecError naming the field when the spec (locally or at the scheduler) is
        invalid, AuthenticationError when the API key is refused,
        nats.errors.NoRespondersError when no scheduler runs.
        """
        if isinstance(spec, dict):
            spec = spec_from_dict(spec)
        reply = await self.bus.request(S.SUBMIT, SubmitJob(spec=spec, job_id=job_id, kind=kind, api_key=self.api_key),
                                       SubmitReply, timeout_s=timeout_s)
        if not reply.ok and reply.field == "api_key":
            raise AuthenticationError(reply.error)
        if not reply.ok:
            raise SpecError(reply.field or "spec", reply.error)
        return Job(self, reply.job_id)

    def job(self, job_id: str) -> Job:
        """Attach to an existing job by id."""
        return Job(self, job_id)

    async def infer(self, *, env: str, **kw: Any):
        """Run a base model, an adapter or a job's policy on `env`; see sdk/infer.py
        `infer` for the arguments. Returns an InferResult (trajectories and summary)."""
        from opentinker.sdk.infer import infer

        return await infer(self, env=env, **kw)

    async def jobs(self) -> list[JobRecord]:
        """Every job record, newest first."""
        recs = [decode(value, JobRecord) for value, _ in (await self.bus.kv_values(S.KV_JOBS)).values()]
        return sorted(recs, key=lambda r: r.created_s, reverse=True)


class SyncClient:
    """Blocking wrappers around Client, for notebooks and scripts. Runs a private event
    loop in a daemon thread."""

    def __init__(self, nats_url: str | None = None, api_key: str | None = None):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._client: Client = self._run(Client.connect(nats_url, api_key))

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def submit(self, spec: JobSpec | dict[str, Any], job_id: str = "") -> SyncJob:
        return SyncJob(self, self._run(self._client.submit(spec, job_id)))

    def job(self, job_id: str) -> SyncJob:
        return SyncJob(self, self._client.job(job_id))

    def jobs(self) -> list[JobRecord]:
        return self._run(self._client.jobs())

    def infer(self, *, env: str, **kw: Any):
        """Blocking `Client.infer`."""
        return self._run(self._client.infer(env=env, **kw))

    def close(self) -> None:
        self._run(self._client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


class SyncJob:
    def __init__(self, sc: SyncClient, job: Job):
        self._sc = sc
        self._job = job
        self.id = job.id

    def record(self) -> JobRecord:
        return self._sc._run(self._job.record())

    def wait(self, timeout_s: float | None = None, raise_on_failure: bool = True) -> JobRecord:
        return self._sc._run(self._job.wait(timeout_s, raise_on_failure))

    def cancel(self, reason: str = "cancelled by user") -> CancelReply:
        return self._sc._run(self._job.cancel(reason))

    def metrics(self, from_start: bool = True) -> Iterator[Metrics]:
        agen = self._job.metrics(from_start)
        while True:
            try:
                yield self._sc._run(agen.__anext__())
            except StopAsyncIteration:
                return
