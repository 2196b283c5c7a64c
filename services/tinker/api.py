"""The HTTP routes of the Tinker API (`/api/v1/...`), as the official `tinker` SDK calls
them: JSON bodies, a protobuf forward_backward body, futures answered by
`retrieve_future` (long-polled). Every route but healthz needs `X-API-Key`: the
SDK insists on a `tml-` prefix, so a key is `tml-<OpenTinker API key>` (the prefix is
dropped, the rest checked against the stored argon2 hashes, core/users.py).

A refusal the SDK must not retry is a 4xx with a JSON body (`{"detail": ...}`); an
operation that fails once queued is a failed future (`{"error", "category"}`).
The REST client's reads (runs.py): training runs (`GET /training_runs`, `.../{id}`),
their checkpoints (`GET /training_runs/{id}/checkpoints`, `GET /checkpoints`,
`DELETE /training_runs/{id}/checkpoints/{checkpoint_id}`) and `POST /weights_info`;
another user's run answers 404.
A model's operation that cannot be taken once its seq_id is known (image inputs, a
bad save name, ttl_seconds or user_metadata, stable_reinforce provenance that does not
check out, an optimizer other than Adam) fails its own future, naming the field, in
its place in the model's order; anything else refused is a 400 naming it (target prompt
logprobs, prompt alternative tokens, `stop=[]`, a run list's `project_id`, a session's or model's bad
user_metadata). Not served (404, no route): the REST client's publishing, copies,
external weights, whoami.
"""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from opentinker.schemas.tinker import (MAX_TOPK_ENTRIES, MAX_TOPK_LOGPROBS, AdamParams, TinkerOp, TinkerSample,
                                       overwrite_refused)
from opentinker.services.core.models import DEFAULT_MODEL
from opentinker.services.core.users import AuthError
from opentinker.services.tinker import wire
from opentinker.services.tinker.runs import Runs, check_scope, object_of_checkpoint, page
from opentinker.services.tinker.sessions import ApiError, Gateway

PROTOBUF = "application/x-protobuf"
MAX_BODY_BYTES = 8 * 1024 * 1024


class _Body(msgspec.Struct, kw_only=True):
    pass


class CreateSessionBody(_Body):
    tags: list[str] = []
    user_metadata: Any = None  # checked: wire.check_metadata
    project_id: str | None = None
    display_name: Any = None


class SessionBody(_Body):
    session_id: str


class LoraConfig(_Body):
    rank: int = 32
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class CreateModelBody(_Body):
    session_id: str
    model_seq_id: int
    base_model: str
    lora_config: LoraConfig | None = None
    user_metadata: Any = None
    optimizer_config: Any = None  # checked: adamw_only


class ModelBody(_Body):
    model_id: str


class OptimStepBody(_Body):
    model_id: str
    seq_id: int
    adam_params: AdamParams | None = None
    optimizer_params: dict[str, Any] | None = None


class SaveBody(_Body):
    model_id: str
    seq_id: int
    path: str | None = None
    sampling_session_seq_id: int | None = None
    ttl_seconds: Any = None
    user_metadata: Any = None
    overwrite: bool = False  # save_state's: replace a save of the same name


class CreateSamplerBody(_Body):
    session_id: str
    sampling_session_seq_id: int
    base_model: str | None = None
    model_path: str | None = None


class EncodedText(_Body):
    tokens: list[int]
    type: str = "encoded_text"


class Prompt(_Body):
    chunks: list[dict[str, Any]]


class SamplingParamsBody(_Body):
    max_tokens: int | None = None
    seed: int | None = None
    stop: Any = None  # a string, strings or token ids: wire.stops
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


class SampleBody(_Body):
    sampling_session_id: str
    seq_id: int
    prompt: Prompt
    sampling_params: SamplingParamsBody
    num_samples: int = 1
    prompt_logprobs: bool = False
    prompt_logprobs_last_n: int | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    prompt_alt_tokens_k: int = 0
    target_prompt_logprobs: Any = None  # refused when set: not served
    record_stability_info: bool | None = None


