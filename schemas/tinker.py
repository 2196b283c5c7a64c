"""A Tinker training session on the bus: the API service's operations on one training
model, and the learner's results (services/tinker serves Thinking Machines' Tinker
API; services/learner/tinker_run.py executes it).

Producers and consumers:
- TinkerOp: the tinker API service -> the learner holding the session's job, JetStream
  subject `ot.job.<job_id>.ops.<seq_id>` (stream OT_TINKER). Published once per
  `seq_id` (Nats-Msg-Id `<job_id>:op<seq_id>`: a resent submit dedups); the learner
  executes them strictly in `seq_id` order, as Tinker orders one model's operations.
- TinkerResult: the learner -> the API service, `ot.job.<job_id>.results.<seq_id>`;
  `seq_id` 0 is the session's readiness (the engine is built).
- A "close" TinkerOp (the session finished, or stopped sending heartbeats) comes on
  `ot.job.<job_id>.ops.close`, outside the order: the learner first executes the ops
  it holds in order, then completes the job.
- TinkerSample: the API service -> the rollout worker placed for the session's
  sampling (an inference job), on that job's rollout subject
  `ot.job.<job_id>.rollout.<worker>` (stream OT_ROLLOUT, beside RolloutRequests; told
  apart by the Ot-Schema header). The worker answers with TinkerSamples on
  `ot.job.<sampler>.results.<seq_id>`, per sampling session.
- TinkerSession: the API service's record of a session, KV `ot_tinker`; beside it
  TinkerRunMeta (`run.<job_id>`) and TinkerCheckpointMeta (`ckpt.<job_id>.<kind>.<hex
  of the name>`), a run's and a save's user metadata and expiry.
- RecordedPrompt / RecordedSequence: what a sampling client with record_stability_info
  sampled (KV `ot_tinker_seqs`, `<record_key>.p` and `<record_key>.<i>`), written by the
  API service from the TinkerSample it sent and the TinkerSamples it read back, read by
  it again when a stable_reinforce datum names the sequence.

Tensors travel as raw little-endian row-major bytes (`TinkerTensor`), as the Tinker
SDK sends them.
"""

import re
from typing import Annotated, Literal

import msgspec

from opentinker.schemas.base import Count, Message, TokenId
from opentinker.schemas.weights import WeightsPublished

TinkerDType = Literal["float32", "int64"]
TinkerOpKind = Literal["forward", "forward_backward", "optim_step", "save_state", "save_sampler",
                       "load_state", "close"]
MAX_TINKER_DATUMS = 4096
# a sample's stop conditions (OpenAI's completions take at most 4 stop sequences; these
# are generous for Tinker's renderers, and bound the work of matching them per token)
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKENS = 64
MAX_SAMPLE_PROMPT_TOKENS = 131_072
# top-k prompt logprobs: k (vLLM's default max_logprobs), and prompt positions x k, which
# bounds a TinkerSamples' size (8 bytes an entry)
MAX_TOPK_LOGPROBS = 20
MAX_TOPK_ENTRIES = 262_144
TOPK_MASK_LOGPROB = -99999.0  # an empty top-k entry (id 0), as the SDK's types/topk_logprobs.py reads it
StopString = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
# what save_state / save_weights_for_sampler names may be (a path segment, never "..")
CHECKPOINT_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")


def overwrite_refused(name: str) -> str:
    """Why a save_state of `name` without `overwrite` fails when the model has a save of
    that name (the SDK's save_state: overwrite=True replaces it)."""
    return f"path: the model has a save named {name!r}; save_state(..., overwrite=True) replaces it"


# a record key: the session, then 32 random hex digits (unguessable); a sequence id is
# `<record key>.<i>`, the i-th sequence the sample returned
RECORD_KEY_RE = re.compile(r"^ts-[0-9a-f]{10}\.[0-9a-f]{32}$")
# user_metadata of a session, run or save: a hostile client sends a huge one
MAX_METADATA_KEYS = 32
MAX_METADATA_KEY_CHARS = 128
MAX_METADATA_VALUE_CHARS = 1024
MAX_METADATA_BYTES = 8192
MAX_DISPLAY_NAME_CHARS = 256
Metadata = dict[str, str]
# the loss_fn_inputs the API service adds to a stable_reinforce datum from its records
# (services/tinker/provenance.py); a request naming one is refused
RECORDED_INPUTS = ("recorded_logprobs", "recorded_sequence")


