"""One GRPO training step, planned from the step's trajectories and the job spec: what
job.py hands the engine (engine_deepspeed.TrainEngine.train_step). No bus, no asyncio,
no engine: the one model computation a step may need first, the reference policy's
logprobs for the KL in the reward, is a function passed in.

plan_step reads as the step does:
1. reward bonuses: DAPO's soft overlong penalty, the KL-in-reward penalty (reward_bonus);
2. group-relative advantages, the episodes excluded from the loss (errors, the overlong
   filter, opponents' seats) and the groups without signal (advantages); with a
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
from opentinker.services.learner.loss import AggTotals, LossConfig, kl_estimate, lr_factor, overlong_penalty

# micro-batches -> the reference policy's target-aligned logprobs [B, T] of each
# (engine_deepspeed.TrainEngine.sequence_logprobs with reference=True)
RefLogprobs = Callable[[Sequence[Batch]], Sequence[torch.Tensor]]


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
    """

    micro_batches: list[Batch]
    updates: list[list[int]]
    totals: list[AggTotals]
    lrs: list[float]
    stats: dict[str, float]


def reward_bonus(trajs: Sequence[Trajectory], spec: JobSpec, pad_id: int,
                 ref_logprobs: RefLogprobs | None = None) -> list[float] | None:
    """What each episode's reward gains before the advantages: DAPO's soft overlong
    penalty (loss.overlong_penalty, arXiv 2503.14476 §3.4) and, with `kl_in_reward`,
    -kl_coef times the episode's summed KL estimate (spec.kl_estimator) of the sampler's
    tokens to the reference (verl's use_kl_in_reward; Ouyang et al. 2022, arXiv
    2203.02155 eq. 2). The reference logprobs come from `ref_logprobs`, over
    micro-batches of the job's size padded with `pad_id`. Returns [len(trajs)] bonuses,
    or None when every one is 0. Raises ValueError when the KL is in the reward and
    `ref_logprobs` is None.
    """
    bonus = [0.0] * len(trajs)
    if spec.overlong_buffer > 0:
        budget = max_generated_tokens(spec)
        bonus = [b + overlong_penalty(sum(t.loss_mask), budget, spec.overlong_buffer, spec.overlong_penalty)
                 for b, t in zip(bonus, trajs)]
    if spec.kl_in_reward and spec.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_in_reward needs the reference policy's logprobs (ref_logprobs)")
        idx = micro_batch_indices([len(t.token_ids) for t in trajs], spec.micro_batch_size, spec.micro_batch_tokens)
        batches = [build_batch([trajs[i] for i in part], [0.0] * len(part), pad_id) for part in idx]
        for part, mb, ref in zip(idx, batches, ref_logprobs(batches)):
            kl = torch.where(mb.loss_mask > 0, kl_estimate(mb.logprobs, ref, spec.kl_estimator), 0.0).sum(dim=1)
            for i, k in zip(part, kl.tolist()):
                bonus[i] -= spec.kl_coef * k
    return bonus if any(bonus) else None


def advantages(trajs: Sequence[Trajectory], spec: JobSpec, bonus: Sequence[float] | None) -> StepAdvantages:
    """Per-episode or per-token advantages of a step in group order
    (batching.step_advantages with the job's credit, estimator and reward `bonus`).
    Left out of the loss but counted in their group's statistics: with overlong_filter,
    the episodes whose last turn was cut at the length limit (DAPO arXiv 2503.14476
    §3.4); the seats another job's policy played (spec.opponents: measured, not trained).
    A multi-agent group is one GRPO group per seat (ledger.by_seat orders it so): each
    seat's return is normalized against the same seat of the group's other games.
    Raises ValueError as step_advantages does."""
    mask_out = None
    if spec.overlong_filter:
        mask_out = [bool(t.turns) and t.turns[-1].finish_reason == "length" for t in trajs]
    if spec.opponents:
        mask_out = [bool(t.policy_of) or bool(mask_out and mask_out[k]) for k, t in enumerate(trajs)]
    return step_advantages(trajs, spec.prompts_per_step * spec.agents, spec.group_size, spec.advantage,
                           spec.turn_discount, spec.advantage_estimator, bonus, mask_out)


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
              ref_logprobs: RefLogprobs | None = None) -> StepPlan:
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
    step_advantages do.
    """
    adv, distilled = distill(trajs, spec, advantages(trajs, spec, reward_bonus(trajs, spec, pad_id, ref_logprobs)))
    skipped = skipped_episodes(adv, spec)
    trainable = [i for i, excluded in enumerate(adv.excluded) if not excluded]
    plan = plan_updates(trainable, skipped, [policy_tokens(t) for t in trajs], spec.mini_batches, spec.ppo_epochs,
                        derived_seed("update", spec.seed, step), max_generated_tokens(spec))
    batches: list[Batch] = []
    owned: list[list[int]] = []  # per distinct mini-batch: its micro-batches' indices in `batches`
    for episodes in plan.mini_batches:
        built = micro_batches([trajs[i] for i in episodes], [adv.advantages[i] for i in episodes],
                              spec.micro_batch_size, pad_id, max_tokens=spec.micro_batch_tokens)
        owned.append(list(range(len(batches), len(batches) + len(built))))
        batches += built
    updates = [list(owned[u.mini_batch]) for u in plan.updates]
    lrs = [spec.lr * lr_factor(step + u.progress, spec.steps, spec.lr_warmup_steps, spec.lr_schedule)
           for u in plan.updates]
    forwarded = sum(len(episodes) for episodes in plan.mini_batches)
    stats = {"excluded_frac": adv.excluded_frac, "zero_variance_frac": adv.zero_variance_frac,
             "skipped_frac": 1.0 - forwarded / max(len(trajs), 1), "lr": lrs[0] if lrs else 0.0, **distilled}
    return StepPlan(batches, updates, [u.totals for u in plan.updates], lrs, stats)
