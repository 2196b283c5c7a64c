"""The policy objective as pure torch functions: advantage estimators, token logprobs,
the clipped surrogate and its variants (clip-higher, dual clip, GSPO's sequence ratio,
the behaviour-policy correction of asynchronous training), KL estimators, loss
aggregation, reward shaping and the learning-rate schedule, and the statistics the
learner reports. Each formula cites its source.

Shapes: B episodes, T positions. Every [B, T] tensor is target-aligned (see
batching.py): column t belongs to the prediction made at position t of token t+1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from opentinker.services.learner import surrogates
from opentinker.services.learner.surrogates import SurrogateParams

ADV_EPS = 1e-6


ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp")


def group_advantages(rewards: torch.Tensor, estimator: str = "grpo") -> torch.Tensor:
    """Group-relative advantages of episode returns.

    rewards: [n_groups, group_size] float -> advantages of the same shape, float32.
    - "grpo": A_i = (r_i - mean(r)) / (std(r) + 1e-6), std the sample (unbiased) std as
      in TRL's GRPOTrainer and verl. Shao et al. 2024, DeepSeekMath, arXiv 2402.03300,
      eq. 3 and §4.1.1 (outcome supervision).
    - "dr_grpo": A_i = r_i - mean(r), no division by the std (which weights easy and
      hard prompts unequally). Liu et al. 2025, "Understanding R1-Zero-like training",
      arXiv 2503.20783 §3.2.
    - "rloo": A_i = r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean(r)), the
      leave-one-out baseline. Kool et al. 2019 (ICLR workshop); Ahmadian et al. 2024,
      arXiv 2402.14740 eq. 7.
    - "reinforce_pp": r_i - mean(r) here; the caller then whitens over every policy
      token of the batch (batch_whitening). REINFORCE++-baseline, Hu et al. 2025, arXiv
      2501.03262.
    A group whose std is below ADV_EPS gets exactly 0 for every episode, whatever the
    estimator: its rewards are equal (up to rounding), so it carries no group-relative
    signal. Raises ValueError if rewards is not 2-D with group_size >= 2 or for an
    unknown estimator.
    """
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [n_groups, group_size >= 2], got {tuple(rewards.shape)}")
    rewards = rewards.to(torch.float64)
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=True)
    return torch.where(std < ADV_EPS, 0.0, _scaled(rewards - mean, std, rewards.shape[1], estimator)).to(torch.float32)


def _scaled(centered, std, group_size: int, estimator: str):
    """(r - mean) -> the estimator's advantage (group_advantages); works on tensors and floats."""
    if estimator == "grpo":
        return centered / (std + ADV_EPS)
    if estimator == "rloo":
        return centered * (group_size / (group_size - 1))
    if estimator in ("dr_grpo", "reinforce_pp"):
        return centered
    raise ValueError(f"advantage estimator must be one of {ESTIMATORS}, got {estimator!r}")


WHITEN_VAR_MIN = 1e-8  # OpenRLHF's var.clamp(min=1e-8) before the rsqrt


def batch_whitening(values: Sequence[float], weights: Sequence[float]) -> tuple[float, float]:
    """REINFORCE++'s global batch normalization as (mean, rstd): A' = (A - mean) * rstd
    whitens the advantages over every policy token of the step.

    values: [n] advantages; weights: [n] how many policy tokens carry each one (an
    episode-level advantage: its episode's policy tokens; a per-token one: 1). mean
    and var are the token-weighted mean and population variance, rstd = 1 / sqrt(max(var,
    1e-8)) (OpenRLHF's clamp): each policy token counts once, so a long episode weighs
    more than a short one. (0.0, 1.0) when no value has a token.
    Sources: Hu et al. 2025, REINFORCE++, arXiv 2501.03262 §3 (the advantage normalized
    by its mean and std over the global batch; "-baseline": the group mean subtracted
    first); OpenRLHF's experience_maker.compute_advantages_and_returns
    ("reinforce", "reinforce_baseline": masked mean and variance over the action tokens
    of all experiences).
    """
    v = torch.tensor(list(values), dtype=torch.float64)
    w = torch.tensor(list(weights), dtype=torch.float64)
    n = float(w.sum())
    if n <= 0:
        return 0.0, 1.0
    mean = float((v * w).sum()) / n
    var = float(((v - mean) ** 2 * w).sum()) / n
    return mean, max(var, WHITEN_VAR_MIN) ** -0.5


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


