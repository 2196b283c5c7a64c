"""Per-token policy surrogates, registered once: what GRPO jobs (`surrogate` in the job
spec, loss.policy_loss) and the Tinker API's `forward_backward(loss_fn=...)`
(tinker_losses.datum_loss) both compute.

A surrogate maps, per token t (any shape, all of the same):
  logp       log pi(y_t), with gradient
  log_ratio  log pi(y_t) - log pi_old(y_t) (gspo: the sequence's mean, repeated), with gradient
  adv        the advantage A_t (cross_entropy: the token's weight)
  p          SurrogateParams: the ratio bounds [low, high] (floats or tensors broadcast
             to the tokens), dual_clip, beta
to (loss_t, clipped_t): the token's loss (to be masked and aggregated by the caller) and
a bool tensor of the tokens its clip acted on (all False for an unclipped surrogate).

A new surrogate is one function under `@surrogate("name", clipped=...)` and one test
(tests/unit/test_surrogates.py). Sources per function; the Tinker API's definitions
are at https://tinker-docs.thinkingmachines.ai/losses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch


class SurrogateParams(NamedTuple):
    """low, high: the ratio's bounds (e.g. 1 - clip_range, 1 + clip_range_high), floats
    or tensors broadcastable to the tokens; dual_clip: c > 1 bounds a negative-advantage
    token's PPO loss by -c A (0 = off); beta: DRO's quadratic penalty weight.
    stable_reinforce only: is_threshold, C, the cap of a token's importance weight;
    seq_log_ratio, per token the mean log ratio of the sampled sequence it belongs to
    (the log of the sequence's geometric-mean ratio, repeated; None: each token is its
    own sequence)."""

    low: float | torch.Tensor = 0.8
    high: float | torch.Tensor = 1.2
    dual_clip: float = 0.0
    beta: float = 0.0
    is_threshold: float = 2.0
    seq_log_ratio: torch.Tensor | None = None


Surrogate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, SurrogateParams],
                     tuple[torch.Tensor, torch.Tensor]]
SURROGATES: dict[str, Surrogate] = {}
CLIPPED: set[str] = set()  # the surrogates that read p.low / p.high


def surrogate(name: str, clipped: bool = False) -> Callable[[Surrogate], Surrogate]:
    """Register `fn` under `name` (raises ValueError for a name taken twice)."""
    def register(fn: Surrogate) -> Surrogate:
        if name in SURROGATES:
            raise ValueError(f"surrogate {name!r} is registered twice")
        SURROGATES[name] = fn
        if clipped:
            CLIPPED.add(name)
        return fn
    return register


def get(name: str) -> Surrogate:
    """The surrogate `name`. Raises ValueError naming the registered ones."""
    try:
        return SURROGATES[name]
    except KeyError:
        raise ValueError(f"surrogate must be one of {sorted(SURROGATES)}, got {name!r}") from None


def _none(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like, dtype=torch.bool)


def _bounds(p: SurrogateParams, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """p.low and p.high as tensors of `like`'s dtype and device."""
    return (torch.as_tensor(p.low, dtype=like.dtype, device=like.device),
            torch.as_tensor(p.high, dtype=like.dtype, device=like.device))


@surrogate("ppo", clipped=True)
def ppo(logp, log_ratio, adv, p):
    """-min(r A, clip(r, low, high) A), r = exp(log_ratio); with dual_clip c > 1, at
    most -c A where A < 0. clipped: the clipped term won the min (the token's gradient
    is zero; verl's pg_clipfrac). Schulman et al. 2017, arXiv 1707.06347 eq. 7; dual
    clip, Ye et al. 2020, arXiv 1912.09729 §3.1."""
    ratio = torch.exp(log_ratio)
    low, high = _bounds(p, ratio)
    unclipped = ratio * adv
    clipped = torch.minimum(torch.maximum(ratio, low), high) * adv
    loss = -torch.minimum(unclipped, clipped)
    if p.dual_clip:
        loss = torch.where(adv < 0, torch.minimum(loss, -p.dual_clip * adv), loss)
    return loss, (clipped < unclipped).detach()