class LoadBody(_Body):
    path: str
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    optimizer: bool = False
    user_metadata: Any = None
    optimizer_config: Any = None  # checked: adamw_only


class RetrieveBody(_Body):
    request_id: str


class WeightsInfoBody(_Body):
    tinker_path: str


def adamw_only(optimizer_config: Any) -> None:
    """Raises a 400 ApiError unless `optimizer_config` (a create_model's or
    load_weights') is absent or AdamW's (`{"type": "adamw"}`, the SDK's default): the
    learner steps with AdamW only (optim_step's adam_params)."""
    kind = optimizer_config.get("type") if isinstance(optimizer_config, dict) else optimizer_config
    if optimizer_config is not None and kind != "adamw":
        raise ApiError(400, f"optimizer_config: only AdamW ({{'type': 'adamw'}}) is served, not {str(kind)[:64]!r}")


def make_app(gw: Gateway, runs: Runs | None = None) -> FastAPI:
    """The routes over `gw` (sessions, models, futures) and `runs` (the REST listing and
    the run and save metadata; one of its own when None)."""
    app = FastAPI(title="OpenTinker: the Tinker API", docs_url=None, redoc_url=None, openapi_url=None)
    runs = runs or Runs(gw.bus)

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse({"detail": e.detail}, status_code=e.status,
                            headers={"retry-after": "2"} if e.status == 429 else None)

    def key_of(request: Request) -> str:
        return request.headers.get("x-api-key", "").removeprefix("tml-")

    async def caller(request: Request) -> str:
        try:
            return (await gw.users.authenticate(key_of(request))).name
        except AuthError as e:
            raise ApiError(401, f"{e.reason} (send X-API-Key: tml-<your OpenTinker API key>)") from None

    async def body(request: Request, kind: type) -> tuple[str, Any]:
        user = await caller(request)
        raw = await read(request)
        try:
            return user, msgspec.json.decode(raw, type=kind)
        except msgspec.ValidationError as e:
            raise ApiError(400, f"body: {e}") from None
        except msgspec.DecodeError:
            raise ApiError(400, "body: not JSON") from None

    async def read(request: Request) -> bytes:
        if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
            raise ApiError(413, f"body: over {MAX_BODY_BYTES} bytes")
        raw = bytearray()
        try:
            async for chunk in request.stream():
                raw += chunk
                if len(raw) > MAX_BODY_BYTES:
                    raise ApiError(413, f"body: over {MAX_BODY_BYTES} bytes")
        except ClientDisconnect:  # it gave up (the SDK's heartbeat waits 10 s): no one to answer
            raise ApiError(499, "the client closed the request") from None
        return bytes(raw)

    @app.get("/api/v1/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.post("/api/v1/client/config")
    async def client_config(request: Request) -> dict:
        await caller(request)
        return {"parallel_fwdbwd_chunks": False, "fwdbwd_max_chunk_bytes_count": gw.chunk_bytes,
                "pjwt_auth_enabled": False}

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config(request: Request) -> dict:
        await caller(request)
        return {}

    @app.post("/api/v1/telemetry")
    async def telemetry(request: Request) -> dict:
        await caller(request)
        return {"status": "accepted"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities(request: Request) -> dict:
        await caller(request)
        return {"supported_models": [{"model_name": m, "trainable": True, "sampleable": False}
                                     for m in (DEFAULT_MODEL,)]}

    @app.post("/api/v1/create_session")
    async def create_session(request: Request) -> dict:
        user, b = await body(request, CreateSessionBody)
        md, name = checked(wire.check_metadata, b.user_metadata), checked(wire.check_display_name, b.display_name)
        return {"session_id": await gw.create_session(user, md, name)}

    @app.get("/api/v1/sessions")
    async def list_sessions(request: Request) -> dict:
        user = await caller(request)
        return {"sessions": await runs.session_ids(user, *checked(page, request.query_params, 20))}

    @app.get("/api/v1/sessions/{session_id}")
    async def get_session(session_id: str, request: Request) -> dict:
        return await runs.session_info(await caller(request), session_id)

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request) -> dict:
        user, b = await body(request, SessionBody)
        await gw.heartbeat(user, b.session_id)
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request) -> Response:
        user = await caller(request)
        await gw.finish(user, session_id, key_of(request))
        return Response(status_code=204)

    @app.post("/api/v1/create_model")
    async def create_model(request: Request) -> dict:
        user, b = await body(request, CreateModelBody)
        adamw_only(b.optimizer_config)
        lora = b.lora_config or LoraConfig()
        md = checked(wire.check_metadata, b.user_metadata)
        job_id = await gw.create_model(user, key_of(request), b.session_id, b.model_seq_id, b.base_model, lora.rank,
                                       lora.seed, attn=lora.train_attn, mlp=lora.train_mlp, unembed=lora.train_unembed)
        await runs.note_run(user, job_id, md)
        return {"request_id": wire.request_id(job_id, 0), "model_id": wire.model_of_job(job_id)}

    @app.post("/api/v1/get_info")
    async def get_info(request: Request) -> dict:
        user, b = await body(request, ModelBody)
        return await gw.info(user, b.model_id)

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> dict:
        user = await caller(request)
        raw = await read(request)
        try:
            fb = wire.parse_forward_backward(raw, request.headers.get("content-encoding", ""))
        except wire.OpRefused as e:  # fails its own future, in its place in the order
            job_id = await gw.own_model(user, e.model_id)
            op = TinkerOp(job_id=job_id, seq_id=e.seq_id, op="forward_backward", error=str(e))
            return {"request_id": await gw.submit(user, op), "model_id": e.model_id}
        except wire.WireError as e:
            raise ApiError(400, str(e)) from None
        job_id = await gw.own_model(user, fb.model_id)
        data, error = fb.data, ""
        if fb.loss_fn == "stable_reinforce":  # its inputs from what the session recorded (provenance.py)
            data, error = await gw.records.with_provenance(job_id, data, fb.provenance)
        op = TinkerOp(job_id=job_id, seq_id=fb.seq_id, op="forward" if fb.forward_only else "forward_backward",
                      data=data, loss_fn=fb.loss_fn, loss_fn_config=fb.config, error=error)
        return {"request_id": await gw.submit(user, op), "model_id": fb.model_id}

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request) -> dict:
        user, b = await body(request, OptimStepBody)
        job_id = await gw.own_model(user, b.model_id)
        error = "" if b.adam_params else "optimizer_params: only Adam (adam_params) is served"
        op = TinkerOp(job_id=job_id, seq_id=b.seq_id, op="optim_step", adam=b.adam_params, error=error)
        return {"request_id": await gw.submit(user, op), "model_id": b.model_id}

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request) -> dict:
        user, b = await body(request, SaveBody)
        return {"request_id": await gw.submit(user, await save_op(user, b, "save_state")), "model_id": b.model_id}

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request) -> dict:
        user, b = await body(request, SaveBody)
        return {"request_id": await gw.submit(user, await save_op(user, b, "save_sampler")), "model_id": b.model_id}

    async def save_op(user: str, b: SaveBody, kind: str) -> TinkerOp:
        """A save; save_weights_and_get_sampling_client names no path: its weights are
        saved as `sampler-<sampling_session_seq_id>` and a sampling session opens on them.
        Its ttl_seconds and user_metadata go with the op (the learner keeps them once the
        save is written). A bad name, ttl or metadata fails the op's own future, in its
        place in the model's order."""
        job_id = await gw.own_model(user, b.model_id)
        error, name, session, ttl_s, md = "", b.path or "", -1, 0, {}
        if not name and kind == "save_sampler" and b.sampling_session_seq_id is not None:
            name, session = f"sampler-{b.sampling_session_seq_id}", b.sampling_session_seq_id
        try:
            wire.check_name(name)
            ttl_s, md = wire.check_ttl(b.ttl_seconds), wire.check_metadata(b.user_metadata)
        except wire.WireError as e:
            error = str(e)
        if not error and kind == "save_state" and not b.overwrite and \
                await gw.bus.has_object(*object_of_checkpoint(job_id, f"weights/{name}")):
            error = overwrite_refused(name)  # checked again by the learner, in the model's order
        return TinkerOp(job_id=job_id, seq_id=b.seq_id, op=kind, name=name, error=error, overwrite=b.overwrite,
                        sampling_session_seq_id=session, ttl_s=ttl_s, user_metadata=md)

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request) -> dict:
        user, b = await body(request, LoadBody)
        adamw_only(b.optimizer_config)
        if b.model_id is None or b.seq_id is None:  # create_training_client_from_state
            if b.session_id is None or b.model_seq_id is None:
                raise ApiError(400, "load_weights: model_id and seq_id, or session_id and model_seq_id")
            md = checked(wire.check_metadata, b.user_metadata)
            job_id = await gw.create_from_state(user, key_of(request), b.session_id, b.model_seq_id, b.path,
                                                b.optimizer)
            await runs.note_run(user, job_id, md)
            return {"request_id": wire.request_id(job_id, 0), "model_id": wire.model_of_job(job_id)}
        job_id = await gw.own_model(user, b.model_id)
        error, path = "", ""
        try:
            src_model, kind, name = wire.parse_save_path(b.path)
            if kind != "weights":
                raise wire.WireError(f"path: {b.path!r} holds sampler weights; load_state takes a save_state path")
            path = f"{await gw.own_model(user, src_model)}/{name}"
        except (wire.WireError, ApiError) as e:
            error = e.detail if isinstance(e, ApiError) else str(e)
        op = TinkerOp(job_id=job_id, seq_id=b.seq_id, op="load_state", path=path, optimizer=b.optimizer,
                      error=error)
        return {"request_id": await gw.submit(user, op), "model_id": b.model_id}

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        user, b = await body(request, RetrieveBody)
        answer = await gw.retrieve(user, b.request_id, key_of(request))
        if isinstance(answer, bytes):
            return Response(answer, media_type=PROTOBUF)
        return JSONResponse(answer)

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict:
        user, b = await body(request, CreateSamplerBody)
        sid = await gw.create_sampler(user, key_of(request), b.session_id, b.sampling_session_seq_id,
                                      b.base_model, b.model_path)
        return {"sampling_session_id": sid}

    @app.get("/api/v1/samplers/{sampler_id}")
    async def sampler(sampler_id: str, request: Request) -> dict:
        return await gw.sampler_info(await caller(request), sampler_id)

    @app.post("/api/v1/asample")
    async def asample(request: Request) -> dict:
        user, b = await body(request, SampleBody)
        for field in ("target_prompt_logprobs", "prompt_alt_tokens_k"):
            if getattr(b, field):
                raise ApiError(400, f"{field}: not served (topk_prompt_logprobs and topk_sample_logprobs are)")
        tokens: list[int] = []
        for i, c in enumerate(b.prompt.chunks):
            if c.get("type") != "encoded_text":
                raise ApiError(400, f"prompt: {c.get('type')!r} chunks are not served (text only)")
            try:
                tokens += msgspec.convert(c, EncodedText).tokens
            except msgspec.ValidationError as e:
                raise ApiError(400, f"prompt.chunks[{i}]: {e}") from None
        last_n = b.prompt_logprobs_last_n
        if last_n is not None and not (b.prompt_logprobs and 1 <= last_n < len(tokens)):
            raise ApiError(400, f"prompt_logprobs_last_n: must be 1 to len(prompt) - 1 = {len(tokens) - 1}, with "
                                f"prompt_logprobs (got {last_n})")
        k = b.topk_prompt_logprobs
        if not 0 <= k <= MAX_TOPK_LOGPROBS or len(tokens) * k > MAX_TOPK_ENTRIES:
            raise ApiError(400, f"topk_prompt_logprobs: {k} for {len(tokens)} prompt tokens (0 to "
                                f"{MAX_TOPK_LOGPROBS}, and at most {MAX_TOPK_ENTRIES} positions x k)")
        p = b.sampling_params
        max_tokens, ks = p.max_tokens or 16, b.topk_sample_logprobs
        if ks and not (0 < ks <= MAX_TOPK_LOGPROBS and
                       len(tokens) * k + b.num_samples * max_tokens * ks <= MAX_TOPK_ENTRIES):
            raise ApiError(400, f"topk_sample_logprobs: {ks} for {b.num_samples} samples of up to "
                                f"{max_tokens} tokens (0 to {MAX_TOPK_LOGPROBS}, and at most "
                                f"{MAX_TOPK_ENTRIES} positions x k, the prompt's top-k included)")
        try:
            stop_tokens, stop_strings = wire.stops(p.stop)
            req = msgspec.convert(dict(job_id="", sampler=b.sampling_session_id, seq_id=b.seq_id, tokens=tokens,
                                       num_samples=b.num_samples, max_tokens=max_tokens,
                                       temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                                       stop_tokens=stop_tokens,
                                       stop_strings=stop_strings, prompt_logprobs=b.prompt_logprobs,
                                       prompt_logprobs_last_n=last_n or 0, topk_prompt_logprobs=k,
                                       topk_sample_logprobs=ks, seed=p.seed),
                                  TinkerSample)
        except (wire.WireError, msgspec.ValidationError) as e:
            raise ApiError(400, str(e)) from None
        rid, ids = await gw.sample(user, req, bool(b.record_stability_info))
        return {"request_id": rid, "sample_sequence_ids": ids}

    # -- the REST client's listing (runs.py) ------------------------------------------

    def checked(check, *args):
        """`check(*args)`; its WireError (which names the field) answered 400."""
        try:
            return check(*args)
        except wire.WireError as e:
            raise ApiError(400, str(e)) from None

    @app.get("/api/v1/training_runs")
    async def list_training_runs(request: Request) -> dict:
        user = await caller(request)
        checked(check_scope, request.query_params)
        return await runs.list_runs(user, *checked(page, request.query_params, 20))

    @app.get("/api/v1/training_runs/{training_run_id}")
    async def get_training_run(training_run_id: str, request: Request) -> dict:
        user = await caller(request)
        checked(check_scope, request.query_params)
        return await runs.get_run(user, training_run_id)

    @app.get("/api/v1/training_runs/{training_run_id}/checkpoints")
    async def list_checkpoints(training_run_id: str, request: Request) -> dict:
        return await runs.list_checkpoints(await caller(request), training_run_id)

    @app.delete("/api/v1/training_runs/{training_run_id}/checkpoints/{kind}/{name}")
    async def delete_checkpoint(training_run_id: str, kind: str, name: str, request: Request) -> Response:
        await runs.delete_checkpoint(await caller(request), training_run_id, f"{kind}/{name}")
        return Response(status_code=204)

    @app.get("/api/v1/checkpoints")
    async def list_user_checkpoints(request: Request) -> dict:
        user = await caller(request)
        return await runs.list_user_checkpoints(user, *checked(page, request.query_params, 100))

    @app.post("/api/v1/weights_info")
    async def weights_info(request: Request) -> dict:
        user, b = await body(request, WeightsInfoBody)
        return await runs.weights_info(user, b.tinker_path)

    return app