def turn_advantages(turn_rewards: Sequence[Sequence[Sequence[float]]], gamma: float,
                    estimator: str = "grpo") -> list[list[list[float]]]:
    """Turn-level group-relative advantages, each turn baselined against the same turn
    of the group's other episodes.

    turn_rewards: [n_groups][group_size][n_turns_i] per-turn rewards -> advantages of
    the same ragged shape. R_{i,t} is the discounted return of episode i from turn t on
    (discounted_returns). Turn t of episode i is compared with turn t of the episodes
    that have one, N_t = {j : n_turns_j > t}:
        A_{i,t} = (R_{i,t} - mean_{j in N_t} R_{j,t}) / (std_{j in N_t} R_{j,t} + 1e-6)
    (sample std, as group_advantages), so with one turn per episode this is exactly
    group_advantages. A turn no other episode of the group reached (|N_t| = 1) has no
    comparable turn and takes its episode's turn-0 advantage. A turn index whose
    returns are equal (std below ADV_EPS) gets 0, as a group does in group_advantages.

    Bound: |A_{i,t}| <= (|N_t| - 1) / sqrt(|N_t|) <= (G - 1) / sqrt(G), the most the
    episode-level estimator gives a group of G (a property test checks it). The
    earlier form, per-turn returns over the statistics of the whole returns R_{j,0},
    was unbounded: a seat that won all 4 games of a group at discount 0.9 got +7.9 on
    its last moves (the whole returns differed by the discount only, a tiny std), and
    shaped rewards at discount 1 reached 282.
    Sources: GiGPO, Feng et al. 2025, arXiv 2505.10978 §3.2 (step-level groups of
    comparable steps, there by identical anchor states, here by turn index, with
    discounted returns); GRPO arXiv 2402.03300 eq. 3.
    Other estimators use the same turn groups as group_advantages uses the episode
    group: "dr_grpo" and "reinforce_pp" drop the division by the std; "rloo" takes each
    turn's baseline from the other episodes' turn t.
    Raises ValueError for a group with fewer than 2 episodes or an unknown estimator.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"advantage estimator must be one of {ESTIMATORS}, got {estimator!r}")
    out = []
    for group in turn_rewards:
        if len(group) < 2:
            raise ValueError(f"a group needs >= 2 episodes, got {len(group)}")
        returns = [discounted_returns(ep, gamma) for ep in group]
        # turn 0 of an episode with no turn counts as return 0 (its episode-level value)
        first = [_turn_group([r[0] if r else 0.0 for r in returns], estimator)]
        adv = [[0.0] * len(r) for r in returns]
        for t in range(max(map(len, returns))):
            have = [i for i, r in enumerate(returns) if len(r) > t]
            if len(have) < 2:
                for i in have:
                    adv[i][t] = first[0][i]
                continue
            for i, a in zip(have, _turn_group([returns[i][t] for i in have], estimator)):
                adv[i][t] = a
        out.append(adv)
    return out


def _turn_group(values: Sequence[float], estimator: str) -> list[float]:
    """group_advantages of one group of values (>= 2), in float64, as floats."""
    v = torch.tensor(list(values), dtype=torch.float64)
    std = float(v.std(unbiased=True))
    if std < ADV_EPS:
        return [0.0] * len(values)
    return [float(_scaled(x, std, len(values), estimator)) for x in (v - v.mean()).tolist()]


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor,
                   temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob and entropy of each next token under `logits / temperature`.

    logits: [B, T, V] float; input_ids: [B, T] long. Returns (logp, entropy), both
    [B, T] float32, target-aligned: logp[:, t] = log p(input_ids[:, t+1] | <= t); the
    last column is 0. Entropy (nats) is computed without gradient. Dividing by the
    sampling temperature makes the learner's distribution the one the sampler drew
    from (as TRL's GRPOTrainer does). The learner's training path uses
    selected_logprobs (policy positions only); this full form serves SFT and tests.
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


def selected_logprobs(rows: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                      head: torch.nn.Module | None = None, chunk: int = 512,
                      entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob and entropy of the next token at selected positions only.

    rows: [N, V] logits at the N positions whose next token is trained (the loss
    mask's), or [N, H] final hidden states when `head` (the LM head, H -> V) is given;
    targets: [N] long. Returns (logp, entropy), both [N] float32 (nats). The softmax
    (and the head) run on those N positions only, in chunks of `chunk` positions so
    the [chunk, V] float32 copies bound the peak memory. Entropy carries a gradient
    only with `entropy_grad` (an entropy bonus).
    """
    logps, ents = [], []
    for k in range(0, rows.shape[0], chunk):
        logits = (head(rows[k:k + chunk]) if head is not None else rows[k:k + chunk]).float()
        if temperature > 0 and temperature != 1.0:
            logits = logits / temperature
        logp_all = torch.log_softmax(logits, dim=-1)
        logps.append(logp_all.gather(-1, targets[k:k + chunk].unsqueeze(-1)).squeeze(-1))
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ents.append(-(logp_all.exp() * logp_all).sum(-1))
        del logits, logp_all
    if not logps:
        z = rows.new_zeros(0, dtype=torch.float32)
        return z, z
    return torch.cat(logps), torch.cat(ents)