# the folders of a tinker job's saves under its job id: save_state's (store
# `ot_checkpoints`) and save_weights_for_sampler's (store `ot_weights`)
STATE_FOLDER = "named"
SAMPLER_FOLDER = "sampler"


def save_object(job_id: str, folder: str, name: str) -> str:
    """The object a tinker job's save `name` writes in `folder` (STATE_FOLDER, SAMPLER_FOLDER)."""
    return f"{job_id}/{folder}/{name}"


def state_object(job_id: str, name: str) -> str:
    """The object (store `ot_checkpoints`) a tinker job's save_state(`name`) writes."""
    return save_object(job_id, STATE_FOLDER, name)


def sampler_object(job_id: str, name: str) -> str:
    """The object (store `ot_weights`) a tinker job's save_weights_for_sampler(`name`) writes."""
    return save_object(job_id, SAMPLER_FOLDER, name)


class TinkerTensor(msgspec.Struct, frozen=True, kw_only=True):
    """A dense array: `shape` (empty: 1-D of all of `data`), `dtype`, and `data`, the
    elements' little-endian row-major bytes (4 bytes each for float32, 8 for int64)."""

    dtype: TinkerDType
    shape: list[Count] = msgspec.field(default_factory=list)
    data: bytes = b""


class TinkerDatum(msgspec.Struct, frozen=True, kw_only=True):
    """One training sequence: `tokens` [N], the model input; `inputs`, the loss
    function's arrays by name, each with leading dimension N (`target_tokens`,
    `weights`, `logprobs`, `advantages`, ...; Tinker's `loss_fn_inputs`)."""

    tokens: list[TokenId]
    inputs: dict[str, TinkerTensor] = msgspec.field(default_factory=dict)


