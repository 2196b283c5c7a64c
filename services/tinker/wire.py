"""Tinker's wire formats and names, to and from the bus's messages (schemas/tinker.py).

The protobuf bodies (a forward_backward request; the ForwardBackwardOutput a future
returns) use the Tinker SDK's own generated module, `tinker.proto.tinker_public_pb2`
(package `tinker`, pinned in the server extra): integer token ids travel as int32
little-endian bytes, tensors as dense little-endian bytes or CSR, per-datum outputs
as one BatchedTensor with byte offsets.

Names: a session is `ts-<10 hex>`; its n-th model is Tinker's model id
`<session>:train:<n>` (the form the SDK derives itself) and our job `<session>-m<n>`;
its n-th sampling session is `<session>-s<n>` (the id the SDK is given), all of them
served by the session's inference job `<session>-sampling`; a future's request id is `<job>.<seq_id>`; saves are `tinker://<model_id>/weights/<name>`
(training state) and `tinker://<model_id>/sampler_weights/<name>` (sampler weights).
"""

from __future__ import annotations

import math
import re
import secrets
from typing import Any, NamedTuple

import msgspec
import numpy as np

from opentinker.schemas.tinker import (CHECKPOINT_NAME_RE, MAX_DISPLAY_NAME_CHARS, MAX_METADATA_BYTES,
                                       MAX_METADATA_KEY_CHARS, MAX_METADATA_KEYS, MAX_METADATA_VALUE_CHARS,
                                       MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKENS, MAX_TINKER_DATUMS,
                                       RECORDED_INPUTS, TinkerDatum, TinkerResult, TinkerTensor)

SESSION_RE = re.compile(r"^ts-[0-9a-f]{10}$")
MODEL_RE = re.compile(r"^(ts-[0-9a-f]{10}):train:(\d{1,6})$")
JOB_RE = re.compile(r"^(ts-[0-9a-f]{10})-m(\d{1,6})$")
SAMPLER_RE = re.compile(r"^(ts-[0-9a-f]{10})-s(\d{1,6})$")
REQUEST_RE = re.compile(r"^(ts-[0-9a-f]{10}-[ms]\d{1,6})\.(\d{1,15})$")
PATH_RE = re.compile(r"^tinker://([^/]+)/(weights|sampler_weights)/([^/]+)$")
MAX_TOKENS_PER_DATUM = 131_072
# elements of one loss_fn input, declared shape included (a CSR tensor of a few bytes may
# declare any shape, and is made dense here): 2**24 float32s are 64 MiB
MAX_TENSOR_ELEMENTS = 2**24
# provenance runs of one datum field (a run covers >= 0 positions: the bound keeps a
# request of empty runs from costing more than its tokens)
MAX_SPANS_PER_FIELD = 4096
MAX_SEQUENCE_ID_CHARS = 128
# a checkpoint's ttl_seconds, as Tinker's SDK documents it: 1 hour to 10 years
MIN_TTL_S = 3600
MAX_TTL_S = 10 * 365 * 86400


class Span(NamedTuple):
    """One provenance run of a datum field (the SDK's PromptProvenanceSpan, kind
    "prompt", or SampledProvenanceSpan, kind "sampled"): the field's next `length`
    positions are positions [offset, offset + length) of the prompt, or of the sampled
    tokens, of sequence `sequence_id`."""

    kind: str
    sequence_id: str
    offset: int
    length: int


class Provenance(NamedTuple):
    """A datum's provenance: the runs tiling its model input, and those tiling its
    target_tokens (Datum.model_input_spans, Datum.loss_fn_input_spans)."""

    inputs: list[Span]
    targets: list[Span]


class ForwardBackward(NamedTuple):
    """A parsed ForwardBackwardRequest; provenance[i] is datum i's, or None."""

    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float | str]
    forward_only: bool
    data: list[TinkerDatum]
    provenance: list[Provenance | None]


class WireError(ValueError):
    """A request body or name the API cannot take; the message names the field."""


