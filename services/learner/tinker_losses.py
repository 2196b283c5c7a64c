"""Tinker's built-in losses (`forward_backward(data, loss_fn, loss_fn_config)`) on one
datum: the learner's token logprobs and the datum's `loss_fn_inputs` -> a summed loss
and its metrics. Pure: no I/O, no model; the caller computes the logprobs.

Shapes: N is the datum's model-input length. Every input is [N] and aligned with the
targets: position i predicts target_tokens[i]. `lp` [N] float32 is the current
policy's logprob of target_tokens[i], with gradient; `q` is the `logprobs` input (the
sampler's logprob of the same token), A the `advantages` input, r = exp(lp - q).

    cross_entropy        L = -sum_i lp_i * w_i                  (w may be negative)
    importance_sampling  L = -sum_i r_i * A_i
    ppo                  L = -sum_i min(r_i * A_i, clip(r_i, low, high) * A_i)
    gspo                 ppo with s_i = sg(s) * exp(lp_i - sg(lp_i)) for r_i, where
                         log s = mean of (lp_j - q_j) over the tokens j of the mask M
    cispo                L = -sum_i sg(clip(r_i, low, high)) * lp_i * A_i
    dro                  L = -sum_i (lp_i * A_i - 0.5 * beta * (lp_i - q_i)^2)
    stable_reinforce     L = -sum_i M_s(i) * sg(min(r_i, C)) * A_i * lp_i over the sampled
                         positions i, with r_i = exp(lp_i - mu_i) against the sampler's
                         logprob mu_i *as recorded by the server* (not the `logprobs`
                         input), and M_s = 0 for a sampled sequence s whose geometric-mean
                         ratio exp(mean over its positions of lp - mu) leaves [low, high]

The per-token formulas are the registry's (surrogates.py), which GRPO jobs use too
(`surrogate` in the job spec); this module adds Tinker's inputs, bounds and metrics.
Losses are sums over tokens, not means, as in Tinker. `low`/`high` are the ratio
bounds themselves (config keys clip_low_threshold / clip_high_threshold, e.g. 0.8 and
1.2), not epsilons. Defaults: ppo 0.8 / 1.2 ("epsilon fixed to 0.2"), cispo 0.0 / 4.0
(a one-sided clip, per Tinker's CISPO page), gspo 0.9997 / 1.0004 (GSPO's paper clips
at 3e-4 and 4e-4; Tinker's page gives no default); dro's beta has no documented default,
so it is required.

stable_reinforce is OpenTinker's formula, not Tinker's (its page does not publish one;
surrogates.stable_reinforce has the sources): C is the config key `is_threshold`
(default 2.0, at least 1), [low, high] the sequence trust region (clip_low_threshold /
clip_high_threshold, default 0.9 / 1.1). Its inputs `recorded_logprobs` [N] (mu at each
sampled target position, 0 elsewhere) and `recorded_sequence` [N] int (which sampled
sequence of the datum each target position reproduces, 0, 1, ...; -1: not a sampled
token) are the tinker service's, from the datum's provenance and what it recorded when
sampling (services/tinker/provenance.py), never a client's; a position that is not a
sampled token trains nothing, whatever its advantage. gspo's mask M is the `sequence_ratio_mask` input (nonzero = in the
ratio), or, without it, the tokens with A != 0 (the sampled ones: a prompt position's
`logprobs` is not a sampler's logprob). Per-token bounds may also come as [N]
loss_fn_inputs arrays (the SDK's datum.py lists clip_low_threshold / clip_high_threshold as input keys); an array wins
over the config value of the same name.

Sources: Tinker docs, https://tinker-docs.thinkingmachines.ai/losses and the per-loss
pages under https://tinker-docs.thinkingmachines.ai/tinker/losses/ (ppo, cispo, dro);
PPO: Schulman et al. 2017, arXiv 1707.06347 eq. 7; GSPO: Zheng et al. 2025, arXiv
2507.18071 (the GSPO-token form, as Tinker implements it); CISPO: MiniMax-M1, arXiv
2506.13585 eq. 4; DRO: Richemond et al. 2024, arXiv 2405.19107 (and Kimi k1.5, arXiv 2501.12599).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np
import torch

from opentinker.schemas.tinker import RECORDED_INPUTS
from opentinker.services.learner import surrogates
from opentinker.services.learner.surrogates import SurrogateParams

LOSS_FNS = ("cross_entropy", "importance_sampling", "ppo", "gspo", "cispo", "dro",
            "stable_reinforce")  # each in surrogates.SURROGATES


_RL_INPUTS = ("target_tokens", "logprobs", "advantages")
REQUIRED_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": _RL_INPUTS,
    "ppo": _RL_INPUTS,
    "gspo": _RL_INPUTS,
    "cispo": _RL_INPUTS,
    "dro": _RL_INPUTS,
    "stable_reinforce": ("target_tokens", "advantages", *RECORDED_INPUTS),
}

CLIP_KEYS = ("clip_low_threshold", "clip_high_threshold")
# Tinker's own RL example Datum carries `weights` beside the RL inputs, yet none of the
# RL formulas reads it: accepted and ignored, as Tinker does.
OPTIONAL_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": (),
    "importance_sampling": ("weights",),
    "ppo": ("weights", *CLIP_KEYS),
    "gspo": ("weights", "sequence_ratio_mask", *CLIP_KEYS),
    "cispo": ("weights", *CLIP_KEYS),
    "dro": ("weights",),
    "stable_reinforce": ("logprobs", "weights"),
}

CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "cross_entropy": (),
    "importance_sampling": (),
    "ppo": CLIP_KEYS,
    "gspo": CLIP_KEYS,
    "cispo": CLIP_KEYS,
    "dro": ("beta",),
    "stable_reinforce": (*CLIP_KEYS, "is_threshold"),
}

# (clip_low_threshold, clip_high_threshold) when neither config nor inputs give one.
CLIP_DEFAULTS: dict[str, tuple[float, float]] = {"ppo": (0.8, 1.2), "gspo": (1 - 3e-4, 1 + 4e-4),
                                                 "cispo": (0.0, 4.0), "stable_reinforce": (0.9, 1.1)}
IS_THRESHOLD_DEFAULT = 2.0  # stable_reinforce's C (verl's rollout_is_threshold default; Yao et al. 2025)


class LossInputError(ValueError):
    """A forward_backward request the losses cannot take: an unsupported loss_fn, a
    missing, unknown or ill-shaped loss_fn_inputs entry, or a bad loss_fn_config key
    or value. The message names the field."""


def check_inputs(loss_fn: str, inputs: Mapping[str, np.ndarray], n_tokens: int,
                 config: Mapping[str, float | str] | None = None) -> None:
    """Validate one datum's request before any torch work, so the front end can refuse it.

    inputs: loss_fn_inputs, each array-like of shape [n_tokens]; target_tokens integer,
    the others real and finite. n_tokens: the datum's model-input length N.
    config: loss_fn_config (None for none).
    Raises LossInputError naming the loss, input or config key at fault: loss_fn not in
    LOSS_FNS; an input missing, not in REQUIRED_INPUTS + OPTIONAL_INPUTS, not 1-D of
    length n_tokens, of the wrong kind or non-finite; target_tokens negative; a config
    key the loss does not take, a value that is not a finite number, dro without beta
    or with beta < 0; a clip_low_threshold above its clip_high_threshold.
    """
    cfg = _checked_config(loss_fn, config)
    _check_keys_and_shapes(loss_fn, {key: np.shape(value) for key, value in inputs.items()}, n_tokens)
    arrays = {key: np.asarray(value) for key, value in inputs.items()}
    for key, array in arrays.items():
        if key in ("target_tokens", "recorded_sequence"):
            if array.dtype.kind not in "iu":
                raise LossInputError(f"loss_fn_inputs[{key!r}]: dtype {array.dtype} is not an integer type")
            lowest = 0 if key == "target_tokens" else -1
            if array.size and array.min() < lowest:
                raise LossInputError(f"loss_fn_inputs[{key!r}]: " + ("token ids must be >= 0" if lowest == 0 else
                                                                       "sequence indices must be >= -1"))
        elif array.dtype.kind not in "iuf":
            raise LossInputError(f"loss_fn_inputs[{key!r}]: dtype {array.dtype} is not a real number type")
        elif not np.isfinite(array).all():
            raise LossInputError(f"loss_fn_inputs[{key!r}]: contains NaN or infinity")
    if loss_fn in CLIP_DEFAULTS:
        _clip_bounds(loss_fn, cfg, arrays, lambda v: np.asarray(v, dtype=np.float64))


def datum_loss(loss_fn: str, lp: torch.Tensor, inputs: Mapping[str, torch.Tensor],
               config: Mapping[str, float | str] | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """One datum's Tinker loss (a sum over its tokens) and metrics.

    lp: [N] float, the policy's logprob of target_tokens[i] at each position, with grad.
    inputs: loss_fn_inputs as tensors (or arrays), each [N]; cast to lp's dtype/device.
    config: loss_fn_config (None for none); see the module docstring for each loss.
    Returns (loss, metrics): loss a 0-d tensor in lp's graph; metrics plain floats for
    this datum, for the caller to suffix and reduce:
      loss            the loss value, every loss_fn
      active_tokens   RL losses: tokens with A != 0 (the others add nothing but dro's penalty)
      ratio_mean      RL losses: mean r over active tokens (gspo: its sequence ratio s),
                      1.0 (on-policy) when none is active so that a mean over datums
                      stays finite
      clipped_tokens  ppo, gspo: active tokens whose clipped term won the min (zero
                      gradient); cispo: active tokens whose ratio was clamped
      penalty         dro: 0.5 * beta * sum_i (lp_i - q_i)^2
    Raises LossInputError as check_inputs does for the loss name, config and the inputs'
    names and shapes (dtype and finiteness are check_inputs' job), and ValueError if lp
    is not 1-D.
    """
    cfg = _checked_config(loss_fn, config)
    if lp.dim() != 1:
        raise ValueError(f"lp must be [N], got shape {list(lp.shape)}")
    _check_keys_and_shapes(loss_fn, {key: tuple(value.shape) for key, value in inputs.items()}, lp.shape[0])

    def as_lp(value) -> torch.Tensor:
        return torch.as_tensor(value, dtype=lp.dtype, device=lp.device)

    if loss_fn == "cross_entropy":
        loss_t, _ = surrogates.get(loss_fn)(lp, torch.zeros_like(lp), as_lp(inputs["weights"]), SurrogateParams())
        loss = loss_t.sum()
        return loss, {"loss": float(loss.detach())}

    if loss_fn == "stable_reinforce":
        return _stable_reinforce(lp, inputs, cfg, as_lp)
    q, adv = as_lp(inputs["logprobs"]), as_lp(inputs["advantages"])
    log_ratio = lp - q
    active = adv != 0
    if loss_fn == "gspo":  # one ratio for the sequence: the mean log ratio over M, repeated
        in_ratio = as_lp(inputs["sequence_ratio_mask"]) != 0 if "sequence_ratio_mask" in inputs else active
        seq = log_ratio[in_ratio].mean() if bool(in_ratio.any()) else log_ratio.sum() * 0.0
        log_ratio = seq.expand_as(lp)
    n_active = int(active.sum())
    ratio = log_ratio.detach().exp()
    metrics = {"active_tokens": float(n_active),
               "ratio_mean": float(ratio[active].mean()) if n_active else 1.0}
    low, high = _clip_bounds(loss_fn, cfg, inputs, as_lp) if loss_fn in CLIP_DEFAULTS else (0.0, 0.0)
    loss_t, clipped = surrogates.get(loss_fn)(lp, log_ratio, adv, SurrogateParams(low, high, beta=cfg.get("beta", 0.0)))
    loss = loss_t.sum()
    if loss_fn in surrogates.CLIPPED:
        metrics["clipped_tokens"] = float((clipped & active).sum())
    if loss_fn == "dro":  # the penalty covers every position, A = 0 or not, as in Tinker's formula
        metrics["penalty"] = float((loss_t + adv * lp).detach().sum())
    metrics["loss"] = float(loss.detach())
    return loss, metrics


def _stable_reinforce(lp: torch.Tensor, inputs: Mapping, cfg: Mapping[str, float],
                      as_lp: Callable) -> tuple[torch.Tensor, dict[str, float]]:
    """datum_loss of stable_reinforce (module docstring): the per-sequence mean log ratio
    over the sampled positions, then surrogates.stable_reinforce. Metrics beside loss,
    active_tokens and ratio_mean: masked_tokens (active tokens of a sequence outside the
    trust region) and truncated_tokens (active tokens kept, their weight capped at C)."""
    mu, adv = as_lp(inputs["recorded_logprobs"]), as_lp(inputs["advantages"])
    seq = torch.as_tensor(inputs["recorded_sequence"], device=lp.device).long()
    sampled = seq >= 0
    adv = torch.where(sampled, adv, 0.0)
    log_ratio = torch.where(sampled, lp - mu, 0.0)
    idx = seq.clamp(min=0)
    with torch.no_grad():
        n = int(idx.max()) + 1 if len(idx) else 0
        lr = log_ratio.detach()
        sums = torch.zeros(n, dtype=lr.dtype, device=lr.device).index_add_(0, idx[sampled], lr[sampled])
        counts = torch.zeros(n, dtype=lr.dtype, device=lr.device).index_add_(0, idx[sampled],
                                                                          torch.ones_like(lr[sampled]))
        seq_log_ratio = torch.where(sampled, (sums / counts.clamp(min=1.0))[idx], 0.0)
    low, high = _clip_bounds("stable_reinforce", cfg, {}, as_lp)
    c = cfg.get("is_threshold", IS_THRESHOLD_DEFAULT)
    loss_t, clipped = surrogates.get("stable_reinforce")(
        lp, log_ratio, adv, SurrogateParams(low, high, is_threshold=c, seq_log_ratio=seq_log_ratio))
    loss = loss_t.sum()
    active = sampled & (adv != 0)
    n_active = int(active.sum())
    with torch.no_grad():
        ratio = log_ratio.detach().exp()
        g = seq_log_ratio.exp()
        masked = (g < low) | (g > high)
    return loss, {"active_tokens": float(n_active),
                  "ratio_mean": float(ratio[active].mean()) if n_active else 1.0,
                  "clipped_tokens": float((clipped & active).sum()),
                  "masked_tokens": float((masked & active).sum()),
                  "truncated_tokens": float((~masked & (ratio > c) & active).sum()),
                  "loss": float(loss.detach())}


def _checked_config(loss_fn: str, config: Mapping[str, float | str] | None) -> dict[str, float]:
    """loss_fn_config -> {key: float}, after checking the loss name, keys and values."""
    if loss_fn not in LOSS_FNS:
        raise LossInputError(f"loss_fn {loss_fn!r} is not supported (supported: {', '.join(LOSS_FNS)})")
    allowed = CONFIG_KEYS[loss_fn]
    cfg: dict[str, float] = {}
    for key, value in (config or {}).items():
        if key not in allowed:
            raise LossInputError(f"loss_fn_config key {key!r} is not accepted by {loss_fn!r} "
                                 f"(accepted: {', '.join(allowed) or 'none'})")
        # bool is an int to Python, but True as a clip bound is a mistake, not 1.0.
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise LossInputError(f"loss_fn_config[{key!r}]: {value!r} is not a finite number")
        cfg[key] = float(value)
    if cfg.get("is_threshold", IS_THRESHOLD_DEFAULT) < 1:
        raise LossInputError(f"loss_fn_config['is_threshold']: {cfg['is_threshold']} is below 1 (it caps a "
                             "token's importance weight, e.g. 2.0)")
    if loss_fn == "dro":
        if "beta" not in cfg:
            raise LossInputError("loss_fn 'dro' needs loss_fn_config['beta'], the weight of its quadratic "
                                 "penalty (e.g. 0.05): Tinker documents no default")
        if cfg["beta"] < 0:
            raise LossInputError(f"loss_fn_config['beta']: {cfg['beta']} is negative")
    return cfg


def _check_keys_and_shapes(loss_fn: str, shapes: Mapping[str, tuple[int, ...]], n_tokens: int) -> None:
    """Every required input present, none unknown, each of shape [n_tokens]."""
    required, optional = REQUIRED_INPUTS[loss_fn], OPTIONAL_INPUTS[loss_fn]
    for key in required:
        if key not in shapes:
            raise LossInputError(f"loss_fn {loss_fn!r} needs loss_fn_inputs[{key!r}] "
                                 f"(required: {', '.join(required)})")
    for key, shape in shapes.items():
        if key not in required and key not in optional:
            raise LossInputError(f"loss_fn_inputs[{key!r}] is not an input of {loss_fn!r} "
                                 f"(inputs: {', '.join(required + optional)})")
        if tuple(shape) != (n_tokens,):
            raise LossInputError(f"loss_fn_inputs[{key!r}]: shape {list(shape)} does not match the "
                                 f"{n_tokens} target tokens (expected [{n_tokens}])")


def _clip_bounds(loss_fn: str, cfg: Mapping[str, float], inputs: Mapping, as_array: Callable):
    """(low, high) as arrays of as_array's kind, each [N] or 0-d: an input array, else
    the config value, else the loss's default. Raises LossInputError if low > high."""
    low, high = (as_array(inputs[key]) if key in inputs else as_array(cfg.get(key, default))
                 for key, default in zip(CLIP_KEYS, CLIP_DEFAULTS[loss_fn]))
    if bool((low > high).any()):
        raise LossInputError(f"clip_low_threshold {_show(low)} exceeds clip_high_threshold {_show(high)} "
                             "(they are ratio bounds such as 0.8 and 1.2)")
    return low, high


def _show(bound) -> str:
    """A bound for an error message: the number, or 'per token' with its range."""
    values = np.asarray(bound.tolist(), dtype=np.float64)
    if values.ndim == 0:
        return f"{float(values):g}"
    return f"(per token, {values.min():g}..{values.max():g})"
