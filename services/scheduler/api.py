"""The REST API and web dashboard, served by the scheduler process (FastAPI + uvicorn
in the scheduler's event loop).

Every /v1 route except /v1/health needs `Authorization: Bearer <API key>` (core/users.py).
A user sees and acts on their own jobs only (an admin on every job); another user's job
answers 404, as a job that does not exist. Errors are JSON `{"detail": {"error": ...,
"field": ...}}` with 401 (no valid key), 403 (not allowed), 404, 409 (conflict) or 422
(the field that is wrong). The OpenAPI spec is at /openapi.json, the docs at /docs, the
dashboard at /.

Routes: GET /v1/health; POST/GET /v1/jobs; GET /v1/jobs/{id}; POST
/v1/jobs/{id}/cancel, /complete (inference); GET /v1/jobs/{id}/metrics, /events,
/trajectories; GET /v1/workers; GET /v1/me;
POST/GET /v1/users (admin); POST/GET /v1/users/{name}/keys; DELETE /v1/keys/{key_id}.
"""

import time
from pathlib import Path as FsPath
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
from fastapi import Depends, FastAPI, HTTPException, Path, Query
from fastapi.responses import FileResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field

from opentinker.schemas import JobSpec, JobState, Metrics, SubmitJob, Trajectory
from opentinker.schemas.control import InferencePlan
from opentinker.schemas.control import JobStateChanged
from opentinker.schemas import subjects as S
from opentinker.schemas.job import JOB_ID_RE, SpecError, spec_from_dict
from opentinker.schemas.users import User
from opentinker.services.core.http import serve_http
from opentinker.services.core.pool import live_workers
from opentinker.services.scheduler.placement import current_load, holders
from opentinker.services.core.users import USER_RE, AuthError, UserError

if TYPE_CHECKING:
    from opentinker.services.scheduler.service import Scheduler

STATIC = FsPath(__file__).parent / "static"
SPEC_FIELDS = {f.name for f in msgspec.structs.fields(JobSpec)}
JobId = Annotated[str, Path(pattern=JOB_ID_RE.pattern, description="a job id ([a-z0-9-])")]
UserName = Annotated[str, Path(pattern=USER_RE.pattern)]
KeyId = Annotated[str, Path(pattern=r"^[0-9a-f]{16}$")]


class SamplingBody(BaseModel):
    """SamplingParams (schemas/job.py), as the REST API's schema states it."""

    model_config = ConfigDict(extra="forbid")
    temperature: float = Field(1.0, ge=0, le=10)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, le=1_000_000)
    max_new_tokens: int = Field(32, ge=1, le=32_768)
    max_total_tokens: int = Field(1024, ge=2, le=131_072)
    max_turns: int = Field(1, ge=1, le=1024)