KL_ESTIMATORS = ("k1", "k2", "k3")


KL_LOG_RATIO_CLAMP = 20.0  # |log pi_ref - log pi| beyond this is clamped before exp (verl's low_var_kl)
KL_K3_CLAMP = 10.0         # and k3 itself to [0, this]


def kl_estimate(logp: torch.Tensor, logp_ref: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled by pi, with
    d = logp_ref - logp: k1 = -d (unbiased, high variance, can be negative),
    k2 = d^2 / 2 (low variance, biased), k3 = exp(d) - d - 1 (unbiased, low variance,
    >= 0; d clamped to +-KL_LOG_RATIO_CLAMP and k3 to KL_K3_CLAMP, as verl's
    low_var_kl, so one token the reference finds e^100 times likelier cannot make the
    loss inf; a token past a clamp adds no gradient). Shapes: any, elementwise; 0
    where the two agree.

    As a loss term the estimators' gradients differ from their values: in expectation
    over tokens sampled by pi, the gradient of k3 is that of KL(pi_ref || pi) (the
    reverse direction), and that of k2 is the gradient of KL(pi || pi_ref); k1's is 0
    in expectation. tests/unit/test_loss_options.py checks both on an exact
    expectation. Sources: J. Schulman 2020, "Approximating KL Divergence"; k3 is
    GRPO's (arXiv 2402.03300 eq. 4); verl's kl_loss_type "kl" / "mse" / "low_var_kl";
    the gradients: Tang & Munos 2025, arXiv 2506.09477 §3.
    Raises ValueError for an unknown estimator.
    """
    d = logp_ref - logp
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        d = d.clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
        return (torch.exp(d) - d - 1.0).clamp(max=KL_K3_CLAMP)
    raise ValueError(f"KL estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def k3_kl(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(pi || pi_ref) per token (kl_estimate with "k3")."""
    return kl_estimate(logp, logp_ref, "k3")


LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def resolve_loss_agg(mode: str, estimator: str) -> str:
    """JobSpec.loss_agg as the loss applies it: "auto" is the estimator's own
    aggregation, any other mode is kept (a user's explicit choice wins).

    "auto" with "dr_grpo": "seq-mean-token-sum-norm". Dr. GRPO removes two biases of
    GRPO, the division by the group's std and the per-response 1/|o_i| (which favours
    long wrong answers), and sums each response's token losses over a constant
    instead (Liu et al. 2025, arXiv 2503.20783 §3.2; verl's Dr. GRPO recipe,
    docs/algo/grpo.md: `loss_agg_mode=seq-mean-token-sum-norm` with
    `norm_adv_by_std_in_grpo=False`). Centring alone, with token-mean, would keep
    the length normalization. "auto" with any other estimator: "token-mean" (DAPO's,
    the default before "auto"). Raises ValueError for an unknown mode.
    """
    if mode == "auto":
        return "seq-mean-token-sum-norm" if estimator == "dr_grpo" else "token-mean"
    if mode not in LOSS_AGGS:
        raise ValueError(f"loss_agg must be 'auto' or one of {LOSS_AGGS}, got {mode!r}")
    return mode


class AggTotals(NamedTuple):
    """What an update's loss is normalized by: its policy tokens, its sequences with a
    policy token, and Dr. GRPO's constant generation budget L (tokens)."""

    tokens: float
    seqs: float
    max_len: float


def aggregation_weights(loss_mask: torch.Tensor, mode: str, totals: AggTotals) -> torch.Tensor:
    """The weight of each sequence's per-token losses, so that sum_{b,t} w_b * l_bt *
    mask_bt over every micro-batch of an optimizer update is the update's loss.

    loss_mask: [B, T] -> [B] float32. With n_b the policy tokens of sequence b, N the
    update's tokens, S its sequences and L the generation budget:
    - "token-mean": 1 / N (every token equal; DAPO arXiv 2503.14476 §3.3);
    - "seq-mean-token-mean": 1 / (S n_b) (GRPO's original 1/G sum_i 1/|o_i|, arXiv
      2402.03300 eq. 3);
    - "seq-mean-token-sum": 1 / S;
    - "seq-mean-token-sum-norm": 1 / (S L) (Dr. GRPO's constant normalizer, arXiv
      2503.20783 §3.2; verl's name).
    Names are verl's `loss_agg_mode`. Raises ValueError for an unknown mode.
    """
    n = loss_mask.sum(dim=1).to(torch.float32)
    if mode == "token-mean":
        w = torch.full_like(n, 1.0 / max(totals.tokens, 1.0))
    elif mode == "seq-mean-token-mean":
        w = 1.0 / (max(totals.seqs, 1.0) * n.clamp(min=1.0))
    elif mode == "seq-mean-token-sum":
        w = torch.full_like(n, 1.0 / max(totals.seqs, 1.0))
    elif mode == "seq-mean-token-sum-norm":
        w = torch.full_like(n, 1.0 / (max(totals.seqs, 1.0) * max(totals.max_len, 1.0)))
    else:
        raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {mode!r}")
    return torch.where(n > 0, w, 0.0)


class LossConfig(NamedTuple):
    """The policy objective's options as policy_loss takes them: the JobSpec options of
    the same name (described in docs/job-spec.md; `from_spec` maps them), but clip_low =
    clip_range, clip_high = clip_range_high (clip_range where 0), ratio_level =
    importance_sampling_level, kl_coef 0 where the KL goes into the reward instead, and
    loss_agg resolved for the estimator (resolve_loss_agg). The formulas and their
    sources: policy_loss, rollout_is_weights, kl_estimate, aggregation_weights and
    surrogates.py.
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float = 0.0
    ratio_level: str = "token"
    rollout_is: str = "none"
    rollout_is_mode: str = "truncate"
    rollout_is_threshold: float = 2.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    loss_agg: str = "token-mean"
    surrogate: str = "ppo"
    dro_beta: float = 0.0

    @classmethod
    def from_spec(cls, spec) -> "LossConfig":
        """The options of a JobSpec (kl_coef applies to the loss only without
        kl_in_reward; loss_agg "auto" resolved for the job's estimator)."""
        return cls(clip_low=spec.clip_range, clip_high=spec.clip_range_high or spec.clip_range,
                   dual_clip=spec.dual_clip, ratio_level=spec.importance_sampling_level,
                   rollout_is=spec.rollout_is, rollout_is_mode=spec.rollout_is_mode,
                   rollout_is_threshold=spec.rollout_is_threshold,
                   kl_coef=0.0 if spec.kl_in_reward else spec.kl_coef, kl_estimator=spec.kl_estimator,
                   entropy_coef=spec.entropy_coef,
                   loss_agg=resolve_loss_agg(spec.loss_agg, spec.advantage_estimator),
                   surrogate=spec.surrogate, dro_beta=spec.dro_beta)


def rollout_is_weights(logp_prox: torch.Tensor, logp_behav: torch.Tensor, loss_mask: torch.Tensor,
                       level: str, mode: str, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance weights pi_prox / pi_behav of the sampled tokens, and where they were capped.

    logp_prox: the learner's logprobs before the update (the proximal policy), logp_behav:
    the sampler's (the behaviour policy), loss_mask: all [B, T]. Returns (w, capped),
    [B, T] float32 and bool, without gradient; masked positions hold w = 0.
    level "token": w_t = pi_prox(y_t) / pi_behav(y_t); "sequence": the product over the
    sequence's policy tokens, the same w for each of them. mode "truncate": min(w, C)
    (TIS); "mask": w where 1/C <= w <= C, else 0 (masked IS). C = threshold.
    Sources: Yao et al. 2025, "Your efficient RL framework secretly brings you
    off-policy RL training" (TIS, MIS); AReaL arXiv 2505.24298 eq. 5 (decoupled PPO);
    verl's rollout correction (rollout_is, rollout_is_threshold).
    Raises ValueError for an unknown level or mode.
    """
    keep = loss_mask > 0
    with torch.no_grad():
        lw = torch.where(keep, logp_prox - logp_behav, 0.0).to(torch.float32)
        if level == "sequence":
            lw = lw.sum(dim=1, keepdim=True).expand_as(lw)
        elif level != "token":
            raise ValueError(f"rollout_is must be 'token' or 'sequence', got {level!r}")
        log_c = math.log(threshold)
        if mode == "truncate":
            capped = lw > log_c
            w = torch.exp(lw.clamp(max=log_c))
        elif mode == "mask":
            capped = (lw > log_c) | (lw < -log_c)
            w = torch.where(capped, 0.0, torch.exp(lw.clamp(-log_c, log_c)))
        else:
            raise ValueError(f"rollout_is_mode must be 'truncate' or 'mask', got {mode!r}")
        return torch.where(keep, w, 0.0), capped & keep


class LossOut(NamedTuple):
    """The loss of a (micro-)batch and its token-summed statistics.

    loss: scalar with gradient, already weighted by the aggregation weights (micro-batch
    losses of one update add up to its loss). The `*_sum` fields are sums over the
    micro-batch's policy tokens (plain floats): clipped (ratio outside the clip),
    approx_kl (k3 of KL(old || current)), kl (to the reference, the chosen estimator),
    entropy, is_weight (the behaviour correction's weights), is_capped (tokens whose
    weight was truncated or masked), mismatch_kl (k3 of KL(behaviour || proximal), the
    sampler/learner gap; 0 without a proximal policy).
    """

    loss: torch.Tensor
    tokens: float
    clipped_sum: float
    approx_kl_sum: float
    kl_sum: float
    entropy_sum: float
    is_weight_sum: float = 0.0
    is_capped_sum: float = 0.0
    mismatch_kl_sum: float = 0.0


def policy_loss(logp: torch.Tensor, logp_behav: torch.Tensor, advantages: torch.Tensor,
                loss_mask: torch.Tensor, cfg: LossConfig = LossConfig(), *,
                weights: torch.Tensor | None = None, logp_prox: torch.Tensor | None = None,
                logp_ref: torch.Tensor | None = None, entropy: torch.Tensor | None = None) -> LossOut:
    """The policy loss of GRPO jobs: cfg.surrogate per token (surrogates.py; PPO's clipped
    surrogate by default) with the shared ratio, masking, corrections and aggregation.

    logp (current, with gradient), logp_behav (the sampler's), loss_mask: [B, T];
    advantages: [B] (every policy token of the episode) or [B, T] (per token);
    logp_prox (the learner's before this update; required unless cfg.rollout_is is
    "none"), logp_ref, entropy: [B, T] or None; weights: [B] aggregation weights
    (aggregation_weights), default token-mean over this batch.
    Per token, with old = logp_prox when given, else logp_behav:
      r = exp(logp - old) (ratio_level "sequence" or surrogate "gspo": exp of the mean
      over the sequence, GSPO); pg = the surrogate's loss, for "ppo" -min(r A,
      clip(r, 1 - clip_low, 1 + clip_high) A), with dual_clip c at most -c A where A < 0;
      times the behaviour correction w (rollout_is_weights, no gradient); plus kl_coef * KL_est(logp, logp_ref) minus
      entropy_coef * entropy. loss = sum_b weights_b sum_t mask_bt * l_bt.
    Sources: PPO clip, Schulman et al. 2017, arXiv 1707.06347 eq. 7; GRPO, arXiv
    2402.03300 eq. 3; and those of LossConfig, surrogates.py and rollout_is_weights.
    clipped_sum counts the tokens with r outside the clip range (0 for an unclipped
    surrogate) and approx KL is k3 of KL(old || current), (r - 1) - log r (both as in
    CleanRL's PPO).
    Raises ValueError on mismatched shapes, or a missing logp_prox / logp_ref /
    entropy that the options need.
    """
    if logp.shape != logp_behav.shape or logp.shape != loss_mask.shape:
        raise ValueError(f"logp {tuple(logp.shape)}, logp_behav {tuple(logp_behav.shape)} and "
                         f"loss_mask {tuple(loss_mask.shape)} must have the same shape")
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(f"advantages must be [{logp.shape[0]}] or {list(logp.shape)}, "
                         f"got {tuple(advantages.shape)}")
    if cfg.rollout_is != "none" and logp_prox is None:
        raise ValueError("rollout_is needs logp_prox, the learner's logprobs before the update")
    if cfg.entropy_coef and entropy is None:
        raise ValueError("entropy_coef needs the entropy")
    mask = loss_mask.to(logp.dtype)
    keep = mask > 0
    tokens = float(mask.sum())
    if weights is None:
        weights = torch.full((logp.shape[0],), 1.0 / max(tokens, 1.0), device=logp.device)
    # masked positions may hold anything (padding, even inf/NaN): select, never multiply,
    # so that nothing from them reaches the loss or the gradient
    logp = torch.where(keep, logp, 0.0)
    behav = torch.where(keep, logp_behav, 0.0)
    old = torch.where(keep, logp_prox, 0.0) if logp_prox is not None else behav
    log_ratio = logp - old
    if cfg.ratio_level == "sequence" or cfg.surrogate == "gspo":
        n = mask.sum(dim=1, keepdim=True).clamp(min=1.0)
        log_ratio = (torch.where(keep, log_ratio, 0.0).sum(dim=1, keepdim=True) / n).expand_as(logp)
    elif cfg.ratio_level != "token":
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {cfg.ratio_level!r}")
    adv = advantages.to(logp.dtype)
    adv = adv.unsqueeze(1) if adv.dim() == 1 else torch.where(keep, adv, 0.0)
    seq_log_ratio = None
    if cfg.surrogate == "stable_reinforce":  # its trust region is on the sequence's geometric-mean ratio
        n = mask.sum(dim=1, keepdim=True).clamp(min=1.0)
        seq_log_ratio = (torch.where(keep, log_ratio, 0.0).sum(dim=1, keepdim=True) / n).expand_as(logp)
    pg, _ = surrogates.get(cfg.surrogate)(
        logp, log_ratio, adv, SurrogateParams(1.0 - cfg.clip_low, 1.0 + cfg.clip_high, cfg.dual_clip, cfg.dro_beta,
                                              cfg.rollout_is_threshold, seq_log_ratio))
    is_w_sum = is_capped_sum = mismatch_sum = 0.0
    if cfg.rollout_is != "none":
        w, capped = rollout_is_weights(logp_prox, logp_behav, loss_mask, cfg.rollout_is,
                                       cfg.rollout_is_mode, cfg.rollout_is_threshold)
        pg = pg * w
        with torch.no_grad():
            is_w_sum, is_capped_sum = float(w[keep].sum()), float(capped.sum())
            # samples come from the behaviour policy: k3 of KL(behaviour || proximal)
            mismatch_sum = float(k3_kl(behav, old)[keep].sum())
    per_token = pg
    kl_sum = 0.0
    if logp_ref is not None:
        kl = torch.where(keep, kl_estimate(logp, torch.where(keep, logp_ref, 0.0), cfg.kl_estimator), 0.0)
        kl_sum = float(kl.detach().sum())
        if cfg.kl_coef:
            per_token = per_token + cfg.kl_coef * kl
    elif cfg.kl_coef:
        raise ValueError("kl_coef needs logp_ref, the reference policy's logprobs")
    if cfg.entropy_coef:
        per_token = per_token - cfg.entropy_coef * torch.where(keep, entropy, 0.0)
    loss = (torch.where(keep, per_token, 0.0) * weights.to(per_token.dtype).unsqueeze(1)).sum()
    with torch.no_grad():
        ratio = torch.exp(log_ratio)
        clipped = ((ratio < 1.0 - cfg.clip_low) | (ratio > 1.0 + cfg.clip_high))[keep].sum() \
            if cfg.surrogate in surrogates.CLIPPED else 0.0
        approx_kl = k3_kl(old, logp)[keep].sum()
        ent = entropy.detach()[keep].sum() if entropy is not None else torch.zeros(())
    return LossOut(loss, tokens, float(clipped), float(approx_kl), kl_sum, float(ent),
                   is_w_sum, is_capped_sum, mismatch_sum)


def overlong_penalty(gen_tokens: int, max_len: int, buffer: int, factor: float = 1.0) -> float:
    """DAPO's soft overlong punishment, added to the episode's reward.

    gen_tokens: the episode's policy tokens |y|; max_len: L_max; buffer: L_cache.
    0 when |y| <= L_max - L_cache; ((L_max - L_cache) - |y|) / L_cache inside the
    buffer; -1 beyond L_max; times `factor`. buffer 0 gives 0 (off).
    Source: Yu et al. 2025, DAPO, arXiv 2503.14476 eq. 13.
    """
    if buffer <= 0:
        return 0.0
    free = max_len - buffer
    if gen_tokens <= free:
        return 0.0
    if gen_tokens <= max_len:
        return factor * (free - gen_tokens) / buffer
    return -factor


def lr_factor(progress: float, total: float, warmup: float, schedule: str) -> float:
    """The learning-rate multiplier at `progress` steps of `total` (floats: an update
    inside a step counts fractionally): linear from 0 to 1 over `warmup` steps, then
    "constant" 1, "linear" down to 0 at `total`, or "cosine" 0.5 (1 + cos(pi p)) with p
    the fraction of the post-warmup steps done.
    Source: transformers' get_{constant,linear,cosine}_schedule_with_warmup (what TRL
    uses; cosine after Loshchilov & Hutter 2017, arXiv 1608.03983).
    Raises ValueError for an unknown schedule.
    """
    if schedule not in ("constant", "linear", "cosine"):
        raise ValueError(f"lr_schedule must be constant, linear or cosine, got {schedule!r}")
    if warmup > 0 and progress < warmup:
        return progress / warmup
    if schedule == "constant":
        return 1.0
    p = min(1.0, max(0.0, (progress - warmup) / max(total - warmup, 1e-9)))
    return 1.0 - p if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * p))
