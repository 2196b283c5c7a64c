"""Upstream OpenTinker client configs (its `client_config/*.yaml` keys) as our JobSpec.

Upstream OpenTinker (github.com/open-tinker/OpenTinker) configures a run with one
Hydra/OmegaConf YAML file per script; `job_spec_from_config` reads the same keys from a
dict, an OmegaConf DictConfig (omegaconf is optional), an argparse.Namespace or a
SimpleNamespace, and returns the JobSpec they ask for (schemas/job.py) plus the keys it
set aside, each with the reason.

    upstream key                               JobSpec field
    tokenizer_path (else model_path)           model (default "smollm2-135m-instruct")
    experiment_name                            name
    batch_size                                 prompts_per_step
    rollout_n                                  group_size
    num_steps                                  steps (num_epochs: ServiceClient.fit)
    save_freq (<= 0: never)                    checkpoint_every
    test_freq (<= 0: never)                    eval_every
    val_batch_size                             eval_episodes
    temperature, top_p                         sampling.temperature, sampling.top_p
    multi_turn.max_tokens_per_turn             sampling.max_new_tokens (per turn; else
                                               max_new_tokens)
    max_prompt_tokens + max_new_tokens         sampling.max_total_tokens (the episode)
    multi_turn.max_assistant_turns,            sampling.max_turns = min(assistant turns,
      max_user_turns (0 = single turn),          user turns + 1, interaction.config.max_steps)
      interaction.config.max_steps
    adv_estimator grpo | grpo_per_step         advantage "episode" | "turn" (GRPO);
                                               rloo, reinforce_plus_plus, drgrpo too;
                                               gae: PPO with a critic, group_size 1
    lora.lora_rank (absent: 0), lora_alpha     lora_rank (0 = every parameter), lora_alpha
    lora.target_modules ("all-linear")         lora_target_modules (the decoder's 7 linears)
    lora.lr (when lora_rank > 0), else 1e-6    lr (1e-6: upstream's actor default)
    kl.use_kl_loss / use_kl_in_reward,         kl_coef, kl_in_reward, kl_estimator
      kl_loss_coef, kl_loss_type
    interaction.name                           env
    job_spec: {...} (this project's)           any JobSpec field, applied last

Refused (ConfigError naming the key): lora.exclude_modules, lora.lora_adapter_path, a
`reward` section (the reward is the game's `step()`), an unknown `algorithm`.
Everything else is set aside in `ignored` with the reason, and logged.
interaction.config.observation_template is not part of the job: the game served from
the client's process (GameEnvironment) applies it.
"""

from __future__ import annotations

import argparse
import logging
import types
from collections.abc import Mapping
from typing import Any, NamedTuple

from opentinker.schemas.job import JobSpec, SpecError, spec_from_dict

log = logging.getLogger("opentinker.client")

# the linear layers of a Llama/Qwen-style decoder block: peft's "all-linear" for these
# models (it leaves out the output layer too)
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
UPSTREAM_LR = 1e-6        # upstream's actor lr when the config names none (verl actor.optim.lr)
DEFAULT_PROMPT_TOKENS = 1024  # the prompt allowance when max_prompt_tokens is not given
ADVANTAGE = {  # upstream / verl adv_estimator -> (advantage_estimator, advantage)
    "grpo": ("grpo", "episode"), "grpo_per_step": ("grpo", "turn"), "rloo": ("rloo", "episode"),
    "reinforce_plus_plus": ("reinforce_pp", "episode"), "reinforce_pp": ("reinforce_pp", "episode"),
    "drgrpo": ("dr_grpo", "episode"), "dr_grpo": ("dr_grpo", "episode"), "gae": ("gae", "episode"),
}
KL_ESTIMATOR = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}