class OpRefused(WireError):
    """A forward(_backward) request whose model and seq_id decoded but whose content
    cannot be taken: the API sends the op with this error, so that it takes its place
    in the model's seq_id order and fails its own future (a 400 instead would leave the
    learner waiting for that seq_id, and every later op of the model with it)."""

    def __init__(self, message: str, model_id: str, seq_id: int):
        super().__init__(message)
        self.model_id = model_id
        self.seq_id = seq_id


def new_session_id() -> str:
    return f"ts-{secrets.token_hex(5)}"


def model_id(session_id: str, n: int) -> str:
    return f"{session_id}:train:{n}"


def model_job(session_id: str, n: int) -> str:
    """Our job id of the session's n-th model."""
    return f"{session_id}-m{n}"


def job_of_model(mid: str) -> str:
    """Our job id for Tinker model id `mid`. Raises WireError for a malformed id."""
    m = MODEL_RE.match(mid or "")
    if not m:
        raise WireError(f"model_id: {mid!r} is not a model of this server (<session>:train:<n>)")
    return model_job(m.group(1), int(m.group(2)))


def model_of_job(job_id: str) -> str:
    m = JOB_RE.match(job_id)
    if not m:
        raise WireError(f"{job_id!r} is not a tinker session's job")
    return model_id(m.group(1), int(m.group(2)))


def session_of_job(job_id: str) -> str:
    """The session of a model job, sampling session or sampling job id."""
    return "-".join(job_id.split("-")[:2])


def sampler_job(session_id: str, n: int) -> str:
    """The id of sampling session `n` (a KV record, and its results' subject token)."""
    return f"{session_id}-s{n}"


def sampling_job(session_id: str) -> str:
    """The inference job serving every sampling session of a Tinker session."""
    return f"{session_id}-sampling"


def check_sampler(sid: str) -> str:
    """`sid` if it names a sampling session of this server; raises WireError."""
    if not SAMPLER_RE.match(sid or ""):
        raise WireError(f"sampling_session_id: {sid!r} is not a sampling session of this server")
    return sid


def request_id(job_id: str, seq_id: int) -> str:
    return f"{job_id}.{seq_id}"


def parse_request_id(rid: str) -> tuple[str, int]:
    """(job id, seq id) of a future's request id. Raises WireError."""
    m = REQUEST_RE.match(rid or "")
    if not m:
        raise WireError(f"request_id: {rid!r} is not a request of this server")
    return m.group(1), int(m.group(2))


def save_path(mid: str, kind: str, name: str) -> str:
    return f"tinker://{mid}/{kind}/{name}"


def parse_save_path(path: str) -> tuple[str, str, str]:
    """(model id, kind, name) of a tinker:// save path. Raises WireError."""
    m = PATH_RE.match(path or "")
    if not m:
        raise WireError(f"path: {path!r} is not tinker://<model_id>/weights/<name> or .../sampler_weights/<name>")
    mid, kind, name = m.groups()
    job_of_model(mid)
    check_name(name)
    return mid, kind, name


def check_name(name: str) -> str:
    if not CHECKPOINT_NAME_RE.match(name or ""):
        raise WireError(f"path: name {name!r} must match {CHECKPOINT_NAME_RE.pattern}")
    return name


# -- forward_backward -------------------------------------------------------------

def _pb():
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