class PlanBody(BaseModel):
    """InferencePlan (schemas/control.py): the episodes an inference job runs."""

    model_config = ConfigDict(extra="forbid")
    episodes: int = Field(32, ge=1, le=4096)
    group_size: int = Field(1, ge=1, le=256)
    split: str = Field("test", pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$")
    seed: int = Field(0, ge=0, le=2**31 - 1)
    sampling: SamplingBody = Field(default_factory=SamplingBody)
    agents: int = Field(1, ge=1, le=8)


class SubmitBody(BaseModel):
    """A job to run: `spec` is a JobSpec (see schemas/job.py; unknown fields refused)."""

    spec: dict[str, Any] = Field(default_factory=dict)
    job_id: str = Field("", pattern=r"^$|" + JOB_ID_RE.pattern)
    kind: Literal["train", "inference"] = "train"
    policy_of: str = Field("", pattern=r"^$|" + JOB_ID_RE.pattern,
                           description="inference: serve this train job's latest policy")
    plan: PlanBody | None = Field(None, description="inference: the episodes to run; the scheduler asks the "
                                                    "placed workers for them")


class CancelBody(BaseModel):
    reason: str = Field("cancelled by user", max_length=500)


class UserBody(BaseModel):
    name: str = Field(pattern=USER_RE.pattern)
    role: Literal["admin", "user"] = "user"
    max_jobs: int = Field(0, ge=0, le=10_000, description="jobs placed at once (0: the default)")
    max_workers: int = Field(0, ge=0, le=100_000, description="workers held at once (0: the default)")


class KeyBody(BaseModel):
    label: str = Field("", max_length=200)


def problem(status: int, error: str, field: str = "") -> HTTPException:
    detail = {"error": error, **({"field": field} if field else {})}
    return HTTPException(status, detail=detail, headers={"WWW-Authenticate": "Bearer"} if status == 401 else None)


def as_json(obj: Any) -> Any:
    return msgspec.to_builtins(obj)


def make_app(sched: "Scheduler") -> FastAPI:
    """The FastAPI app over a running Scheduler (its bus, users and records)."""
    app = FastAPI(title="OpenTinker", version="0.1.0",
                  description="Agentic RL for LLMs as a service: jobs, workers, users and keys.")
    bearer = HTTPBearer(auto_error=False, description="an OpenTinker API key")

    async def current_user(cred: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> User:
        try:
            return await sched.users.authenticate(cred.credentials if cred else None)
        except AuthError as e:
            raise problem(e.status, e.reason) from None

    async def admin_user(user: Annotated[User, Depends(current_user)]) -> User:
        if user.role != "admin":
            raise problem(403, f"user {user.name!r} is not an admin")
        return user

    Current = Annotated[User, Depends(current_user)]
    Admin = Annotated[User, Depends(admin_user)]

    async def own_job(job_id: str, user: User):
        from opentinker.services.scheduler.service import visible

        got = await sched.record(job_id)
        if got is None or not visible(got[0], user):
            raise problem(404, f"no job {job_id}", "job_id")
        return got[0]

    def self_or_admin(name: str, user: User) -> None:
        if user.role != "admin" and user.name != name:
            raise problem(403, f"user {user.name!r} may not manage user {name!r}")

    @app.get("/v1/health", tags=["service"])
    async def health() -> dict[str, Any]:
        """Liveness: the scheduler runs and is connected to NATS. No key needed."""
        return {"status": "ok", "pool": sched.pool, "nats_connected": sched.bus.nc.is_connected}

    @app.post("/v1/jobs", status_code=201, tags=["jobs"])
    async def submit(body: SubmitBody, user: Current) -> dict[str, Any]:
        """Submit a job; it is queued and placed on the pool. 422 names the bad field.
        An inference job answers with `endpoint_token`, the bearer token of the
        OpenAI-compatible endpoint its rollout worker serves (`endpoint` in its record
        once placed)."""
        try:
            spec = spec_from_dict(body.spec, body.kind)
        except SpecError as e:
            raise problem(422, str(e), f"spec.{e.field}") from None
        try:
            plan = msgspec.convert(body.plan.model_dump(), InferencePlan) if body.plan is not None else None
        except msgspec.ValidationError as e:
            raise problem(422, f"plan: {e}", "plan") from None
        reply = await sched.submit(SubmitJob(spec=spec, job_id=body.job_id, kind=body.kind,
                                             policy_of=body.policy_of, plan=plan), user)
        if not reply.ok:
            if reply.field.split(".")[0] in SPEC_FIELDS:  # a spec the scheduler refused (a path, say)
                raise problem(422, reply.error, f"spec.{reply.field}")
            raise problem(404 if reply.error.startswith("no job") else 409, reply.error, reply.field)
        # an inference job's endpoint token is shown here only (the record keeps its hash)
        return {"job_id": reply.job_id, **({"endpoint_token": reply.endpoint_token} if reply.endpoint_token else {})}

    @app.get("/v1/jobs", tags=["jobs"])
    async def list_jobs(user: Current, state: Annotated[JobState | None, Query()] = None) -> list[dict[str, Any]]:
        """Your jobs (every job, for an admin), newest first."""
        from opentinker.services.scheduler.service import visible

        recs = [r for r, _ in await sched.records() if visible(r, user) and (state is None or r.state == state)]
        return [as_json(r) for r in sorted(recs, key=lambda r: r.created_s, reverse=True)]

    @app.get("/v1/jobs/{job_id}", tags=["jobs"])
    async def get_job(job_id: JobId, user: Current) -> dict[str, Any]:
        return as_json(await own_job(job_id, user))

    @app.post("/v1/jobs/{job_id}/cancel", tags=["jobs"])
    async def cancel_job(job_id: JobId, user: Current, body: CancelBody | None = None) -> dict[str, Any]:
        await own_job(job_id, user)
        reply = await sched.cancel(job_id, (body or CancelBody()).reason, user)
        if not reply.ok:
            raise problem(409, reply.error, "job_id")
        return {"job_id": job_id, "state": reply.state}

    @app.post("/v1/jobs/{job_id}/complete", tags=["jobs"])
    async def complete_job(job_id: JobId, user: Current) -> dict[str, Any]:
        """End an inference job as completed (its client has what it asked for; its
        rollout workers are free again). A train job completes when its learner ends it."""
        rec = await own_job(job_id, user)
        if rec.kind != "inference":
            raise problem(409, f"job {job_id} is a train job: it completes when its learner has run its "
                               "steps (cancel it to stop it)", "job_id")
        reply = await sched.complete(job_id, user)
        if not reply.ok:
            raise problem(409, reply.error, "job_id")
        return {"job_id": job_id, "state": reply.state}

    @app.get("/v1/jobs/{job_id}/trajectories", tags=["jobs"])
    async def job_trajectories(job_id: JobId, user: Current,
                               limit: Annotated[int, Query(ge=1, le=10_000)] = 1_000) -> list[dict[str, Any]]:
        """The job's episodes (Trajectory: token ids, loss mask, logprobs, turns,
        reward), oldest first, at most `limit`."""
        await own_job(job_id, user)
        return [as_json(t) for t in await sched.bus.read_subject(S.job(job_id, "traj"), Trajectory, limit)]

    @app.get("/v1/jobs/{job_id}/metrics", tags=["jobs"])
    async def job_metrics(job_id: JobId, user: Current,
                          split: Annotated[Literal["train", "eval"] | None, Query()] = None,
                          limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000) -> list[dict[str, Any]]:
        """The job's metrics (one per training step, one per evaluation), oldest first."""
        await own_job(job_id, user)
        got = await sched.bus.read_subject(S.job(job_id, "metrics"), Metrics, limit)
        return [as_json(m) for m in got if split is None or m.split == split]

    @app.get("/v1/jobs/{job_id}/events", tags=["jobs"])
    async def job_events(job_id: JobId, user: Current,
                         limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000) -> list[dict[str, Any]]:
        """The job's state changes (its log), oldest first."""
        await own_job(job_id, user)
        got = await sched.bus.read_subject(S.job(job_id, "events"), JobStateChanged, limit)
        return [as_json(e) for e in got]

    @app.get("/v1/workers", tags=["workers"])
    async def workers(user: Current) -> list[dict[str, Any]]:
        """The pool's live workers, each with its load and the jobs placed on it: your
        own jobs only (every job for an admin); other tenants' job ids are not shown."""
        from opentinker.services.scheduler.service import visible

        live = await live_workers(sched.bus, sched.pool)
        active = [r for r, _ in await sched.records() if not r.state.terminal and r.placement is not None]
        load = current_load(active)
        placed: dict[str, list[str]] = {}
        for r in active:
            for w in holders(r):
                if visible(r, user):
                    placed.setdefault(w, []).append(r.job_id)
        now = time.time()
        return [{**as_json(info),
                 "jobs": info.jobs if user.role == "admin" else [j for j in info.jobs if j in placed.get(w, [])],
                 "placed_jobs": placed.get(w, []),
                 "load": ((load.learners[w] if info.kind == "learner" else load.rollout[w])
                          / max(1, info.capacity.slots)),
                 "heartbeat_age_s": round(now - info.time_s, 2)}
                for w, info in sorted(live.items())]

    @app.get("/v1/me", tags=["users"])
    async def me(user: Current) -> dict[str, Any]:
        return as_json(user)

    @app.post("/v1/users", status_code=201, tags=["users"])
    async def create_user(body: UserBody, _admin: Admin) -> dict[str, Any]:
        try:
            return as_json(await sched.users.create_user(body.name, body.role, body.max_jobs, body.max_workers))
        except UserError as e:
            raise problem(e.status, str(e), e.field) from None

    @app.get("/v1/users", tags=["users"])
    async def list_users(_admin: Admin) -> list[dict[str, Any]]:
        return [as_json(u) for u in await sched.users.users()]

    @app.post("/v1/users/{name}/keys", status_code=201, tags=["users"])
    async def create_key(name: UserName, user: Current, body: KeyBody | None = None) -> dict[str, Any]:
        """A new API key for user `name` (yourself, or anyone for an admin). The key is
        in this answer only; the server keeps its argon2 hash."""
        self_or_admin(name, user)
        try:
            rec, key = await sched.users.create_key(name, (body or KeyBody()).label)
        except UserError as e:
            raise problem(e.status, str(e), e.field) from None
        return {"key_id": rec.key_id, "user": rec.user, "label": rec.label, "key": key}

    @app.get("/v1/users/{name}/keys", tags=["users"])
    async def list_keys(name: UserName, user: Current) -> list[dict[str, Any]]:
        self_or_admin(name, user)
        return [{k: v for k, v in as_json(r).items() if k != "hash"} for r in await sched.users.keys(name)]

    @app.delete("/v1/keys/{key_id}", tags=["users"])
    async def revoke_key(key_id: KeyId, user: Current) -> dict[str, Any]:
        """Revoke a key (your own, or anyone's for an admin)."""
        rec = await sched.users.key(key_id)
        if rec is None or (user.role != "admin" and rec.user != user.name):
            raise problem(404, f"no key {key_id}", "key_id")
        rec = await sched.revoke_key(key_id)  # its live NATS connections are closed too
        return {"key_id": rec.key_id, "revoked_s": rec.revoked_s}

    @app.get("/", include_in_schema=False)
    async def dashboard() -> FileResponse:
        return FileResponse(STATIC / "dashboard.html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


async def serve_api(sched: "Scheduler", host: str, port: int, fd: int = -1):
    """Start the API on host:port, or on the inherited listening socket `fd`, in this
    event loop (core/http.py). Raises OSError if the port cannot be bound."""
    return await serve_http(make_app(sched), host, port, fd)