@surrogate("gspo", clipped=True)
def gspo(logp, log_ratio, adv, p):
    """GSPO-token: PPO's clip on the sequence ratio s = exp(mean_t log r_t) (the caller
    passes that mean, repeated, as log_ratio); each token's ratio takes s's value with
    the gradient of its own log pi, s_t = sg(s) pi(y_t) / sg(pi(y_t)), so per-token
    advantages still work (with one advantage per sequence, GSPO's own gradient). A
    whole sequence is clipped or kept. clipped: as ppo's. Zheng et al. 2025, arXiv
    2507.18071 eq. 7 (GSPO) and §4.3 (GSPO-token); Tinker's `gspo` loss."""
    return ppo(logp, log_ratio.detach() + logp - logp.detach(), adv, p)


@surrogate("cispo", clipped=True)
def cispo(logp, log_ratio, adv, p):
    """-sg(clip(r, low, high)) A log pi: the clipped ratio is a coefficient, never
    differentiated, so every token keeps a gradient. clipped: r outside [low, high].
    MiniMax-M1, arXiv 2506.13585 eq. 4."""
    r = torch.exp(log_ratio.detach())
    low, high = _bounds(p, r)
    return -(torch.minimum(torch.maximum(r, low), high) * adv * logp), (r < low) | (r > high)


@surrogate("importance_sampling")
def importance_sampling(logp, log_ratio, adv, p):
    """-r A, unclipped: the policy gradient corrected by the importance ratio
    (REINFORCE with importance weights; Tinker's `importance_sampling`)."""
    loss = -(torch.exp(log_ratio) * adv)
    return loss, _none(loss)


@surrogate("dro")
def dro(logp, log_ratio, adv, p):
    """-A log pi + beta/2 (log pi - log pi_old)^2: direct reward optimization's
    quadratic penalty instead of a clip, on every token. Richemond et al. 2024,
    arXiv 2405.19107; Kimi k1.5, arXiv 2501.12599 §2.3.2."""
    loss = -(adv * logp) + 0.5 * p.beta * log_ratio.square()
    return loss, _none(loss)


@surrogate("stable_reinforce", clipped=True)
def stable_reinforce(logp, log_ratio, adv, p):
    """-M sg(min(r, C)) A log pi: REINFORCE whose importance weight r = pi / mu (mu the
    sampler's probability) is truncated at C = p.is_threshold and never differentiated,
    and whose whole sequence is masked (M = 0) when its geometric-mean ratio
    g = exp(p.seq_log_ratio) leaves the trust region [p.low, p.high]. clipped: tokens
    masked or truncated.

    This is OpenTinker's, not Thinking Machines': Tinker's `stable_reinforce` page
    (https://tinker-docs.thinkingmachines.ai/tinker/losses/stable-reinforce/) does not
    publish its formula. Ours combines two published off-policy stabilizers: token-level
    truncated importance sampling (TIS; Yao et al. 2025, "Your Efficient RL Framework
    Secretly Brings You Off-Policy RL Training"; C = 2 as in verl's rollout correction)
    and geometric sequence masking (Geo-Mask; Liu & Li et al. 2025, "When Speed Kills
    Stability: Demystifying RL Collapse from the Training-Inference Mismatch", part 3: a
    per-token trust region on the length-normalized ratio), on the REINFORCE gradient
    (Williams 1992) as in the truncated-IS actor-critics (IMPALA's V-trace, Espeholt et
    al. 2018, arXiv 1802.01561 eq. 1: rho = min(rho_bar, pi / mu))."""
    r = torch.exp(log_ratio.detach())
    seq = p.seq_log_ratio.detach() if p.seq_log_ratio is not None else log_ratio.detach()
    g = torch.exp(seq)
    low, high = _bounds(p, g)
    masked = (g < low) | (g > high)
    w = r.clamp(max=p.is_threshold)
    loss = torch.where(masked, torch.zeros_like(logp), -(w * adv * logp))
    return loss, masked | (r > p.is_threshold)


@surrogate("cross_entropy")
def cross_entropy(logp, log_ratio, adv, p):
    """-w log pi, with the token weight w in `adv`: supervised learning (w = 1 on the
    target tokens), or REINFORCE without a ratio when w is an advantage (Williams 1992)."""
    loss = -(adv * logp)
    return loss, _none(loss)
