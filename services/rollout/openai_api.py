"""The OpenAI-compatible endpoint a rollout worker serves for its inference jobs.

Per job, under the base URL the scheduler records as `JobRecord.endpoint`
(`<serve_url>/jobs/<job_id>/v1`), the routes of OpenAI's API that an OpenAI client uses:

    GET  .../models              the job's model
    POST .../chat/completions    messages rendered with the model's chat template
    POST .../completions         a text prompt (or token ids)

- **Auth:** `Authorization: Bearer <endpoint token>`, the token that submitting the job
  answered with. The record keeps its SHA-256, compared in constant time.
- **Which jobs:** an inference job placed on this worker and not finished; any other
  job answers 404.
- **Policy:** generation runs on this worker's engine with the job's policy: the base
  model, or the trained job's newest weights when it was submitted with `policy_of`.
  It holds the engine slot's lock, so a rollout of another job never swaps weights in
  the middle.
- **Scope:** no streaming and n = 1; other requests get 422. `seed` is served: the
  same request with the same seed on the same policy version returns the same
  completion (the engine's per-request seed).
- **Errors:** OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`.
  `system_fingerprint` names the policy version served, e.g. "opentinker-v1".
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import time
import uuid
from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from opentinker.schemas import JobRecord, SamplingParams
from opentinker.schemas.job import JOB_ID_RE
from opentinker.schemas.stats import derived_seed
from opentinker.services.rollout.chat import ChatRenderer
from opentinker.services.rollout.sampling import out_of_vocab

if TYPE_CHECKING:
    from opentinker.services.rollout.service import RolloutWorker

MAX_TOKENS_DEFAULT = 256


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class ChatRequest(BaseModel):
    model: str = ""
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    stream: bool = False
    seed: int | None = Field(None, ge=-(2**63), lt=2**63, description=(
        "the same request with the same seed on the same policy version returns the same completion"))


class CompletionRequest(BaseModel):
    model: str = ""
    prompt: str | list[int]
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    stream: bool = False
    seed: int | None = Field(None, ge=-(2**63), lt=2**63, description=(
        "the same request with the same seed on the same policy version returns the same completion"))


def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = {401: "authentication_error", 404: "not_found_error"}.get(status, "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers={"WWW-Authenticate": "Bearer"} if status == 401 else None)


def make_app(worker: RolloutWorker) -> FastAPI:
    """The endpoint over a running RolloutWorker (its bus, engines and policies)."""
    app = FastAPI(title="OpenTinker inference", version="0.1.0", docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def api_error(_req: Request, e: ApiError) -> JSONResponse:
        return _error(e.status, e.message, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def bad_request(_req: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        loc = ".".join(str(x) for x in first.get("loc", [])[1:])
        return _error(422, f"`{loc}`: {first.get('msg', 'invalid')}", loc or None)

    async def authorized(job_id: str, request: Request) -> JobRecord:
        got = await worker.bus.job_record(job_id) if JOB_ID_RE.match(job_id) else None
        rec = got[0] if got else None
        if (rec is None or rec.kind != "inference" or rec.placement is None
                or worker.worker not in rec.placement.rollout):
            raise ApiError(404, f"no inference job {job_id} on this worker", code="job_not_found")
        if rec.state.terminal:
            raise ApiError(404, f"job {job_id} is {rec.state.value}", code="job_finished")
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise ApiError(401, "missing endpoint token: send `Authorization: Bearer <token>`")
        if not hmac.compare_digest(hashlib.sha256(token.encode()).hexdigest(), rec.endpoint_token_sha256):
            raise ApiError(401, f"wrong endpoint token for job {job_id}")
        return rec

    async def generate(rec: JobRecord, prompt_of: Any, sampling: SamplingParams,
                       seed: int | None) -> tuple[Any, list[int], int, Any]:
        try:
            slot = await worker.engine_for_model(rec.spec.model, rec.spec.engine, rec.spec.sampler_dtype,
                                                 rec.spec.dtype)
        except (OSError, ValueError, RuntimeError, ImportError) as e:
            raise ApiError(503, f"cannot load model {rec.spec.model!r}: {e}") from None
        ids = prompt_of(slot.engine.tokenizer)
        why = out_of_vocab(ids, slot.engine.tokenizer)
        if why:
            raise ApiError(400, why, "prompt")
        loop = asyncio.get_running_loop()
        async with slot.lock:
            version = await worker.policies.ensure_policy(slot, rec.job_id, 0)
            try:
                # the engine's seed a function of the caller's: any 64-bit value maps into
                # [0, 2**31) (vLLM reads a seed of -1 as none)
                seeds = [None if seed is None else derived_seed("openai", seed)]
                out = (await loop.run_in_executor(slot.executor, functools.partial(
                    slot.engine.generate, [ids], sampling, seeds=seeds)))[0]
            except ValueError as e:  # a prompt that leaves no room
                raise ApiError(422, str(e), "messages") from None
        return slot, ids, version, out

    def _sampling(temperature: float, top_p: float, max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_tokens,
                              max_total_tokens=max_tokens)

    def _usage(ids: list[int], out: Any) -> dict[str, int]:
        return {"prompt_tokens": len(ids), "completion_tokens": len(out.token_ids),
                "total_tokens": len(ids) + len(out.token_ids)}

    @app.get("/jobs/{job_id}/v1/models")
    async def models(job_id: str, request: Request) -> dict[str, Any]:
        rec = await authorized(job_id, request)
        return {"object": "list", "data": [{"id": rec.spec.model, "object": "model", "created": int(rec.created_s),
                                            "owned_by": rec.user or "opentinker"}]}

    @app.post("/jobs/{job_id}/v1/chat/completions")
    async def chat(job_id: str, body: ChatRequest, request: Request) -> dict[str, Any]:
        rec = await authorized(job_id, request)
        if body.stream:
            raise ApiError(422, "streaming is not supported", "stream")
        messages = [m.model_dump() for m in body.messages]
        n = body.max_completion_tokens or body.max_tokens or MAX_TOKENS_DEFAULT
        slot, ids, version, out = await generate(
            rec, lambda tok: ChatRenderer(tok).prompt_ids(messages), _sampling(body.temperature, body.top_p, n),
            body.seed)
        text = slot.engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": rec.spec.model, "system_fingerprint": f"opentinker-v{version}",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": out.finish_reason, "logprobs": None}],
                "usage": _usage(ids, out)}

    @app.post("/jobs/{job_id}/v1/completions")
    async def completions(job_id: str, body: CompletionRequest, request: Request) -> dict[str, Any]:
        rec = await authorized(job_id, request)
        if body.stream:
            raise ApiError(422, "streaming is not supported", "stream")

        def prompt_of(tok: Any) -> list[int]:
            if isinstance(body.prompt, list):
                return list(body.prompt)
            return list(tok(body.prompt)["input_ids"])

        slot, ids, version, out = await generate(rec, prompt_of,
                                                 _sampling(body.temperature, body.top_p, body.max_tokens), body.seed)
        text = slot.engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": rec.spec.model, "system_fingerprint": f"opentinker-v{version}",
                "choices": [{"index": 0, "text": text, "finish_reason": out.finish_reason, "logprobs": None}],
                "usage": _usage(ids, out)}

    return app

