"""PPO with a learned critic: generalized advantage estimation over an episode's policy
tokens, the critic's clipped value loss and its statistics. Pure: lists and torch
tensors in, no engine (critic.py runs the critic; step.plan_step calls gae_advantages).

Token alignment: per-episode lists here are aligned with Trajectory.token_ids (index k
is token k); Batch tensors are target-aligned (column t describes token t + 1, see
batching.py). The critic's value of token k is its output at position k - 1, the state
the policy was in when it sampled token k.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from opentinker.schemas import Trajectory
from opentinker.services.learner.loss import batch_whitening


def gae(rewards: Sequence[float], values: Sequence[float], gamma: float, lam: float) -> tuple[list[float], list[float]]:
    """Generalized advantage estimates and returns of one episode's policy tokens.

    rewards, values: [n] the reward received after policy token k and the critic's value
    of the state before it, k in order over the episode's policy tokens only (the
    environment's tokens between turns are no actions: the next action's value follows
    the last one directly, as verl's masked GAE skips response_mask 0). Returns
    (advantages [n], returns [n]):
        delta_k = r_k + gamma * V_{k+1} - V_k          (V_{n} = 0: the episode ended)
        A_k     = delta_k + gamma * lam * A_{k+1}
        R_k     = A_k + V_k                            (the critic's target)
    Source: Schulman et al. 2016, "High-Dimensional Continuous Control Using
    Generalized Advantage Estimation", arXiv 1506.02438 eq. 16; verl's
    core_algos.compute_gae_advantage_return. Raises ValueError when the lengths differ.
    """
    if len(rewards) != len(values):
        raise ValueError(f"{len(rewards)} rewards for {len(values)} values")
    adv = [0.0] * len(rewards)
    next_value = last = 0.0
    for k in range(len(rewards) - 1, -1, -1):
        delta = float(rewards[k]) + gamma * next_value - float(values[k])
        last = delta + gamma * lam * last
        adv[k] = last
        next_value = float(values[k])
    return adv, [a + float(v) for a, v in zip(adv, values)]


def token_rewards(traj: Trajectory, bonus: float = 0.0, token_bonus: Sequence[float] | None = None) -> list[float]:
    """[len(token_ids)] the episode's rewards placed on its policy tokens: each turn's
    reward on the turn's last policy token, the rest of the episode's return
    (Trajectory.reward less the turns' sum; all of it for an episode without turns) and
    `bonus` (DAPO's overlong penalty: step.reward_bonus) on the episode's last policy
    token, as verl's token_level_rewards hold the score on the last response token; plus
    `token_bonus` [len(token_ids)] (the KL-in-reward penalty of each token) on each
    policy token. A turn without a policy token gives its reward to the policy token
    before it (else the episode's first). All 0 for an episode without a policy token.
    Raises ValueError when token_bonus's length is not the episode's."""
    n = len(traj.token_ids)
    if token_bonus is not None and len(token_bonus) != n:
        raise ValueError(f"{len(token_bonus)} token bonuses for {n} tokens")
    out = [0.0] * n
    policy = [k for k in range(1, n) if traj.loss_mask[k]]
    if not policy:
        return out
    if token_bonus is not None:
        for k in policy:
            out[k] += float(token_bonus[k])
    placed = 0.0
    for turn in traj.turns:
        before = [k for k in policy if k < turn.gen_end]
        out[before[-1] if before else policy[0]] += turn.reward
        placed += turn.reward
    out[policy[-1]] += traj.reward - placed + bonus
    return out


class CriticTargets(NamedTuple):
    """A step's GAE outputs, per episode aligned with token_ids (0 off the policy tokens
    and for an excluded episode): advantages (whitened), returns and the critic's values
    they were computed from (the value loss's V_old)."""

    advantages: list[list[float]]
    returns: list[list[float]]
    values: list[list[float]]


def gae_targets(trajs: Sequence[Trajectory], values: Sequence[Sequence[float]], excluded: Sequence[bool],
                gamma: float, lam: float, bonus: Sequence[float] | None = None,
                token_bonus: Sequence[Sequence[float]] | None = None) -> CriticTargets:
    """GAE (gae) over each trained episode's policy tokens, then the advantages whitened
    over every trained policy token of the step ((A - mean) / std, loss.batch_whitening;
    verl's masked_whiten of GAE advantages, OpenRLHF's advantage normalization). Returns
    are computed before the whitening.

    trajs: [n] episodes; values: [n] the critic's value of each token (aligned with
    token_ids, as critic.token_values gives them); excluded: [n] True for an episode that
    does not train (its lists are 0); bonus: [n] added to each episode's last reward,
    token_bonus: [n][len(token_ids)] to each policy token's (token_rewards). Raises
    ValueError when a length differs from its episode's.
    """
    n = len(trajs)
    bonus = list(bonus) if bonus is not None else [0.0] * n
    if not (len(values) == len(excluded) == len(bonus) == n) or (token_bonus is not None and len(token_bonus) != n):
        raise ValueError(f"{n} episodes, {len(values)} values, {len(excluded)} excluded, {len(bonus)} bonuses, "
                         f"{'no' if token_bonus is None else len(token_bonus)} token bonuses")
    adv, ret, val = [], [], []
    for i, (t, v, ex) in enumerate(zip(trajs, values, excluded)):
        m = len(t.token_ids)
        if len(v) != m:
            raise ValueError(f"episode {i}: {len(v)} values for {m} tokens")
        a_i, r_i, v_i = [0.0] * m, [0.0] * m, [0.0] * m
        if not ex:
            policy = [k for k in range(1, m) if t.loss_mask[k]]
            rewards = token_rewards(t, bonus[i], None if token_bonus is None else token_bonus[i])
            a, r = gae([rewards[k] for k in policy], [v[k] for k in policy], gamma, lam)
            for k, a_k, r_k in zip(policy, a, r):
                a_i[k], r_i[k], v_i[k] = a_k, r_k, float(v[k])
        adv.append(a_i)
        ret.append(r_i)
        val.append(v_i)
    trained = [a[k] for t, a, ex in zip(trajs, adv, excluded) if not ex for k in range(1, len(a)) if t.loss_mask[k]]
    mean, rstd = batch_whitening(trained, [1.0] * len(trained))
    adv = [a if ex else [(x - mean) * rstd if k and t.loss_mask[k] else 0.0 for k, x in enumerate(a)]
           for t, a, ex in zip(trajs, adv, excluded)]
    return CriticTargets(adv, ret, val)


class ValueLossOut(NamedTuple):
    """value_loss's answer: the weighted loss (a scalar with gradient) and, summed over
    the policy tokens for the step's statistics, the unclipped squared error's half
    (`error_sum`), the tokens whose clipped term was the larger (`clipped_sum`), the
    predictions (`value_sum`) and the token count."""

    loss: torch.Tensor
    error_sum: float
    clipped_sum: float
    value_sum: float
    tokens: float


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, loss_mask: torch.Tensor,
               clip: float, weights: torch.Tensor) -> ValueLossOut:
    """PPO's clipped value loss.

    values: [B, T] the critic's predictions (with gradient); old_values, returns: [B, T]
    the values the step's advantages were computed from and their GAE returns;
    loss_mask: [B, T] 1 on policy tokens; weights: [B] each sequence's weight
    (loss.aggregation_weights). Per token
        l = 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2)
    (eps = `clip`; 0: the unclipped 0.5 (V - R)^2), and loss = sum_{b,t} w_b l_bt mask_bt.
    Sources: the PPO2 baseline's value clipping (Dhariwal et al. 2017, OpenAI
    Baselines); verl's core_algos.compute_value_loss (cliprange_value); Engstrom et al.
    2020, arXiv 2005.12729 §3 on its effect. Values are computed in float32.
    """
    values = values.float()
    keep = loss_mask > 0
    err = (values - returns) ** 2
    if clip > 0:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        err_clipped = (clipped - returns) ** 2
        per_token = 0.5 * torch.maximum(err, err_clipped)
        clipped_sum = float(((err_clipped > err) & keep).sum())
    else:
        per_token = 0.5 * err
        clipped_sum = 0.0
    per_token = torch.where(keep, per_token, 0.0)
    loss = (per_token * weights.unsqueeze(1)).sum()
    with torch.no_grad():
        return ValueLossOut(loss, float(torch.where(keep, 0.5 * err, 0.0).sum()), clipped_sum,
                            float(torch.where(keep, values, 0.0).sum()), float(keep.sum()))


def explained_variance(values: torch.Tensor, returns: torch.Tensor, loss_mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over the policy tokens (1: the critic predicts the returns,
    0: no better than their mean, < 0: worse); NaN with fewer than 2 tokens or constant
    returns. values, returns, loss_mask: [B, T] (any shape alike). Source: OpenAI
    Baselines' explained_variance; verl's critic/vf_explained_var."""
    keep = loss_mask > 0
    r, v = returns[keep].double(), values[keep].double()
    if r.numel() < 2:
        return float("nan")
    var_r = float(r.var(unbiased=False))
    return float("nan") if var_r == 0 else 1.0 - float((r - v).var(unbiased=False)) / var_r
