"""The GRPO objective as pure torch functions: advantages, token logprobs, the clipped
surrogate with an optional KL penalty, and the statistics the learner reports.

Shapes: B episodes, T positions. Every [B, T] tensor is target-aligned (see
batching.py): column t belongs to the prediction made at position t of token t+1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

ADV_EPS = 1e-6


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """GRPO group-relative advantages A_i = (r_i - mean(r)) / (std(r) + 1e-6).

    rewards: [n_groups, group_size] float -> advantages of the same shape, float32. The
    std is the sample (unbiased) std, as in TRL's GRPOTrainer and verl. A group whose
    std is below ADV_EPS gets exactly 0 for every episode: its rewards are equal (up to
    rounding), so it carries no group-relative signal, and what the formula would give
    there is rounding noise divided by the 1e-6 floor.
    Source: Shao et al. 2024, DeepSeekMath, arXiv 2402.03300, eq. 3 and §4.1.1 (outcome
    supervision). Raises ValueError if rewards is not 2-D with group_size >= 2.
    """
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [n_groups, group_size >= 2], got {tuple(rewards.shape)}")
    rewards = rewards.to(torch.float64)
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=True)
    adv = (rewards - mean) / (std + ADV_EPS)
    return torch.where(std < ADV_EPS, 0.0, adv).to(torch.float32)


def discounted_returns(rewards: Sequence[float], gamma: float) -> list[float]:
    """Per-turn returns R_t = r_t + gamma * R_{t+1} (R past the last turn is 0).

    rewards: [n_turns] -> [n_turns]. Source: Sutton & Barto 2018, eq. 3.9.
    """
    out = [0.0] * len(rewards)
    acc = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        acc = float(rewards[t]) + gamma * acc
        out[t] = acc
    return out


def turn_advantages(turn_rewards: Sequence[Sequence[Sequence[float]]], gamma: float) -> list[list[list[float]]]:
    """Turn-level GRPO advantages (OpenTinker's per-step GRPO).

    turn_rewards: [n_groups][group_size][n_turns_i] per-turn rewards -> advantages of
    the same ragged shape: A_{i,t} = (R_{i,t} - mean_j R_{j,0}) / (std_j R_{j,0} + 1e-6),
    where R_{i,t} is the discounted return of episode i from turn t on and the group
    statistics are those of the episodes' whole returns R_{j,0} (sample std, as
    group_advantages). A turn that earned its episode's return gets the episode's
    advantage; a turn after a reward was already collected is credited only with what
    follows it. With one turn per episode (or gamma = 1 and rewards only on the last
    turn) this is exactly group_advantages. An episode with no turn counts as return 0.

    A group whose std_j R_{j,0} is below ADV_EPS gets 0 on every turn, as in
    group_advantages. Unlike there, the numerator is not bounded by the std: two games
    lost with the same return but with a penalty on different turns have per-turn
    returns that differ while std_j R_{j,0} = 0, and the formula would divide that
    difference by 1e-6 (advantages of 1e5). Such a group has no group-relative signal:
    every episode did equally well.
    Choice of statistics: kept from R_{j,0} only, not pooled over every R_{j,t} of the
    group. Pooling would keep single-turn episodes from matching GRPO exactly, and
    would turn a discount artefact (a longer lost game's early turns are discounted
    less) into signal. The cost: with a small but non-zero std, a later turn's
    |R_{i,t} - mean| / std can exceed the bound (group_size - 1) / sqrt(group_size)
    that episode-level advantages keep; the PPO clip bounds the ratio, not the
    advantage.
    Sources: GTPO, arXiv 2511.17052 (per-turn returns in group-relative advantages);
    OpenTinker's `compute_grpo_per_step_advantage` (statistics from R_0);
    GRPO arXiv 2402.03300 eq. 3.
    Raises ValueError for a group with fewer than 2 episodes.
    """
    out = []
    for group in turn_rewards:
        if len(group) < 2:
            raise ValueError(f"a group needs >= 2 episodes, got {len(group)}")
        returns = [discounted_returns(ep, gamma) for ep in group]
        whole = torch.tensor([r[0] if r else 0.0 for r in returns], dtype=torch.float64)
        mean, std = float(whole.mean()), float(whole.std(unbiased=True))
        if std < ADV_EPS:
            out.append([[0.0] * len(r) for r in returns])
        else:
            out.append([[(r_t - mean) / (std + ADV_EPS) for r_t in r] for r in returns])
    return out


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor,
                   temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob and entropy of each next token under `logits / temperature`.

    logits: [B, T, V] float; input_ids: [B, T] long. Returns (logp, entropy), both
    [B, T] float32, target-aligned: logp[:, t] = log p(input_ids[:, t+1] | <= t); the
    last column is 0. Entropy (nats) is computed without gradient: it is reported,
    not optimized. Dividing by the sampling temperature makes the learner's
    distribution the one the sampler drew from (as TRL's GRPOTrainer does).
    """
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logits = logits[:, :-1].float()
    logp_all = torch.log_softmax(logits, dim=-1)
    targets = input_ids[:, 1:].unsqueeze(-1)
    logp = logp_all.gather(-1, targets).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    pad = logp.new_zeros(logp.shape[0], 1)
    return torch.cat([logp, pad], dim=1), torch.cat([entropy, pad], dim=1)