def _tensor(t, name: str) -> TinkerTensor:
    """A dense TinkerTensor from a tinker_public.Tensor (dense or CSR; float32, bf16,
    int64 or int32)."""
    pb = _pb()
    kinds = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32,
             pb.DTYPE_BFLOAT16: np.uint16}
    if t.dtype not in kinds:
        raise WireError(f"{name}: unsupported dtype {t.dtype}")
    dt = kinds[t.dtype]
    shape = [int(x) for x in t.shape]
    if any(x < 0 for x in shape) or len(shape) > 8 or math.prod(shape) > MAX_TENSOR_ELEMENTS:
        raise WireError(f"{name}: shape {shape[:8]} is over the limit of {MAX_TENSOR_ELEMENTS} elements "
                        "(or has a negative or a ninth dimension)")
    if t.WhichOneof("encoding") == "sparse_csr":
        if len(shape) != 2:
            raise WireError(f"{name}: a sparse tensor needs a 2-D shape, got {shape}")
        values = np.frombuffer(t.sparse_csr.values, dt)
        crow = np.frombuffer(t.sparse_csr.crow_indices, np.int64)
        col = np.frombuffer(t.sparse_csr.col_indices, np.int64)
        if (len(crow) != shape[0] + 1 or len(col) != len(values)
                or (len(col) and (col.min() < 0 or col.max() >= shape[1]))
                or np.any(np.diff(crow) < 0) or crow[0] != 0 or crow[-1] != len(values)):
            raise WireError(f"{name}: inconsistent CSR indices for shape {shape}")
        a = np.zeros(shape, dt)
        rows = np.repeat(np.arange(shape[0]), np.diff(crow))
        a[rows, col] = values
    else:
        if len(t.dense) % np.dtype(dt).itemsize:
            raise WireError(f"{name}: {len(t.dense)} bytes is not a whole number of elements")
        a = np.frombuffer(t.dense, dt)
        if shape and int(np.prod(shape)) != a.size:
            raise WireError(f"{name}: shape {shape} does not hold {a.size} elements")
    if dt is np.uint16:  # bfloat16: the high half of a float32
        a = (a.astype(np.uint32) << 16).view(np.float32)
    a = a.astype(np.int64 if a.dtype.kind in "iu" else np.float32)
    return TinkerTensor(dtype="int64" if a.dtype == np.int64 else "float32", shape=shape or [a.size],
                        data=np.ascontiguousarray(a).tobytes())


def _spans(runs, field: str) -> list[Span]:
    """The Spans of a repeated tinker_public.ProvenanceSpan. Raises WireError naming
    `field` for over MAX_SPANS_PER_FIELD runs, a run of neither kind, a negative
    offset or length, or an empty or over-long sequence id."""
    if len(runs) > MAX_SPANS_PER_FIELD:
        raise WireError(f"{field}: {len(runs)} runs (at most {MAX_SPANS_PER_FIELD})")
    out = []
    for j, run in enumerate(runs):
        kind = run.WhichOneof("span")
        if kind is None:
            raise WireError(f"{field}[{j}]: neither prompt_tokens nor sampled_tokens")
        arm = getattr(run, kind)
        if not 0 < len(arm.sequence_id) <= MAX_SEQUENCE_ID_CHARS:
            raise WireError(f"{field}[{j}].sequence_id: {len(arm.sequence_id)} characters "
                            f"(1 to {MAX_SEQUENCE_ID_CHARS})")
        if arm.offset < 0 or arm.length < 0:
            raise WireError(f"{field}[{j}]: offset {arm.offset} and length {arm.length} must be >= 0")
        out.append(Span("prompt" if kind == "prompt_tokens" else "sampled", arm.sequence_id, int(arm.offset),
                        int(arm.length)))
    return out


def parse_forward_backward(body: bytes, content_encoding: str = "") -> ForwardBackward:
    """A ForwardBackwardRequest body (zstd-compressed when `content_encoding` says so),
    with each datum's provenance (checked against the records only for a loss that
    reads them: provenance.py). Raises WireError for an undecodable body or a seq_id
    below 1; OpRefused (a WireError) for image or audio inputs, too many datums, tokens
    or provenance runs, or a loss_fn_inputs key the server reserves
    (schemas.tinker.RECORDED_INPUTS)."""
    from google.protobuf.message import DecodeError

    pb = _pb()
    if content_encoding.strip().lower() == "zstd":
        import zstandard

        try:
            body = zstandard.ZstdDecompressor().decompress(body, max_output_size=64 * 1024 * 1024)
        except zstandard.ZstdError as e:
            raise WireError(f"body: not zstd ({e})") from None
    req = pb.ForwardBackwardRequest()
    try:
        req.ParseFromString(body)
    except DecodeError as e:
        raise WireError(f"body: not a tinker_public.ForwardBackwardRequest ({e})") from None
    if req.seq_id < 1:
        raise WireError(f"seq_id: {req.seq_id} (from 1)")
    try:
        return _parsed(req)
    except WireError as e:  # the request's place in the order is known: it fails there
        raise OpRefused(str(e), req.model_id, int(req.seq_id)) from None