class AdamParams(msgspec.Struct, frozen=True, kw_only=True):
    """One optimizer step's AdamW hyperparameters (Tinker's AdamParams; decoupled weight
    decay, Loshchilov & Hutter 2019). `grad_clip_norm` 0: no clipping."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class TinkerOp(Message, frozen=True, kw_only=True):
    """One operation on a training session's model.

    op: "forward" (logprobs and loss, no gradient), "forward_backward" (also adds the
        loss's gradient to the accumulated one), "optim_step" (one AdamW step with
        `adam` on the accumulated gradient, then clears it), "save_state" (weights and
        optimizer state under `name`; an existing save of that name is replaced only
        with `overwrite`, as Tinker's save_state), "save_sampler" (weights for sampling under
        `name`), "load_state" (from `path`, with the optimizer state when `optimizer`),
        "close" (the session ends; the job completes).
    data / loss_fn / loss_fn_config: for forward and forward_backward.
    error: set by the API service for a request it refuses (a bad name, a path the user
        may not name): the op still takes its place in the order, and the learner
        answers it with this error.
    ttl_s / user_metadata: a save's ttl_seconds (0: kept until its job's record goes)
        and user metadata, checked by the API service; the learner keeps them
        (TinkerCheckpointMeta) once the save is written, so a save it refuses leaves the
        name's earlier save and metadata as they were.
    """

    job_id: str
    seq_id: Count
    op: TinkerOpKind
    data: list[TinkerDatum] = msgspec.field(default_factory=list)
    loss_fn: str = ""
    loss_fn_config: dict[str, float | str] = msgspec.field(default_factory=dict)
    adam: AdamParams | None = None
    name: str = ""
    path: str = ""
    optimizer: bool = False
    overwrite: bool = False
    error: str = ""
    # save_sampler for save_weights_and_get_sampling_client: the sampling session to open
    # on the saved weights (-1: none, a named save)
    sampling_session_seq_id: int = -1
    ttl_s: Count = 0
    user_metadata: Metadata = msgspec.field(default_factory=dict)


class TinkerResult(Message, frozen=True, kw_only=True):
    """What an operation gave, or why it failed.

    error: non-empty when it failed; `category` "user" (a bad request: the session
        goes on) or "server". logprobs: forward / forward_backward, one [N] float32
        tensor per datum (the model's logprob of each target token). metrics: by
        "<name>:<reduction>" (Tinker's convention, e.g. "loss:sum"). path: what a save
        wrote (a tinker:// path). policy_version: the weights a save_sampler published.
    """

    job_id: str
    seq_id: Count
    op: Literal[TinkerOpKind, "ready"] = "ready"
    error: str = ""
    category: Literal["user", "server"] = "user"
    logprobs: list[TinkerTensor] = msgspec.field(default_factory=list)
    metrics: dict[str, float] = msgspec.field(default_factory=dict)
    path: str = ""
    policy_version: Count = 0
    # save_sampler: the op's sampling_session_seq_id
    sampling_session_seq_id: int = -1


class TinkerSample(Message, frozen=True, kw_only=True):
    """`num_samples` completions of `tokens` for sampling session `sampler` (results on
    `ot.job.<sampler>.results.<seq_id>`), served by the Tinker session's inference job
    `job_id` with `weights` (a LoRA adapter; None: the base model).

    max_tokens: the most tokens per completion. stop_tokens / stop_strings: a completion
    ends at the first of them (inclusive), besides the model's own end-of-sequence; at
    most MAX_STOP_TOKENS ids and MAX_STOP_STRINGS strings of 1 to MAX_STOP_STRING_CHARS
    characters (a decode error names the field otherwise).
    prompt_logprobs: also the logprob of every prompt token after the first;
    prompt_logprobs_last_n > 0: of the last that many only (the others NaN).
    seed: the SDK's `SamplingParams.seed`: completion i samples with the seed
    `stats.derived_seed("tinker", seed, i)`, so the same request on the same weights
    returns the same completions; None: unseeded.
    """

    job_id: str
    sampler: str
    seq_id: Count
    attempt: Count = 0
    weights: WeightsPublished | None = None
    tokens: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_SAMPLE_PROMPT_TOKENS)]
    num_samples: Annotated[int, msgspec.Meta(ge=1, le=256)] = 1
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=32_768)] = 16
    temperature: Annotated[float, msgspec.Meta(ge=0, le=10)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=-1, le=1_000_000)] = -1
    stop_tokens: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_STOP_TOKENS)] = msgspec.field(
        default_factory=list)
    stop_strings: Annotated[list[StopString], msgspec.Meta(max_length=MAX_STOP_STRINGS)] = msgspec.field(
        default_factory=list)
    prompt_logprobs: bool = False
    prompt_logprobs_last_n: Annotated[int, msgspec.Meta(ge=0, le=MAX_SAMPLE_PROMPT_TOKENS)] = 0
    # the k most likely tokens and their logprobs at every prompt position after the first
    # (the last prompt_logprobs_last_n only, when set); 0: none
    topk_prompt_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOPK_LOGPROBS)] = 0
    # the k most likely tokens and their logprobs at every sampled position, under the raw
    # distribution (SampledSequence.topk_*); 0: none
    topk_sample_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOPK_LOGPROBS)] = 0
    # record_stability_info: the API service records the sequences under this key (echoed
    # in the TinkerSamples); "" records nothing
    record_key: Annotated[str, msgspec.Meta(max_length=64)] = ""
    seed: Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)] | None = None


class SampledSequence(msgspec.Struct, frozen=True, kw_only=True):
    """One completion: its tokens, the sampler's logprob of each, and why it ended.
    topk_k > 0 (TinkerSample.topk_sample_logprobs): topk_ids [n, k] int32 and
    topk_logprobs [n, k] float32 (little-endian, row-major) of its n tokens' positions,
    the k most likely tokens of the raw distribution there, most likely first."""

    tokens: list[TokenId]
    logprobs: list[float]
    stop_reason: Literal["stop", "length"]
    topk_k: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOPK_LOGPROBS)] = 0
    topk_ids: bytes = b""
    topk_logprobs: bytes = b""


class TinkerSamples(Message, frozen=True, kw_only=True):
    """What a TinkerSample gave (or why not: `error`, `category`). prompt_logprobs: one
    per prompt token, NaN for the first (nothing predicts it); empty unless asked.
    topk_k > 0: topk_ids [L, k] int32 and topk_logprobs [L, k] float32 (little-endian,
    row-major) of the prompt's L positions, most likely first, unscored rows (the first,
    those before prompt_logprobs_last_n) id 0 and TOPK_MASK_LOGPROB."""

    sampler: str
    seq_id: Count
    error: str = ""
    category: Literal["user", "server"] = "user"
    sequences: list[SampledSequence] = msgspec.field(default_factory=list)
    prompt_logprobs: list[float] = msgspec.field(default_factory=list)
    policy_version: Count = 0
    record_key: str = ""  # the TinkerSample's
    topk_k: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOPK_LOGPROBS)] = 0
    topk_ids: bytes = b""
    topk_logprobs: bytes = b""


class RecordedPrompt(Message, frozen=True, kw_only=True):
    """The prompt of a sample request of a sampling client with record_stability_info
    (KV `ot_tinker_seqs`, `<record_key>.p`): its session and sampling session, its
    tokens, and the weights sampled with (`model_path`, the sampler weights' tinker://
    path, "" for the base model; `weights_sha256` of their bytes). `used_s`: its last
    use by a training request (unix s); the entry is rewritten on use at most hourly,
    which restarts its day (TINKER_RECORD_TTL_S)."""

    session_id: str
    sampler: str
    tokens: list[TokenId]
    model_path: str = ""
    weights_sha256: str = ""
    created_s: float = 0.0
    used_s: float = 0.0


class RecordedSequence(Message, frozen=True, kw_only=True):
    """One sampled sequence of a recorded request (`<record_key>.<i>`): its tokens, the
    sampler's logprob of each, the policy version that sampled it; `used_s` as for
    RecordedPrompt."""

    tokens: list[TokenId]
    logprobs: list[float]
    policy_version: Count = 0
    created_s: float = 0.0
    used_s: float = 0.0


class TinkerRunMeta(Message, frozen=True, kw_only=True):
    """A training run's (a model's) user_metadata, from create_model or
    create_training_client_from_state (KV `ot_tinker`, `run.<job_id>`)."""

    job_id: str
    user: str
    user_metadata: Metadata = msgspec.field(default_factory=dict)


class TinkerCheckpointMeta(Message, frozen=True, kw_only=True):
    """A save's ttl and user_metadata (KV `ot_tinker`, checkpoint_key; none for a save
    without either), written by the learner once the save is. expires_s: when the save
    is deleted (unix s; 0: never)."""

    job_id: str
    user: str
    kind: Literal["weights", "sampler_weights"]
    name: str
    expires_s: float = 0.0
    user_metadata: Metadata = msgspec.field(default_factory=dict)


def checkpoint_key(job_id: str, kind: str, name: str) -> str:
    """The KV `ot_tinker` key of the TinkerCheckpointMeta of a save, `kind` "weights"
    (save_state) or "sampler_weights" (save_weights_for_sampler): `ckpt.<job_id>.<kind>.
    <hex of the name>` (a save name may hold dots, which a key's tokens may not run
    together)."""
    return f"ckpt.{job_id}.{kind}.{name.encode().hex()}"


class TinkerSampler(Message, frozen=True, kw_only=True):
    """A Tinker API sampling session (a SamplingClient), KV `ot_tinker` by id
    (`<session_id>-s<n>`): the base model and the adapter it samples with (None: the
    base model), served by its session's inference job `<session_id>-sampling`."""

    sampler_id: str
    session_id: str
    user: str
    base_model: str
    model_path: str = ""
    weights: WeightsPublished | None = None
    created_s: float = 0.0


class TinkerSession(Message, frozen=True, kw_only=True):
    """A Tinker API session (the SDK's ServiceClient), KV `ot_tinker` by id. Its models
    are the jobs `<session_id>-m<n>` for n < `models`; `samplers` sampling sessions
    share the inference job `<session_id>-sampling` (placed on a rollout worker)."""

    session_id: str
    user: str
    created_s: float = 0.0
    heartbeat_s: float = 0.0
    active_s: float = 0.0  # its last operation or sample (unix s; written at most every ACTIVE_EVERY_S)
    finished_s: float = 0.0
    models: Count = 0
    samplers: Count = 0
    user_metadata: Metadata = msgspec.field(default_factory=dict)
    display_name: str = ""