def k3_kl(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref): exp(ref - logp) - (ref - logp) - 1.

    Shapes: any, elementwise; >= 0, and exactly 0 where the two agree.
    Source: J. Schulman 2020, "Approximating KL Divergence" (k3); used by GRPO,
    arXiv 2402.03300 eq. 4.
    """
    d = logp_ref - logp
    return torch.exp(d) - d - 1.0


class LossOut(NamedTuple):
    """The loss of a (micro-)batch and its token-summed statistics.

    loss: scalar with gradient, already divided by `num_tokens`. The `*_sum` fields are
    sums over the micro-batch's policy tokens (plain floats), so micro-batches add up.
    """

    loss: torch.Tensor
    tokens: float
    clipped_sum: float
    approx_kl_sum: float
    kl_sum: float
    entropy_sum: float


def grpo_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
              loss_mask: torch.Tensor, clip_range: float, num_tokens: float | None = None,
              logp_ref: torch.Tensor | None = None, kl_coef: float = 0.0,
              entropy: torch.Tensor | None = None) -> LossOut:
    """Clipped-surrogate GRPO loss with token-level normalization.

    logp, logp_old (the sampler's logprobs), loss_mask: [B, T]; advantages: [B]
    (broadcast to every policy token of the episode) or [B, T] (per token, for
    turn-level credit); logp_ref, entropy: [B, T] or None.
    Per token: rho = exp(logp - logp_old),
    l = -min(rho * A, clip(rho, 1 - eps, 1 + eps) * A) + kl_coef * k3(logp, logp_ref).
    The loss is sum(l * mask) / num_tokens, where num_tokens defaults to mask.sum();
    pass the whole batch's policy-token count so that micro-batch losses add up to the
    batch's per-token mean.
    Sources: PPO clip, Schulman et al. 2017, arXiv 1707.06347 eq. 7 (eps = clip_range);
    GRPO, arXiv 2402.03300 eq. 3; token-level normalization, DAPO arXiv 2503.14476 §3.3.
    clip fraction counts tokens with |rho - 1| > eps and approx KL is k3 of
    KL(sampler || current), (rho - 1) - log rho (both as in CleanRL's PPO).
    Raises ValueError on mismatched shapes.
    """
    if logp.shape != logp_old.shape or logp.shape != loss_mask.shape:
        raise ValueError(f"logp {tuple(logp.shape)}, logp_old {tuple(logp_old.shape)} and "
                         f"loss_mask {tuple(loss_mask.shape)} must have the same shape")
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(f"advantages must be [{logp.shape[0]}] or {list(logp.shape)}, "
                         f"got {tuple(advantages.shape)}")
    mask = loss_mask.to(logp.dtype)
    keep = mask > 0
    tokens = float(mask.sum())
    denom = float(num_tokens) if num_tokens is not None else max(tokens, 1.0)
    # masked positions may hold anything (padding, even inf/NaN): select, never multiply,
    # so that nothing from them reaches the loss or the gradient
    logp = torch.where(keep, logp, 0.0)
    logp_old = torch.where(keep, logp_old, 0.0)
    ratio = torch.exp(logp - logp_old)
    adv = advantages.to(logp.dtype)
    adv = adv.unsqueeze(1) if adv.dim() == 1 else torch.where(keep, adv, 0.0)
    surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range) * adv)
    per_token = -surrogate
    kl_sum = 0.0
    if logp_ref is not None:
        kl = torch.where(keep, k3_kl(logp, torch.where(keep, logp_ref, 0.0)), 0.0)
        kl_sum = float(kl.detach().sum())
        if kl_coef:
            per_token = per_token + kl_coef * kl
    loss = torch.where(keep, per_token, 0.0).sum() / denom
    with torch.no_grad():
        clipped = ((ratio - 1.0).abs() > clip_range)[keep].sum()
        # samples come from the sampler, so KL(sampler || current) is the one k3 estimates here
        approx_kl = k3_kl(logp_old, logp)[keep].sum()
        ent = entropy[keep].sum() if entropy is not None else torch.zeros(())
    return LossOut(loss, tokens, float(clipped), float(approx_kl), kl_sum, float(ent))