def _parsed(req) -> ForwardBackward:
    if len(req.data) > MAX_TINKER_DATUMS:
        raise WireError(f"data: {len(req.data)} datums (at most {MAX_TINKER_DATUMS} per request)")
    config: dict[str, float | str] = dict(req.loss_fn_config)
    for k, v in req.loss_fn_config_v2.items():
        config[k] = v.number if v.WhichOneof("value") == "number" else v.text
    data, provenance = [], []
    for i, d in enumerate(req.data):
        tokens = []
        for c in d.model_input:
            kind = c.WhichOneof("chunk")
            if kind != "encoded_text":
                raise WireError(f"data[{i}].model_input: {kind} chunks are not supported (text only)")
            tokens.append(np.frombuffer(c.encoded_text.tokens, np.int32))
        ids = np.concatenate(tokens) if tokens else np.zeros(0, np.int32)
        if len(ids) > MAX_TOKENS_PER_DATUM or (len(ids) and ids.min() < 0):
            raise WireError(f"data[{i}].model_input: {len(ids)} tokens (at most {MAX_TOKENS_PER_DATUM}, ids >= 0)")
        reserved = sorted(set(d.loss_fn_inputs) & set(RECORDED_INPUTS))
        if reserved:
            raise WireError(f"data[{i}].loss_fn_inputs[{reserved[0]!r}]: the server's own (from what it recorded "
                            "when sampling); send provenance instead")
        inputs = {k: _tensor(v, f"data[{i}].loss_fn_inputs[{k!r}]") for k, v in d.loss_fn_inputs.items()}
        data.append(TinkerDatum(tokens=ids.tolist(), inputs=inputs))
        runs = (_spans(d.model_input_spans, f"data[{i}].model_input_spans"),
                _spans(d.loss_fn_input_spans, f"data[{i}].loss_fn_input_spans"))
        provenance.append(Provenance(*runs) if any(runs) else None)
    return ForwardBackward(req.model_id, int(req.seq_id), req.loss_fn, config, bool(req.forward_only), data,
                           provenance)


def forward_backward_output(r: TinkerResult) -> bytes:
    """The serialized tinker_public.ForwardBackwardOutput of a forward(_backward) result:
    one ArrayRecord of every datum's `logprobs`, and the metrics."""
    pb = _pb()
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    rec = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(r.logprobs))
    field = rec.fields["logprobs"]
    field.dtype = pb.DTYPE_FLOAT32
    field.data = b"".join(t.data for t in r.logprobs)
    field.offsets = np.cumsum([0] + [len(t.data) for t in r.logprobs]).astype("<i8").tobytes()
    for k, v in r.metrics.items():
        out.metrics[k] = float(v)
    return out.SerializeToString()


# -- sampling ---------------------------------------------------------------------