_CLIENT = "read by the clients (connection, tracking), not sent as part of the job"
_INFERENCE = "an inference setting (InferenceSchedulerClient.submit_inference_job / run_inference)"
IGNORED = {
    "project_name": "the wandb project of ServiceClient(logger_backends=['wandb'])",
    "logger_backends": _CLIENT,
    "wandb_key": "used by ServiceClient's wandb logging (WANDB_API_KEY); never sent to the service",
    "enable_tracing": "Weave tracing is upstream's; every trajectory is in the job's log (`opentinker episodes`)",
    "weave_project": "Weave tracing is upstream's; every trajectory is in the job's log (`opentinker episodes`)",
    "data_path": "read on this machine by GameEnvironment; the rows never leave it",
    "val_data_path": "read on this machine by GameEnvironment; the rows never leave it",
    "num_workers": "no client dataloader: this process serves the env, the service makes the episodes",
    "num_epochs": "ServiceClient.fit turns epochs into steps",
    "scheduler_url": _CLIENT, "scheduler_api_key": _CLIENT, "server_url": _CLIENT,
    "num_gpus": "placement is the pool's: a job takes one learner (learner_ranks) and "
                "rollout_workers rollout workers",
    "agent_num_workers": "a rollout worker runs a job's episodes concurrently; no per-job worker count",
    "processor_path": "a vision-language model's processor is loaded with the model",
    "board_size": "a game kwarg: pass it in GameEnvironment(game_kwargs=...)",
    **{k: _INFERENCE for k in ("tensor_parallel_size", "gpu_memory_utilization", "output_path", "max_samples",
                               "env_endpoint", "vllm_server_url", "max_context_length", "max_model_len",
                               "trust_remote_code", "max_tokens_per_turn")},
}
_INTERACTION_CONFIG = ("not sent with the job: the game runs in this process (GameEnvironment.serve), so "
                       "there is no env server; what your script reads from it (game_kwargs) still applies")


class ConfigError(ValueError):
    """An upstream config key asks for what this service cannot do. `key` names it
    (dotted)."""

    def __init__(self, key: str, reason: str):
        super().__init__(f"config `{key}`: {reason}")
        self.key = key
        self.reason = reason


class MappedConfig(NamedTuple):
    """The JobSpec an upstream config asks for, and the keys set aside (key -> reason)."""

    spec: JobSpec
    ignored: dict[str, str]


def as_dict(config: Any) -> dict[str, Any]:
    """`config` as plain nested dicts: a Mapping, an OmegaConf DictConfig (interpolations
    resolved), an argparse.Namespace or SimpleNamespace, or None ({}). Raises TypeError
    for anything else."""
    if config is None:
        return {}
    out = _plain(config)
    if not isinstance(out, dict):
        raise TypeError(f"config: expected a dict, DictConfig or namespace, got {type(config).__name__}")
    return out


