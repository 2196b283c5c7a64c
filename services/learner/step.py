"""One GRPO training step, planned from the step's trajectories and the job spec: what
job.py hands the engine (engine_deepspeed.TrainEngine.train_step). No bus, no asyncio,
no engine: the one model computation a step may need first, the reference policy's
logprobs for the KL in the reward, is a function passed in.

plan_step reads as the step does:
1. reward bonuses: DAPO's soft overlong penalty, the KL-in-reward penalty (reward_bonus);
2. group-relative advantages, the episodes excluded from the loss (errors, the overlong
   filter, opponents' seats) and the groups without signal (advantages), or with a
   critic its GAE advantages, values and returns (critic_advantages); with a
   distillation teacher, each policy token's reverse KL to it (distill);
3. the groups whose loss terms are all exactly 0, skipped from the forward
   (skipped_episodes);
4. the update plan: PPO's epochs over mini-batches of the trainable episodes, the
   skipped ones counted in each update's normalizers (batching.plan_updates);
5. the micro-batches, built once per distinct mini-batch, and each update's
   micro-batch indices, AggTotals and learning rate (the job's schedule).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from opentinker.schemas import JobSpec, Trajectory
from opentinker.schemas.job import max_generated_tokens
from opentinker.schemas.stats import derived_seed
from opentinker.services.learner.batching import (Batch, StepAdvantages, build_batch, distill_advantages,
                                                  micro_batch_indices, micro_batches, plan_updates, policy_tokens,
                                                  step_advantages)
from opentinker.services.learner.gae import CriticTargets, gae_targets
from opentinker.services.learner.loss import AggTotals, LossConfig, kl_estimate, lr_factor, overlong_penalty

# micro-batches -> the reference policy's target-aligned logprobs [B, T] of each
# (engine_deepspeed.TrainEngine.sequence_logprobs with reference=True)
RefLogprobs = Callable[[Sequence[Batch]], Sequence[torch.Tensor]]
# micro-batches -> the critic's target-aligned values [B, T] of each (critic.CriticEngine.values)
ValueFn = Callable[[Sequence[Batch]], Sequence[torch.Tensor]]


# a train step's per-token averages (engine.train_step; the IS weights and the sampler /
# learner gap "mismatch_kl" are loss.rollout_is_weights'), and a critic's (critic.py)
POLICY_STATS = ("kl", "approx_kl", "entropy", "clip_frac", "is_weight_mean", "is_capped_frac", "mismatch_kl")
CRITIC_STATS = ("value_loss", "value_error", "value_clip_frac", "value_mean", "return_mean", "value_explained_var",
                "critic_grad_norm")
TOKEN_STATS = POLICY_STATS + CRITIC_STATS


def token_stats(out: dict[str, float]) -> dict[str, float]:
    """The step's TOKEN_STATS from engine.train_step's `out`: the policy's none at all
    when it forwarded no policy token (every group skipped or excluded, or a critic
    warmup step): such a step has no entropy or KL, and a 0 would read as one (plots
    dived to 0 on those steps). The critic's are there when it trained."""
    kept = TOKEN_STATS if out.get("tokens") else CRITIC_STATS
    return {k: out[k] for k in kept if k in out}  # "kl" only where the loss has a KL term


class StepPlan(NamedTuple):
    """A training step as the engine runs it (TrainEngine.train_step).

    micro_batches: the distinct micro-batches, each built once (an epoch reuses them)
    updates:       per optimizer update, in order: its micro-batches (indices into
                   `micro_batches`); [ppo_epochs * mini-batches] at most (a mini-batch
                   with nothing to forward has no update)
    totals:        per update: its loss's normalizers (loss.AggTotals), counting the
                   skipped episodes of its mini-batch
    lrs:           per update: its learning rate
    stats:         the step's excluded_frac, zero_variance_frac, skipped_frac (episodes
                   not forwarded / episodes) and lr (the first update's; 0.0 for none);
                   with a teacher, teacher_kl (distill)
    critic_only:   True for a step of the critic's warmup (spec.critic_warmup): the
                   updates train the critic alone (critic.ActorCritic.train_critic)
    """

    micro_batches: list[Batch]
    updates: list[list[int]]
    totals: list[AggTotals]
    lrs: list[float]
    stats: dict[str, float]
    critic_only: bool = False