def sample_response(r) -> bytes:
    """The serialized tinker_public.SampleResponse of a TinkerSamples: per sequence its
    int32 tokens, float32 logprobs, stop reason and (when asked) top-k sample logprobs
    (a TopkLogprobs of its length by k); the prompt logprobs (NaN first); the top-k
    prompt logprobs (a TopkLogprobs of the prompt's length by k)."""
    pb = _pb()
    out = pb.SampleResponse()
    for s in r.sequences:
        seq = out.sequences.add(stop_reason=pb.STOP_REASON_STOP if s.stop_reason == "stop" else pb.STOP_REASON_LENGTH)
        seq.tokens = np.asarray(s.tokens, "<i4").tobytes()
        seq.logprobs = np.asarray(s.logprobs, "<f4").tobytes()
        if s.topk_k:
            seq.topk_sampled_logprobs.CopyFrom(pb.TopkLogprobs(token_ids=s.topk_ids, logprobs=s.topk_logprobs,
                                                               k=s.topk_k, length=len(s.tokens)))
    if r.prompt_logprobs:
        out.prompt_logprobs = np.asarray(r.prompt_logprobs, "<f4").tobytes()
    if r.topk_k:
        out.topk_prompt_logprobs.CopyFrom(pb.TopkLogprobs(token_ids=r.topk_ids, logprobs=r.topk_logprobs, k=r.topk_k,
                                                          length=len(r.topk_ids) // (4 * r.topk_k)))
    return out.SerializeToString()


def stops(stop) -> tuple[list[int], list[str]]:
    """(stop token ids, stop strings) of Tinker's `sampling_params.stop`: None (the
    model's own end of sequence), a string, strings or token ids. Raises WireError for
    `[]` (Tinker's "no stop at all, not even end of sequence", which is not served) and
    for more or longer stops than schemas.tinker's MAX_STOP_* limits."""
    if stop is None:
        return [], []
    if isinstance(stop, list) and not stop:
        raise WireError("sampling_params.stop: [] (sampling past the end-of-sequence token) is not served")
    if isinstance(stop, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in stop):
        if len(stop) > MAX_STOP_TOKENS:
            raise WireError(f"sampling_params.stop: {len(stop)} stop tokens (at most {MAX_STOP_TOKENS})")
        return list(stop), []
    if isinstance(stop, str):
        stop = [stop]
    if isinstance(stop, list) and all(isinstance(x, str) and x for x in stop):
        if len(stop) > MAX_STOP_STRINGS:
            raise WireError(f"sampling_params.stop: {len(stop)} stop strings (at most {MAX_STOP_STRINGS})")
        if max(map(len, stop)) > MAX_STOP_STRING_CHARS:
            raise WireError(f"sampling_params.stop: a stop string of {max(map(len, stop))} characters "
                            f"(at most {MAX_STOP_STRING_CHARS})")
        return [], list(stop)
    raise WireError("sampling_params.stop: a string, a list of strings or a list of token ids")


# -- user metadata and checkpoint ttls ----------------------------------------------

def check_metadata(md: Any, field: str = "user_metadata") -> dict[str, str]:
    """`md` (None: {}) as user_metadata: at most MAX_METADATA_KEYS string keys of 1 to
    MAX_METADATA_KEY_CHARS characters, string values (numbers and booleans are taken as
    their JSON text) of at most MAX_METADATA_VALUE_CHARS, MAX_METADATA_BYTES in all as
    JSON. Raises WireError naming `field` otherwise."""
    if md is None:
        return {}
    if not isinstance(md, dict):
        raise WireError(f"{field}: an object of strings, got {type(md).__name__}")
    if len(md) > MAX_METADATA_KEYS:
        raise WireError(f"{field}: {len(md)} keys (at most {MAX_METADATA_KEYS})")
    out = {}
    for k, v in md.items():
        if not isinstance(k, str) or not 0 < len(k) <= MAX_METADATA_KEY_CHARS:
            raise WireError(f"{field}: a key of 1 to {MAX_METADATA_KEY_CHARS} characters, got {str(k)[:40]!r}")
        if isinstance(v, (bool, int, float)):
            v = msgspec.json.encode(v).decode()
        if not isinstance(v, str) or len(v) > MAX_METADATA_VALUE_CHARS:
            raise WireError(f"{field}[{k[:40]!r}]: a string of at most {MAX_METADATA_VALUE_CHARS} characters")
        out[k] = v
    if len(msgspec.json.encode(out)) > MAX_METADATA_BYTES:
        raise WireError(f"{field}: over {MAX_METADATA_BYTES} bytes as JSON")
    return out


def check_display_name(name: Any) -> str:
    """A session's display_name (None: ""); raises WireError for a non-string or one over
    MAX_DISPLAY_NAME_CHARS characters."""
    if name is None:
        return ""
    if not isinstance(name, str) or len(name) > MAX_DISPLAY_NAME_CHARS:
        raise WireError(f"display_name: a string of at most {MAX_DISPLAY_NAME_CHARS} characters")
    return name


def check_ttl(ttl_seconds: Any) -> int:
    """A save's ttl_seconds (None: 0, never expires): a whole number of seconds from
    MIN_TTL_S (1 hour) to MAX_TTL_S (10 years), the range Tinker's SDK documents.
    Raises WireError otherwise."""
    if ttl_seconds is None:
        return 0
    if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int) \
            or not MIN_TTL_S <= ttl_seconds <= MAX_TTL_S:
        raise WireError(f"ttl_seconds: {str(ttl_seconds)[:40]} is not a whole number of seconds from {MIN_TTL_S} "
                        f"(1 hour) to {MAX_TTL_S} (10 years); omit it for a save that never expires")
    return ttl_seconds
