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
- TinkerSession: the API service's record of a session, KV `ot_tinker`.

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
StopString = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
# what save_state / save_weights_for_sampler names may be (a path segment, never "..")
CHECKPOINT_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")


def sampler_object(job_id: str, name: str) -> str:
    """The object (store `ot_weights`) a tinker job's save_weights_for_sampler(`name`) writes."""
    return f"{job_id}/sampler/{name}"


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
        optimizer state under `name`), "save_sampler" (weights for sampling under
        `name`), "load_state" (from `path`, with the optimizer state when `optimizer`),
        "close" (the session ends; the job completes).
    data / loss_fn / loss_fn_config: for forward and forward_backward.
    error: set by the API service for a request it refuses (a bad name, a path the user
        may not name): the op still takes its place in the order, and the learner
        answers it with this error.
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
    error: str = ""
    # save_sampler for save_weights_and_get_sampling_client: the sampling session to open
    # on the saved weights (-1: none, a named save)
    sampling_session_seq_id: int = -1


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


class SampledSequence(msgspec.Struct, frozen=True, kw_only=True):
    """One completion: its tokens, the sampler's logprob of each, and why it ended."""

    tokens: list[TokenId]
    logprobs: list[float]
    stop_reason: Literal["stop", "length"]


class TinkerSamples(Message, frozen=True, kw_only=True):
    """What a TinkerSample gave (or why not: `error`, `category`). prompt_logprobs: one
    per prompt token, NaN for the first (nothing predicts it); empty unless asked."""

    sampler: str
    seq_id: Count
    error: str = ""
    category: Literal["user", "server"] = "user"
    sequences: list[SampledSequence] = msgspec.field(default_factory=list)
    prompt_logprobs: list[float] = msgspec.field(default_factory=list)
    policy_version: Count = 0


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