class RewardBonus(NamedTuple):
    """What the rewards gain before the advantages (reward_bonus).

    episode: [n_episodes] DAPO's soft overlong penalty of each episode, or None
    kl:      [n_episodes][len(token_ids)] with kl_in_reward, -kl_coef times each policy
             token's KL estimate to the reference (0 off the policy tokens), or None
    """

    episode: list[float] | None
    kl: list[list[float]] | None

    def per_episode(self) -> list[float] | None:
        """[n_episodes] the overlong penalty plus the episode's summed KL penalty (what an
        outcome advantage sees: verl's GRPO sums token_level_rewards), or None when
        every one is 0."""
        parts = [p for p in (self.episode, self.kl and [sum(k) for k in self.kl]) if p]
        out = [sum(x) for x in zip(*parts)]
        return out if any(out) else None


def reward_bonus(trajs: Sequence[Trajectory], spec: JobSpec, pad_id: int,
                 ref_logprobs: RefLogprobs | None = None) -> RewardBonus:
    """What the rewards gain before the advantages: DAPO's soft overlong penalty per
    episode (loss.overlong_penalty, arXiv 2503.14476 §3.4) and, with `kl_in_reward`,
    -kl_coef times the KL estimate (spec.kl_estimator) of each sampled policy token to
    the reference (verl's apply_kl_penalty, token_level_rewards = scores - beta * kld;
    Ouyang et al. 2022, arXiv 2203.02155 eq. 2). The reference logprobs come from
    `ref_logprobs`, over micro-batches of the job's size padded with `pad_id`. A part
    that is 0 for every episode is None. Raises ValueError when the KL is in the reward
    and `ref_logprobs` is None.
    """
    episode = None
    if spec.overlong_buffer > 0:
        budget = max_generated_tokens(spec)
        episode = [overlong_penalty(sum(t.loss_mask), budget, spec.overlong_buffer, spec.overlong_penalty)
                   for t in trajs]
    kl_tokens = None
    if spec.kl_in_reward and spec.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_in_reward needs the reference policy's logprobs (ref_logprobs)")
        kl_tokens = [[0.0] * len(t.token_ids) for t in trajs]
        for part, mb, ref in forward(trajs, range(len(trajs)), spec, pad_id, ref_logprobs):
            kl = torch.where(mb.loss_mask > 0, -spec.kl_coef * kl_estimate(mb.logprobs, ref, spec.kl_estimator), 0.0)
            to_tokens(kl_tokens, trajs, part, kl)
    return RewardBonus(episode if episode and any(episode) else None,
                       kl_tokens if kl_tokens and any(map(any, kl_tokens)) else None)


def forward(trajs: Sequence[Trajectory], episodes: Sequence[int], spec: JobSpec, pad_id: int,
            fn: RefLogprobs) -> list[tuple[list[int], Batch, torch.Tensor]]:
    """`fn` (a model's per-token output, [B, T] per micro-batch) over `episodes` (indices
    into `trajs`) in micro-batches of the job's size padded with `pad_id`: per
    micro-batch, its episodes, the Batch and fn's tensor for it."""
    idx = micro_batch_indices([len(trajs[i].token_ids) for i in episodes], spec.micro_batch_size,
                              spec.micro_batch_tokens)
    parts = [[episodes[k] for k in part] for part in idx]
    batches = [build_batch([trajs[i] for i in part], [0.0] * len(part), pad_id) for part in parts]
    return list(zip(parts, batches, fn(batches)))