def _plain(x: Any) -> Any:
    if type(x).__module__.split(".")[0] == "omegaconf":
        from omegaconf import OmegaConf  # only ever reached when the caller has omegaconf

        return _plain(OmegaConf.to_container(x, resolve=True))
    if isinstance(x, Mapping):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (argparse.Namespace, types.SimpleNamespace)):
        return {k: _plain(v) for k, v in vars(x).items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def get(config: Any, dotted: str, default: Any = None) -> Any:
    """The value at `dotted` ("multi_turn.max_user_turns") of a config, or `default`
    when absent or None."""
    obj: Any = as_dict(config)
    for part in dotted.split("."):
        obj = obj.get(part) if isinstance(obj, dict) else None
    return default if obj is None else obj


def _int(key: str, x: Any) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or (isinstance(x, float) and not x.is_integer()):
        raise ConfigError(key, f"must be a whole number (got {x!r})")
    return int(x)


def _modules(key: str, x: Any) -> list[str]:
    if isinstance(x, str):
        names = [m.strip() for m in x.split(",") if m.strip()]
    elif isinstance(x, list) and all(isinstance(m, str) for m in x):
        names = list(x)
    else:
        raise ConfigError(key, f"must be a module name, a comma-separated list or a list (got {x!r})")
    return ALL_LINEAR if [m.lower() for m in names] == ["all-linear"] else names


def job_spec_from_config(config: Any, env: str | None = None) -> MappedConfig:
    """Map an upstream OpenTinker client config to a validated JobSpec (table in the
    module docstring). `env` overrides `interaction.name` as the env's name.

    Raises ConfigError naming a refused key, SpecError naming the JobSpec field (and the
    upstream keys it came from) when a value is out of the field's bounds."""
    c = as_dict(config)
    d: dict[str, Any] = {}
    sampling: dict[str, Any] = {}
    source: dict[str, str] = {}  # JobSpec field -> the upstream keys it came from
    ignored: dict[str, str] = {}

    def put(field: str, value: Any, *keys: str) -> None:
        (sampling if field.startswith("sampling.") else d)[field.removeprefix("sampling.")] = value
        source[field] = ", ".join(keys)

    for key, value in c.items():
        if value is None or key in ("interaction", "multi_turn", "lora", "kl", "reward", "job_spec"):
            continue
        if key in IGNORED:
            ignored[key] = IGNORED[key]
        elif key == "algorithm":
            if value not in ("agent_loop", "toolcall"):
                raise ConfigError("algorithm", f"{value!r} is not one of upstream's 'agent_loop', 'toolcall'")
            ignored[key] = "every job runs the multi-turn agent loop, tool calls included"
        elif key not in _MAPPED:
            ignored[key] = "not an upstream OpenTinker client key; left to your script"

    model = c.get("tokenizer_path") or c.get("model_path")
    if model:
        put("model", str(model), "tokenizer_path" if c.get("tokenizer_path") else "model_path")
    if c.get("experiment_name"):
        put("name", str(c["experiment_name"]), "experiment_name")
    for key, field in (("batch_size", "prompts_per_step"), ("rollout_n", "group_size"), ("num_steps", "steps"),
                       ("val_batch_size", "eval_episodes")):
        if c.get(key) is not None:
            put(field, _int(key, c[key]), key)
    if c.get("save_freq") is not None:
        n = _int("save_freq", c["save_freq"])
        put("checkpoint_every", n if n > 0 else 1_000_000, "save_freq")
    if c.get("test_freq") is not None:
        put("eval_every", max(0, _int("test_freq", c["test_freq"])), "test_freq")
    for key in ("temperature", "top_p"):
        if c.get(key) is not None:
            put(f"sampling.{key}", c[key], key)
    _tokens(c, put)
    _adv_estimator(c, put)
    _lora(c, put, ignored)
    _kl(c, put, ignored)
    _interaction(c, put, ignored, env)
    if c.get("reward"):
        raise ConfigError("reward", "reward functions are not uploaded here: the reward is what the "
                          "game's step() returns (StepResult.reward)")
    for key, value in (c.get("job_spec") or {}).items():
        if key == "sampling" and isinstance(value, dict):
            for k, v in value.items():
                put(f"sampling.{k}", v, f"job_spec.sampling.{k}")
        else:
            put(key, value, f"job_spec.{key}")
    if sampling:
        d["sampling"] = sampling
    by_reason: dict[str, list[str]] = {}
    for key, reason in ignored.items():
        by_reason.setdefault(reason, []).append(f"`{key}`")
    for reason, keys in by_reason.items():
        log.info("config %s not used: %s", ", ".join(keys), reason)
    try:
        return MappedConfig(spec_from_dict(d), ignored)
    except SpecError as e:
        keys = source.get(e.field)
        raise SpecError(e.field, f"{e.reason} (from config {keys})" if keys else e.reason) from None


_MAPPED = {"tokenizer_path", "model_path", "experiment_name", "batch_size", "rollout_n", "num_steps",
           "val_batch_size", "save_freq", "test_freq", "temperature", "top_p", "max_new_tokens",
           "max_prompt_tokens", "adv_estimator"}


def _tokens(c: dict[str, Any], put) -> None:
    """Upstream's `max_new_tokens` is the whole trajectory's response budget and
    `multi_turn.max_tokens_per_turn` one turn's; ours are per turn (`max_new_tokens`)
    and per episode, prompt included (`max_total_tokens`)."""
    mt = c.get("multi_turn") or {}
    total_new = c.get("max_new_tokens")
    per_turn = mt.get("max_tokens_per_turn")
    turns = _turns(c)
    if turns is not None:
        put("sampling.max_turns", turns, "multi_turn.max_assistant_turns, multi_turn.max_user_turns, "
                                         "interaction.config.max_steps")
    if per_turn is not None or total_new is not None:
        n = min(_int(k, v) for k, v in (("multi_turn.max_tokens_per_turn", per_turn),
                                         ("max_new_tokens", total_new)) if v is not None)
        put("sampling.max_new_tokens", n, "multi_turn.max_tokens_per_turn, max_new_tokens")
        prompt = c.get("max_prompt_tokens")
        prompt = DEFAULT_PROMPT_TOKENS if prompt is None else _int("max_prompt_tokens", prompt)
        budget = _int("max_new_tokens", total_new) if total_new is not None else n * (turns or 1)
        put("sampling.max_total_tokens", prompt + budget, "max_prompt_tokens, max_new_tokens")
    elif c.get("max_prompt_tokens") is not None:
        prompt = _int("max_prompt_tokens", c["max_prompt_tokens"])
        put("sampling.max_total_tokens", prompt + JobSpec().sampling.max_new_tokens * (turns or 1),
            "max_prompt_tokens")


def _turns(c: dict[str, Any]) -> int | None:
    """Assistant turns of an episode: upstream's max_assistant_turns, capped by
    max_user_turns + 1 (an env turn follows every assistant turn but the last; 0 =
    single turn) and the interaction's max_steps."""
    mt = c.get("multi_turn") or {}
    caps = []
    if mt.get("max_assistant_turns") is not None:
        caps.append(_int("multi_turn.max_assistant_turns", mt["max_assistant_turns"]))
    if mt.get("max_user_turns") is not None:
        caps.append(_int("multi_turn.max_user_turns", mt["max_user_turns"]) + 1)
    steps = ((c.get("interaction") or {}).get("config") or {}).get("max_steps")
    if steps is not None:
        caps.append(_int("interaction.config.max_steps", steps))
    return min(caps) if caps else None


def _adv_estimator(c: dict[str, Any], put) -> None:
    est = c.get("adv_estimator")
    if est is None:
        return
    if est not in ADVANTAGE:
        raise ConfigError("adv_estimator", f"{est!r} is not one of {sorted(ADVANTAGE)}")
    estimator, advantage = ADVANTAGE[est]
    put("advantage_estimator", estimator, "adv_estimator")
    put("advantage", advantage, "adv_estimator")
    if est == "gae":  # PPO with a critic: upstream's server samples one episode a prompt whatever rollout_n says
        if c.get("rollout_n") not in (None, 1):
            log.info("adv_estimator 'gae': rollout_n %s -> 1, as upstream's server sets it", c["rollout_n"])
        put("group_size", 1, "adv_estimator")


def _lora(c: dict[str, Any], put, ignored: dict[str, str]) -> None:
    lora = c.get("lora") or {}
    rank = _int("lora.lora_rank", lora.get("lora_rank") or 0)
    put("lora_rank", rank, "lora.lora_rank")
    for key in ("exclude_modules", "lora_adapter_path"):
        if lora.get(key):
            raise ConfigError(f"lora.{key}", "not supported here: a job's LoRA adapter starts fresh on "
                              "lora_target_modules")
    if rank > 0:
        if lora.get("lora_alpha") is not None:
            put("lora_alpha", _int("lora.lora_alpha", lora["lora_alpha"]), "lora.lora_alpha")
        if lora.get("target_modules"):
            put("lora_target_modules", _modules("lora.target_modules", lora["target_modules"]),
                "lora.target_modules")
    elif lora:
        ignored.update({f"lora.{k}": "lora_rank is 0: every parameter is trained" for k, v in lora.items()
                        if k not in ("lora_rank", "exclude_modules", "lora_adapter_path") and v is not None})
    if rank > 0 and lora.get("lr"):
        put("lr", float(lora["lr"]), "lora.lr")
    else:
        put("lr", UPSTREAM_LR, "(no lora.lr: upstream's default actor lr)")


def _kl(c: dict[str, Any], put, ignored: dict[str, str]) -> None:
    kl = c.get("kl") or {}
    loss, in_reward = bool(kl.get("use_kl_loss")), bool(kl.get("use_kl_in_reward"))
    if loss and in_reward:
        raise ConfigError("kl", "use_kl_loss and use_kl_in_reward both on: here the KL term is one or the other")
    if not (loss or in_reward):
        if kl:
            ignored["kl"] = "neither use_kl_loss nor use_kl_in_reward is on"
        return
    put("kl_coef", float(kl.get("kl_loss_coef", 0.001)), "kl.kl_loss_coef")
    put("kl_in_reward", in_reward, "kl.use_kl_in_reward")
    kind = kl.get("kl_loss_type")
    if kind is not None:
        if kind not in KL_ESTIMATOR:
            raise ConfigError("kl.kl_loss_type", f"{kind!r} is not one of {sorted(KL_ESTIMATOR)}")
        put("kl_estimator", KL_ESTIMATOR[kind], "kl.kl_loss_type")


def _interaction(c: dict[str, Any], put, ignored: dict[str, str], env: str | None) -> None:
    inter = c.get("interaction") or {}
    name = env or inter.get("name")
    if name:
        put("env", env_name(str(name)), "interaction.name")
    if inter.get("class_path"):
        ignored["interaction.class_path"] = "upstream's server-side interaction class; here the game class " \
                                            "itself is served"
    for key, value in (inter.get("config") or {}).items():
        if key == "observation_template" and value not in (None, "{observation}"):
            ignored[f"interaction.config.{key}"] = ("not sent with the job: the game served from this process "
                                                   "(GameEnvironment) formats each step's observation with it")
        elif key != "max_steps" and value is not None:
            ignored[f"interaction.config.{key}"] = _INTERACTION_CONFIG
    for key in ("weave_project", "experiment_name"):
        if (c.get("multi_turn") or {}).get(key) is not None:
            ignored[f"multi_turn.{key}"] = "Weave tracing is upstream's"


def env_name(name: str) -> str:
    """`name` as a served env name ([a-z0-9][a-z0-9_-]{0,62}): lower-cased, other
    characters replaced by "-"."""
    out = "".join(ch if ch.isascii() and (ch.isalnum() or ch in "_-") else "-" for ch in name.lower())
    out = out.lstrip("_-")[:63]
    return out or "env"
