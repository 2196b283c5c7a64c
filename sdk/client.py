"""The client API: submit a job, follow it, cancel it, attach to it later.

    client = await Client.connect("nats://127.0.0.1:4222")
    job = await client.submit({"env": "arith", "steps": 20})
    async for m in job.metrics():
        print(m.step, m.values["reward_mean"])
    record = await job.wait()

`SyncClient` wraps the same calls for notebooks and scripts. Imports schemas and the NATS
client only (never torch or vLLM).

Two identities (services/core/natsauth.py):
- a **user** of a shared service (`api_url=` or $OPENTINKER_API_URL names its REST
  API) submits, cancels and reads records and history over the REST API, and connects
  to NATS with the API key as its token only to follow its own jobs live (a user's NATS
  connection may subscribe to its own jobs' subjects and publish nothing);
- a **service** identity ($NATS_NKEY or $NATS_CREDS: operators, tests, and the owner
  of the local `opentinker up` stack, with its service nkey) or a bare bus with no
  REST API reads records and history from JetStream directly.
The same code follows a job either way: subscribe live, read the history, drop what
both delivered.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import msgspec
import nats.errors

from opentinker.schemas import (
    CancelJob, CancelReply, JobRecord, JobSpec, JobState, JobStateChanged, Metrics, SubmitJob,
    SubmitReply, decode, encode,
)
from opentinker.schemas import subjects as S
from opentinker.schemas.control import InferencePlan
from opentinker.schemas.job import SpecError, spec_from_dict
from opentinker.services.core.bus import Bus
from opentinker.services.core.config import default_api_key  # noqa: F401  (the SDK's own, re-exported)


class AuthenticationError(PermissionError):
    """The scheduler refused the API key (missing, wrong or revoked)."""


_HISTORY = {"events": "events", "metrics": "metrics", "traj": "trajectories"}  # family -> REST route
MAX_STAGES = 16  # the longest init_from chain Job.stages() follows


class Reader:
    """Where a client reads job records and history from."""

    async def record(self, job_id: str) -> JobRecord:
        raise NotImplementedError

    async def jobs(self) -> list[JobRecord]:
        raise NotImplementedError

    async def history(self, job_id: str, family: str, kind: type) -> list:
        raise NotImplementedError

    async def close(self) -> None:
        pass


class BusReader(Reader):
    """JetStream directly (a service identity, or a bus without auth)."""

    def __init__(self, bus: Bus):
        self.bus = bus

    async def record(self, job_id: str) -> JobRecord:
        got = await self.bus.job_record(job_id)
        if got is None:
            raise KeyError(f"no job {job_id}")
        return got[0]

    async def jobs(self) -> list[JobRecord]:
        return [decode(value, JobRecord) for value, _ in (await self.bus.kv_values(S.KV_JOBS)).values()]

    async def history(self, job_id: str, family: str, kind: type) -> list:
        return await self.bus.read_subject(S.job(job_id, family), kind)


class RestReader(Reader):
    """The scheduler's REST API with an API key (a user: sees only their own jobs).
    Connection failures are retried (httpx transport retries), e.g. across a scheduler
    restart."""

    def __init__(self, api_url: str, api_key: str):
        import httpx

        self.http = httpx.AsyncClient(base_url=api_url.rstrip("/") + "/v1", timeout=30,
                                      headers={"Authorization": f"Bearer {api_key}"},
                                      transport=httpx.AsyncHTTPTransport(retries=5))

    async def _get(self, path: str, kind: Any) -> Any:
        r = await self.http.get(path)
        if r.status_code in (401, 403):
            raise AuthenticationError(r.json().get("detail", {}).get("error", r.text))
        if r.status_code == 404:
            raise KeyError(r.json().get("detail", {}).get("error", path))
        r.raise_for_status()
        return msgspec.convert(r.json(), kind)

    async def record(self, job_id: str) -> JobRecord:
        return await self._get(f"/jobs/{S.check_job_id(job_id)}", JobRecord)

    async def jobs(self) -> list[JobRecord]:
        return await self._get("/jobs", list[JobRecord])

    async def history(self, job_id: str, family: str, kind: type) -> list:
        if family not in _HISTORY:
            raise ValueError(f"no history of {family!r}")
        return await self._get(f"/jobs/{S.check_job_id(job_id)}/{_HISTORY[family]}", list[kind])

    async def submit(self, cmd: SubmitJob) -> SubmitReply:
        """POST /v1/jobs. A refusal comes back as a SubmitReply naming the field."""
        body = {"spec": msgspec.to_builtins(cmd.spec), "job_id": cmd.job_id, "kind": cmd.kind,
                "policy_of": cmd.policy_of, "plan": _plan_body(cmd.plan)}
        r = await self.http.post("/jobs", json=body)
        if r.status_code == 201:
            got = r.json()
            return SubmitReply(ok=True, job_id=got["job_id"], endpoint_token=got.get("endpoint_token", ""))
        detail = _detail(r)
        field = "api_key" if r.status_code == 401 else str(detail.get("field", "")).removeprefix("spec.")
        return SubmitReply(ok=False, error=str(detail.get("error", r.text)), field=field)

    async def cancel(self, job_id: str, reason: str, action: str = "cancel") -> CancelReply:
        """POST /v1/jobs/{id}/cancel (or /complete, an inference job's end)."""
        body = {"reason": reason[:500]} if action == "cancel" else None
        r = await self.http.post(f"/jobs/{S.check_job_id(job_id)}/{action}", json=body)
        if r.status_code == 200:
            return CancelReply(ok=True, state=r.json().get("state", ""))
        if r.status_code == 401:
            raise AuthenticationError(_detail(r).get("error", r.text))
        return CancelReply(ok=False, error=str(_detail(r).get("error", r.text)))

    async def close(self) -> None:
        await self.http.aclose()


def _plan_body(plan: InferencePlan | None) -> dict[str, Any] | None:
    """An InferencePlan as the REST API takes it (the scheduler sets its policy version)."""
    if plan is None:
        return None
    return {k: v for k, v in msgspec.to_builtins(plan).items() if k not in ("schema_version", "policy_version")}


def _detail(r) -> dict[str, Any]:
    """The `detail` of a REST error answer ({"error", "field"}), or {} if it has none."""
    try:
        d = r.json().get("detail", {})
    except ValueError:
        return {}
    return d if isinstance(d, dict) else {"error": str(d)}


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
        """The scheduler's record. Raises KeyError if the job does not exist (or is not
        yours)."""
        return await self.client.reader.record(self.id)

    async def _follow(self, family: str, kind: type, from_start: bool) -> AsyncIterator:
        """The job's `family` messages: its history (when `from_start`), then live ones,
        each once. Subscribes before reading the history, so nothing falls between."""
        q: asyncio.Queue = asyncio.Queue()
        nc = await self.client._live_nc(self.id)
        sub = await nc.subscribe(S.job(self.id, family), cb=q.put)
        try:
            await nc.flush()
            seen: set[bytes] = set()
            if from_start:
                for m in await self.client.reader.history(self.id, family, kind):
                    seen.add(encode(m))
                    yield m
            while True:
                raw = (await q.get()).data
                if raw in seen:
                    continue
                try:
                    yield decode(raw, kind)
                except msgspec.MsgspecError:
                    continue
        finally:
            with contextlib.suppress(nats.errors.Error):  # the connection may be closed
                await sub.unsubscribe()

    async def stages(self, limit: int = MAX_STAGES) -> list[str]:
        """The job ids of this job's pipeline, first stage first: the chain of `init_from`
        back from this job (`opentinker train sft.toml grpo.toml` submits each stage with
        `init_from` the one before), at most `limit` long. A stage whose record is gone
        (the scheduler's retention) ends the chain there. Raises KeyError when this job
        does not exist (or is not yours)."""
        chain = [self.id]
        while len(chain) < limit:
            try:
                rec = await self.client.reader.record(chain[0])
            except KeyError:
                if len(chain) == 1:
                    raise
                break
            if not rec.spec.init_from or rec.spec.init_from in chain:
                break
            chain.insert(0, rec.spec.init_from)
        return chain

    async def pipeline_metrics(self) -> list[Metrics]:
        """The metrics history of every stage of this job's pipeline (stages()), first
        stage first, each record naming its job (`Metrics.job_id`): an SFT stage's loss
        steps, then the RL stage's. Raises KeyError as stages() does."""
        out: list[Metrics] = []
        for job_id in await self.stages():
            out += await self.client.reader.history(job_id, "metrics", Metrics)
        return out

    async def events(self, from_start: bool = True) -> AsyncIterator[JobStateChanged]:
        """Every state change of the job, ending after a terminal one."""
        async for ev in self._follow("events", JobStateChanged, from_start):
            yield ev
            if ev.state.terminal:
                return

    async def metrics(self, from_start: bool = True, until_done: bool = True) -> AsyncIterator[Metrics]:
        """Metrics as the learner publishes them (from step 0 by default). With
        `until_done`, the iterator ends once the job is terminal and what was published
        before the end has arrived."""
        stream = self._follow("metrics", Metrics, from_start).__aiter__()
        done = asyncio.ensure_future(self._terminal()) if until_done else None
        get = None
        try:
            while done is None or not done.done():
                get = asyncio.ensure_future(stream.__anext__())
                await asyncio.wait({get} | ({done} if done else set()), return_when=asyncio.FIRST_COMPLETED)
                if get.done():
                    yield get.result()
                    get = None
            while True:  # the job is over: drain, then stop
                if get is None:
                    get = asyncio.ensure_future(stream.__anext__())
                try:
                    m = await asyncio.wait_for(asyncio.shield(get), 1.0)
                except asyncio.TimeoutError:
                    return
                get = None
                yield m
        finally:
            if done:
                done.cancel()
            if get is not None:
                get.cancel()
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                    await get
            await stream.aclose()

    async def _terminal(self, poll_s: float = 2.0) -> JobRecord:
        """The record once the job is terminal. Follows the live events, and reads the
        record every `poll_s` as well (a live event can be missed across a reconnect)."""
        events = self.events(from_start=False).__aiter__()
        nxt = None
        try:
            while True:
                rec = await self.record()
                if rec.state.terminal:
                    return rec
                if nxt is not None and nxt.done() and isinstance(nxt.exception(), StopAsyncIteration):
                    await asyncio.sleep(0.1)  # a terminal event came: the record follows soon
                    continue
                if nxt is None or nxt.done():
                    nxt = asyncio.ensure_future(events.__anext__())
                await asyncio.wait({nxt}, timeout=poll_s)
        finally:
            if nxt is not None:
                nxt.cancel()
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                    await nxt
            await events.aclose()

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
        """Ask the scheduler to cancel (over the REST API as a user). Raises
        nats.errors.NoRespondersError if no scheduler runs."""
        if isinstance(self.client.reader, RestReader):
            return await self.client.reader.cancel(self.id, reason)
        return await self.client.bus.request(
            S.CANCEL, CancelJob(job_id=self.id, reason=reason, api_key=self.client.api_key), CancelReply)


    async def complete(self, reason: str = "completed by its client") -> CancelReply:
        """End an inference job as completed (a user: POST /v1/jobs/{id}/complete; a
        service: its completion event, as the inference client reports it)."""
        if isinstance(self.client.reader, RestReader):
            return await self.client.reader.cancel(self.id, reason, action="complete")
        rec = await self.record()
        await self.client.bus.publish(S.job(self.id, "events"), JobStateChanged(
            job_id=self.id, state=JobState.COMPLETED, reason=reason, time_s=time.time(), source="sdk",
            attempt=rec.attempt))
        return CancelReply(ok=True, state=JobState.COMPLETED.value)


def _spec(spec: JobSpec | dict[str, Any], kind: str = "train") -> JobSpec:
    return spec_from_dict(spec, kind) if isinstance(spec, dict) else spec


class InferenceEndpoint:
    """A placed inference job's OpenAI-compatible endpoint:
    `openai.OpenAI(base_url=ep.url, api_key=ep.token)`, model `ep.model`."""

    def __init__(self, job: Job, url: str, token: str, model: str):
        self.job = job
        self.id = job.id
        self.url = url
        self.token = token
        self.model = model

    def __repr__(self) -> str:
        return f"InferenceEndpoint({self.id!r}, url={self.url!r})"

    async def cancel(self, reason: str = "done serving") -> CancelReply:
        return await self.job.cancel(reason)


class Client:
    """An OpenTinker client over one NATS connection (and the REST API, as a user)."""

    def __init__(self, bus: Bus, api_key: str = "", reader: Reader | None = None,
                 connect_live: Callable[[], Awaitable[Bus]] | None = None, pool: str = ""):
        self.bus = bus
        self.api_key = api_key
        self.pool = pool  # "" : a bus submit goes to any pool's scheduler (subjects.submit_subject)
        self.reader = reader or BusReader(bus)
        self._connect_live = connect_live
        self._live: dict[str, Bus] = {}

    @classmethod
    async def connect(cls, nats_url: str | None = None, api_key: str | None = None,
                      api_url: str | None = None, pool: str | None = None) -> Client:
        """Connect to `nats_url` (default $NATS_URL, then nats://127.0.0.1:4222) with
        `api_key` (default: `default_api_key()`). The identity (module docstring): a
        service with $NATS_NKEY/$NATS_CREDS or on this machine's own stack (`opentinker
        up`); else a user when `api_url` (default $OPENTINKER_API_URL) names the REST
        API; else a bare bus. `pool` (default $OPENTINKER_POOL, the services' own setting)
        is the worker pool a bus submit goes to; "" or unset: any pool's scheduler (one
        pool: the same). A user's submits go to the REST API, whose scheduler's pool it
        is. Raises nats.errors.Error ('Authorization Violation') when the server refuses
        the key, AuthenticationError with no key, ValueError for a pool that is not a
        subject token."""
        import os

        from opentinker.services.core.config import default_nats_url, service_credentials

        key = default_api_key() if api_key is None else api_key
        url = default_nats_url(nats_url)
        api_url = api_url if api_url is not None else os.environ.get("OPENTINKER_API_URL", "")
        pool = os.environ.get("OPENTINKER_POOL", "") if pool is None else pool
        S.submit_subject(pool)  # a bad pool fails here, before connecting
        if service_credentials(url) or not api_url:
            # a service (Bus.connect uses those credentials), or a bus without the REST
            # API: records and history straight from JetStream
            return cls(await Bus.connect(url, "sdk"), key, pool=pool)
        if not key:
            raise AuthenticationError("no API key: pass api_key=, set OPENTINKER_API_KEY or OPENTINKER_API_KEY_FILE")

        def user_bus() -> Awaitable[Bus]:
            return Bus.connect(url, "sdk", token=key)

        return cls(await user_bus(), key, RestReader(api_url, key), user_bus)

    @property
    def is_user(self) -> bool:
        """Connected as an API-key user (only its own jobs' subjects, no JetStream)."""
        return self._connect_live is not None

    async def _live_nc(self, job_id: str):
        """A NATS connection that may subscribe to `job_id`'s subjects. A user's grant is
        made when a connection opens, so a job submitted after that gets its own."""
        if self._connect_live is None:
            return self.bus.nc
        if job_id not in self._live:
            self._live[job_id] = await self._connect_live()
        return self._live[job_id].nc

    async def close(self) -> None:
        for bus in self._live.values():
            await bus.close()
        self._live.clear()
        await self.reader.close()
        await self.bus.close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def submit(self, spec: JobSpec | dict[str, Any], job_id: str = "",
                     timeout_s: float = 10.0, kind: str = "train", policy_of: str = "",
                     plan: InferencePlan | None = None) -> Job:
        """Submit a job. `spec` is a JobSpec or plain data (a parsed TOML file). `kind`
        "inference" asks for rollout workers only (see `infer`, `submit_inference_job`);
        with `policy_of` it runs that train job's newest policy as its version 1, with
        `plan` the scheduler asks its workers for the plan's episodes.

        Raises SpecError naming the field when the spec (locally or at the scheduler) is
        invalid, AuthenticationError when the API key is refused,
        nats.errors.NoRespondersError when no scheduler (of the client's `pool`) runs.
        """
        cmd = SubmitJob(spec=_spec(spec, kind), job_id=job_id, kind=kind, policy_of=policy_of, plan=plan)
        return (await self._submit(cmd, timeout_s))[0]

    async def _submit(self, cmd: SubmitJob, timeout_s: float) -> tuple[Job, SubmitReply]:
        if isinstance(self.reader, RestReader):
            reply = await self.reader.submit(cmd)
        else:
            cmd = msgspec.structs.replace(cmd, api_key=self.api_key)
            reply = await self.bus.request(S.submit_subject(self.pool), cmd, SubmitReply, timeout_s=timeout_s)
        if not reply.ok and reply.field == "api_key":
            raise AuthenticationError(reply.error)
        if not reply.ok:
            raise SpecError(reply.field or "spec", reply.error)
        return Job(self, reply.job_id), reply

    async def submit_inference_job(self, model: str = "smollm2-135m-instruct", policy_of: str = "",
                                   engine: str = "auto", job_id: str = "",
                                   timeout_s: float = 300.0) -> InferenceEndpoint:
        """Run `model` (or, with `policy_of`, that train job's newest policy) as an
        inference job: the scheduler places it on a rollout worker, which serves an
        OpenAI-compatible API for it. Returns once placed, with the base URL and bearer
        token for any OpenAI client; `cancel()` the job to stop serving.

        Raises SpecError naming the field (e.g. `policy_of`: no such job, or no weights
        yet), AuthenticationError, asyncio.TimeoutError when no rollout worker serves it
        within `timeout_s`.
        """
        spec = JobSpec(name="serve", model=model, engine=engine)
        job, reply = await self._submit(SubmitJob(spec=spec, job_id=job_id, kind="inference",
                                                  policy_of=policy_of), 10.0)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            rec = await job.record()
            if rec.state.terminal:
                raise JobFailed(rec)
            if rec.endpoint:
                return InferenceEndpoint(job, rec.endpoint, reply.endpoint_token, rec.spec.model)
            if loop.time() > deadline:
                await job.cancel("no rollout worker served it in time")
                raise asyncio.TimeoutError(f"inference job {job.id} not served within {timeout_s}s")
            await asyncio.sleep(0.3)

    def job(self, job_id: str) -> Job:
        """Attach to an existing job by id."""
        return Job(self, job_id)

    async def infer(self, *, env: str, **kw: Any):
        """Run a base model, an adapter or a job's policy on `env`; see sdk/infer.py
        `infer` for the arguments. Returns an InferResult (trajectories and summary)."""
        from opentinker.sdk.infer import infer

        return await infer(self, env=env, **kw)

    async def jobs(self) -> list[JobRecord]:
        """Every job record you may see (all of them for an admin or a service), newest
        first."""
        return sorted(await self.reader.jobs(), key=lambda r: r.created_s, reverse=True)


class SyncClient:
    """Blocking wrappers around Client, for notebooks and scripts. Runs a private event
    loop in a daemon thread."""

    def __init__(self, nats_url: str | None = None, api_key: str | None = None, pool: str | None = None):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._client: Client = self._run(Client.connect(nats_url, api_key, pool=pool))

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def submit(self, spec: JobSpec | dict[str, Any], job_id: str = "") -> SyncJob:
        return SyncJob(self, self._run(self._client.submit(spec, job_id)))

    def job(self, job_id: str) -> SyncJob:
        return SyncJob(self, self._client.job(job_id))

    def jobs(self) -> list[JobRecord]:
        return self._run(self._client.jobs())

    def submit_inference_job(self, **kw: Any) -> InferenceEndpoint:
        """Blocking `Client.submit_inference_job` (cancel with `.job` via `job(id)`)."""
        return self._run(self._client.submit_inference_job(**kw))

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

    def stages(self) -> list[str]:
        return self._sc._run(self._job.stages())

    def pipeline_metrics(self) -> list[Metrics]:
        return self._sc._run(self._job.pipeline_metrics())

    def metrics(self, from_start: bool = True) -> Iterator[Metrics]:
        agen = self._job.metrics(from_start)
        while True:
            try:
                yield self._sc._run(agen.__anext__())
            except StopAsyncIteration:
                return