def to_tokens(dest: list[list[float]], trajs: Sequence[Trajectory], part: Sequence[int], rows: torch.Tensor) -> None:
    """Write a micro-batch's target-aligned [B, T] tensor `rows` (column j describes token
    j + 1, see batching.py) into the token-aligned lists of its episodes: for the episode
    i in row r of `part`, dest[i][1:] = rows[r, :len(token_ids) - 1] (dest[i][0], the
    first token's, is left as it is)."""
    for row, i in enumerate(part):
        dest[i][1:] = rows[row, : len(trajs[i].token_ids) - 1].tolist()


def _mask_out(trajs: Sequence[Trajectory], spec: JobSpec) -> list[bool] | None:
    """[n] True for an episode that counts in its group's statistics but does not train:
    with overlong_filter, one whose last turn was cut at the length limit (DAPO arXiv
    2503.14476 §3.4); the seats another job's policy played (spec.opponents)."""
    mask_out = None
    if spec.overlong_filter:
        mask_out = [bool(t.turns) and t.turns[-1].finish_reason == "length" for t in trajs]
    if spec.opponents:
        mask_out = [bool(t.policy_of) or bool(mask_out and mask_out[k]) for k, t in enumerate(trajs)]
    return mask_out


def advantages(trajs: Sequence[Trajectory], spec: JobSpec, bonus: RewardBonus) -> StepAdvantages:
    """Per-episode or per-token advantages of a step in group order
    (batching.step_advantages with the job's credit, estimator and reward `bonus`).
    Left out of the loss but counted in their group's statistics: with overlong_filter,
    the episodes whose last turn was cut at the length limit (DAPO arXiv 2503.14476
    §3.4); the seats another job's policy played (spec.opponents: measured, not trained).
    A multi-agent group is one GRPO group per seat (ledger.by_seat orders it so): each
    seat's return is normalized against the same seat of the group's other games.
    Raises ValueError as step_advantages does."""
    return step_advantages(trajs, spec.prompts_per_step * spec.agents, spec.group_size, spec.advantage,
                           spec.turn_discount, spec.advantage_estimator, bonus.per_episode(), _mask_out(trajs, spec))


def critic_advantages(trajs: Sequence[Trajectory], spec: JobSpec, bonus: RewardBonus, pad_id: int,
                      values: ValueFn | None) -> tuple[StepAdvantages, CriticTargets]:
    """PPO with a critic (advantage_estimator "gae"): each trained episode's per-token
    GAE advantages, whitened over the step, with the returns and values the critic trains
    on (gae.gae_targets, gamma spec.gae_gamma, lambda spec.gae_lambda; `bonus`'s overlong
    penalty on each episode's last reward, its KL penalty on each token, as verl's GAE
    over token_level_rewards). The critic's values come from `values` over the trained
    episodes (errors and _mask_out's left out). No group baseline: zero_groups are all
    False. Raises ValueError when `values` is None."""
    if values is None:
        raise ValueError("advantage_estimator 'gae' needs the critic's values (values)")
    mask_out = _mask_out(trajs, spec)
    excluded = [bool(t.error) or bool(mask_out and mask_out[i]) for i, t in enumerate(trajs)]
    token_values = [[0.0] * len(t.token_ids) for t in trajs]
    for part, _, v in forward(trajs, [i for i, ex in enumerate(excluded) if not ex], spec, pad_id, values):
        to_tokens(token_values, trajs, part, v)
    targets = gae_targets(trajs, token_values, excluded, spec.gae_gamma, spec.gae_lambda, bonus.episode, bonus.kl)
    return StepAdvantages(targets.advantages, excluded, [False] * (len(trajs) // spec.group_size)), targets


def distill(trajs: Sequence[Trajectory], spec: JobSpec, adv: StepAdvantages) -> tuple[StepAdvantages, dict]:
    """With a distillation teacher (spec.teacher): the advantages with each policy token's
    reverse-KL term (batching.distill_advantages, weight spec.distill_coef, alone with
    spec.distill_only) and {"teacher_kl": its mean per policy token} when a token was
    trained; without one, `adv` and {}."""
    if spec.teacher == "none":
        return adv, {}
    adv, kl = distill_advantages(trajs, adv, spec.group_size, spec.distill_coef, spec.distill_only)
    return adv, ({} if math.isnan(kl) else {"teacher_kl": kl})


def skipped_episodes(adv: StepAdvantages, spec: JobSpec) -> list[bool]:
    """[n_episodes] True where the episode need not be forwarded: with
    skip_zero_variance, an episode of a group whose advantages are all 0, when the loss
    has no KL or entropy term (LossConfig.from_spec), so that every loss term of it is
    exactly 0 (no policy gradient)."""
    cfg = LossConfig.from_spec(spec)
    skip = spec.skip_zero_variance and cfg.kl_coef == 0 and cfg.entropy_coef == 0
    return [skip and adv.zero_groups[i // spec.group_size] for i in range(len(adv.excluded))]


def plan_step(trajs: Sequence[Trajectory], spec: JobSpec, step: int, pad_id: int,
              ref_logprobs: RefLogprobs | None = None, values: ValueFn | None = None) -> StepPlan:
    """Step `step` (0-based) of a GRPO job over its trajectories `trajs` (groups of
    spec.group_size in group order, [prompts_per_step * agents * group_size]).

    Not forwarded at all: excluded episodes (errors, overlong-filtered, opponents) and
    skipped ones (skipped_episodes); the skipped still count in the normalizers
    (batching.plan_updates), so skipping changes the compute and not the gradient. The
    episodes are shuffled into mini-batches by a generator seeded with
    derived_seed("update", spec.seed, step); the n-th of the plan's N updates has the
    learning rate spec.lr * loss.lr_factor(step + n / N, spec.steps, ...). Micro-batches
    hold at most spec.micro_batch_size episodes and spec.micro_batch_tokens padded
    tokens (batching.micro_batches), padded with `pad_id`. ref_logprobs: as in
    reward_bonus (needed only with kl_in_reward). Raises ValueError as reward_bonus and
    step_advantages do. values: the critic's (critic_advantages), needed with
    advantage_estimator "gae"; the micro-batches then carry its values and returns, and
    a step before spec.critic_warmup is critic_only.
    """
    bonus = reward_bonus(trajs, spec, pad_id, ref_logprobs)
    critic: CriticTargets | None = None
    if spec.advantage_estimator == "gae":
        adv, critic = critic_advantages(trajs, spec, bonus, pad_id, values)
    else:
        adv = advantages(trajs, spec, bonus)
    adv, distilled = distill(trajs, spec, adv)
    skipped = skipped_episodes(adv, spec)
    trainable = [i for i, excluded in enumerate(adv.excluded) if not excluded]
    plan = plan_updates(trainable, skipped, [policy_tokens(t) for t in trajs], spec.mini_batches, spec.ppo_epochs,
                        derived_seed("update", spec.seed, step), max_generated_tokens(spec))
    batches: list[Batch] = []
    owned: list[list[int]] = []  # per distinct mini-batch: its micro-batches' indices in `batches`
    for episodes in plan.mini_batches:
        built = micro_batches([trajs[i] for i in episodes], [adv.advantages[i] for i in episodes],
                              spec.micro_batch_size, pad_id, max_tokens=spec.micro_batch_tokens,
                              values=critic and [critic.values[i] for i in episodes],
                              returns=critic and [critic.returns[i] for i in episodes])
        owned.append(list(range(len(batches), len(batches) + len(built))))
        batches += built
    updates = [list(owned[u.mini_batch]) for u in plan.updates]
    lrs = [spec.lr * lr_factor(step + u.progress, spec.steps, spec.lr_warmup_steps, spec.lr_schedule)
           for u in plan.updates]
    forwarded = sum(len(episodes) for episodes in plan.mini_batches)
    stats = {"excluded_frac": adv.excluded_frac, "zero_variance_frac": adv.zero_variance_frac,
             "skipped_frac": 1.0 - forwarded / max(len(trajs), 1), "lr": lrs[0] if lrs else 0.0, **distilled}
    critic_only = critic is not None and step < spec.critic_warmup
    return StepPlan(batches, updates, [u.totals for u in plan.updates], lrs, stats, critic_only)
