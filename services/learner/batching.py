"""Trajectories -> per-episode advantages, padded target-aligned training tensors;
micro-batching.

Alignment: a causal LM's logits at position t predict token t+1. Every per-token
tensor here is stored "target-aligned": column t holds the loss mask and the
sampler's logprob of token t+1, so `logp[:, t]` from loss.token_logprobs lines up
with `loss_mask[:, t]` and `logprobs[:, t]` with no further shifting. The last column
(nothing predicts past the end) and padding are always masked out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from opentinker.schemas import Trajectory
from opentinker.services.learner.loss import AggTotals, batch_whitening, group_advantages, turn_advantages


class Batch(NamedTuple):
    """One (micro-)batch of B episodes padded (right) to T tokens.

    input_ids:      [B, T] long   token ids, `pad_id` after each episode's end
    attention_mask: [B, T] long   1 on real tokens
    loss_mask:      [B, T] float  1 where token t+1 is a policy token (target-aligned)
    logprobs:       [B, T] float  the sampler's logprob of token t+1 (target-aligned)
    advantages:     [B] float     one advantage per episode, or
                    [B, T] float  one per token (turn-level credit; target-aligned)
    images:         every image of the batch (PNG/JPEG bytes), row by row in the order
                    of their placeholder tokens (Trajectory.images); () for text
    values:         [B, T] float  with a critic (gae.py): its value of token t+1 when the
    returns:        [B, T] float  step's advantages were computed, and token t+1's GAE
                                  return (target-aligned); None without a critic
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    logprobs: torch.Tensor
    advantages: torch.Tensor
    images: tuple[bytes, ...] = ()
    values: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    def to(self, device: str | torch.device) -> Batch:
        """The batch with every tensor on `device`."""
        return Batch(*(t.to(device) for t in self[:5]), self.images,
                     *(None if t is None else t.to(device) for t in self[6:]))

    @property
    def num_tokens(self) -> int:
        """Policy tokens in the batch (the loss's normalizer)."""
        return int(self.loss_mask.sum())


def check_trajectory(traj: Trajectory, vocab_size: int) -> None:
    """Check what msgspec's type check cannot: lengths, mask values, token range.

    An episode that ended on an error may hold few or no tokens and no policy token: it
    is valid (step_advantages leaves it out of its group and of the loss).
    Raises ValueError naming the offending field.
    """
    n = len(traj.token_ids)
    if len(traj.loss_mask) != n:
        raise ValueError(f"Trajectory.loss_mask: length {len(traj.loss_mask)} != len(token_ids) {n}")
    if len(traj.logprobs) != n:
        raise ValueError(f"Trajectory.logprobs: length {len(traj.logprobs)} != len(token_ids) {n}")
    if any(m not in (0, 1) for m in traj.loss_mask):
        raise ValueError("Trajectory.loss_mask: values must be 0 or 1")
    if n and traj.loss_mask[0]:
        raise ValueError("Trajectory.loss_mask: the first token cannot be a policy token (nothing predicts it)")
    if n and (min(traj.token_ids) < 0 or max(traj.token_ids) >= vocab_size):
        raise ValueError(f"Trajectory.token_ids: ids must be in [0, {vocab_size})")
    if not all(math.isfinite(x) and x <= 1e-3 for x in traj.logprobs):
        raise ValueError("Trajectory.logprobs: must be finite and <= 0")
    if traj.teacher_logprobs and len(traj.teacher_logprobs) != n:
        raise ValueError(f"Trajectory.teacher_logprobs: length {len(traj.teacher_logprobs)} != len(token_ids) {n}")
    if not all(math.isfinite(x) and x <= 1e-3 for x in traj.teacher_logprobs):
        raise ValueError("Trajectory.teacher_logprobs: must be finite and <= 0")
    if not math.isfinite(traj.reward):
        raise ValueError("Trajectory.reward: must be finite")


def token_advantages(traj: Trajectory, per_turn: Sequence[float]) -> list[float]:
    """[len(token_ids)] advantages: `per_turn[k]` on the policy tokens of turn k
    ([gen_start, gen_end)), 0 elsewhere. Raises ValueError if the counts differ."""
    if len(per_turn) != len(traj.turns):
        raise ValueError(f"{len(per_turn)} turn advantages for {len(traj.turns)} turns")
    out = [0.0] * len(traj.token_ids)
    for turn, a in zip(traj.turns, per_turn):
        out[turn.gen_start:turn.gen_end] = [a] * (turn.gen_end - turn.gen_start)
    return out


Advantage = float | Sequence[float]


class StepAdvantages(NamedTuple):
    """A step's advantages, episodes in group order.

    advantages: [n_episodes] of float (episode credit) or of [len(token_ids)] lists
                (turn credit, token_advantages); 0 for an excluded episode
    excluded:   [n_episodes] bool, True where the episode must not train (loss mask 0)
    zero_groups: [n_groups] bool, True where every episode's advantage is exactly 0
                (equal rewards, or no episode left to compare): no policy gradient
    """

    advantages: list[Advantage]
    excluded: list[bool]
    zero_groups: list[bool] = []

    @property
    def excluded_frac(self) -> float:
        """Episodes excluded / episodes in the step (0.0 for an empty step)."""
        return sum(self.excluded) / len(self.excluded) if self.excluded else 0.0

    @property
    def zero_variance_frac(self) -> float:
        """Groups without any policy-gradient signal / groups (0.0 for none)."""
        return sum(self.zero_groups) / len(self.zero_groups) if self.zero_groups else 0.0


def _is_zero(a: Advantage) -> bool:
    return not any(a) if isinstance(a, Sequence) else a == 0.0


def step_advantages(trajs: Sequence[Trajectory], prompts_per_step: int, group_size: int,
                    credit: str = "episode", turn_discount: float = 1.0, estimator: str = "grpo",
                    reward_bonus: Sequence[float] | None = None,
                    mask_out: Sequence[bool] | None = None) -> StepAdvantages:
    """Group-relative advantages of a step, leaving out episodes that ended on an error.

    trajs: [prompts_per_step * group_size] episodes, group g at [g * group_size, (g + 1) *
    group_size). credit "episode": one float per episode, loss.group_advantages with
    `estimator` (GRPO's (r_i - mean) / (std + 1e-6) by default; Shao et al. 2024, arXiv
    2402.03300, eq. 3); "turn": a per-token list per episode, loss.turn_advantages with
    `turn_discount` spread over each turn's policy tokens. "reinforce_pp" then whitens
    the trained episodes' advantages over every policy token of the step
    (loss.batch_whitening: A' = (A - mean) * rstd, OpenRLHF's masked whitening), so a
    group with equal rewards gets -mean * rstd, not 0, and only counts in
    `zero_groups` when that is 0.
    reward_bonus: [n_episodes] added to each episode's reward (its last turn's, with
    turn credit) before the advantages: the KL-in-reward penalty, DAPO's soft overlong
    penalty. mask_out: [n_episodes] True for an episode that counts in its group's
    statistics but is not trained (DAPO's overlong filtering, arXiv 2503.14476 §3.4).
    An episode with a non-empty `error` (an environment or engine failure) is excluded:
    its reward says nothing about the policy, so the group's mean and std are those of
    the group's other episodes, and it gets advantage 0 and loss mask 0. A group left
    with fewer than 2 such episodes has no baseline to compare with: every episode of it
    is excluded (no gradient, not even the KL term's).
    Raises ValueError when len(trajs) != prompts_per_step * group_size, the other
    sequences' lengths differ from it, or `credit` is neither "episode" nor "turn".
    """
    n = prompts_per_step * group_size
    if len(trajs) != n:
        raise ValueError(f"{len(trajs)} episodes for {prompts_per_step} groups of {group_size}")
    if credit not in ("episode", "turn"):
        raise ValueError(f"credit must be 'episode' or 'turn', got {credit!r}")
    for name, seq in (("reward_bonus", reward_bonus), ("mask_out", mask_out)):
        if seq is not None and len(seq) != n:
            raise ValueError(f"{name}: {len(seq)} values for {n} episodes")
    bonus = list(reward_bonus) if reward_bonus is not None else [0.0] * n
    advantages: list[Advantage] = []
    excluded: list[bool] = []
    for g in range(prompts_per_step):
        idx = range(g * group_size, (g + 1) * group_size)
        kept = [i for i in idx if not trajs[i].error]
        if len(kept) < 2:
            kept = []  # one episode is its own mean: GRPO's baseline needs >= 2
        adv_kept: list[Advantage] = []
        if kept and credit == "turn":
            turn_rewards = []
            for i in kept:
                r = [turn.reward for turn in trajs[i].turns] or [0.0]
                r[-1] += bonus[i]
                turn_rewards.append(r if trajs[i].turns else [])
            [per_turn] = turn_advantages([turn_rewards], turn_discount, estimator)
            adv_kept = [token_advantages(trajs[i], a) if trajs[i].turns else [0.0] * len(trajs[i].token_ids)
                        for i, a in zip(kept, per_turn)]
        elif kept:
            rewards = torch.tensor([[trajs[i].reward + bonus[i] for i in kept]], dtype=torch.float64)
            adv_kept = group_advantages(rewards, estimator).view(-1).tolist()
        by_index = dict(zip(kept, adv_kept))
        for i in idx:
            if i in by_index:
                advantages.append(by_index[i])
                excluded.append(bool(mask_out[i]) if mask_out is not None else False)
            else:
                advantages.append([0.0] * len(trajs[i].token_ids) if credit == "turn" else 0.0)
                excluded.append(True)
    if estimator == "reinforce_pp":
        advantages = _whiten(trajs, advantages, excluded)
    for i, ex in enumerate(excluded):
        if ex:
            advantages[i] = [0.0] * len(trajs[i].token_ids) if credit == "turn" else 0.0
    zero_groups = [all(excluded[i] or _is_zero(advantages[i]) for i in range(g * group_size, (g + 1) * group_size))
                   for g in range(prompts_per_step)]
    return StepAdvantages(advantages, excluded, zero_groups)


def distill_advantages(trajs: Sequence[Trajectory], adv: StepAdvantages, group_size: int, coef: float,
                       only: bool = False) -> tuple[StepAdvantages, float]:
    """On-policy distillation: each trained policy token's advantage gains
    -coef * (log pi_sampler(t) - log pi_teacher(t)), minus the per-token reverse KL
    from the sampler's policy to the teacher, estimated on the sampled token
    (tinker-cookbook, tinker_cookbook/distillation/train_on_policy.py
    `incorporate_kl_penalty` without a discount; GKD, Agarwal et al. 2024, arXiv
    2306.13649; on-policy distillation, Lu & Thinking Machines 2025). With `only` that
    term is the whole advantage (the cookbook's recipe); else it is added to the
    group-relative one (upstream OpenTinker's A = A_rl - alpha (log pi - log pi_teacher)).

    trajs: the step's episodes in group order, each trained one with `teacher_logprobs`
    ([len(token_ids)]); adv: their step_advantages; group_size: episodes per group.
    Returns the advantages as [len(token_ids)] lists (0 for an excluded episode, whose
    exclusion stands), `zero_groups` recomputed, and the mean reverse KL per policy token
    of the trained episodes (nats; NaN when there is none). Raises ValueError when a
    trained episode has no teacher logprobs of its length.
    """
    out: list[Advantage] = []
    kl_sum, tokens = 0.0, 0
    for i, (t, a, excluded) in enumerate(zip(trajs, adv.advantages, adv.excluded)):
        n = len(t.token_ids)
        if excluded:
            out.append([0.0] * n)
            continue
        if len(t.teacher_logprobs) != n:
            raise ValueError(f"episode {i}: {len(t.teacher_logprobs)} teacher logprobs for {n} tokens")
        base = [0.0] * n if only else list(a) if isinstance(a, Sequence) else [a * m for m in t.loss_mask]
        for j, m in enumerate(t.loss_mask):
            if m:
                kl = t.logprobs[j] - t.teacher_logprobs[j]
                base[j] -= coef * kl
                kl_sum += kl
                tokens += 1
        out.append(base)
    zero_groups = [all(adv.excluded[i] or _is_zero(out[i]) for i in range(g * group_size, (g + 1) * group_size))
                   for g in range(len(trajs) // group_size)]
    return StepAdvantages(out, list(adv.excluded), zero_groups), kl_sum / tokens if tokens else math.nan


def _whiten(trajs: Sequence[Trajectory], advantages: list[Advantage], excluded: Sequence[bool]) -> list[Advantage]:
    """REINFORCE++'s whitening of the trained episodes' advantages over their policy
    tokens (loss.batch_whitening): an episode-level advantage weighs as many tokens as
    its episode trains (policy_tokens), a per-token one (aligned with token_ids, as
    token_advantages) counts at each policy token after the first (build_batch's
    alignment) and only those change. Excluded episodes are left out and left as they are."""
    values: list[float] = []
    weights: list[float] = []
    for t, a, ex in zip(trajs, advantages, excluded):
        if ex:
            continue
        if isinstance(a, Sequence):
            per_token = [a[j] for j in range(1, len(a)) if t.loss_mask[j]]
            values += per_token
            weights += [1.0] * len(per_token)
        else:
            values.append(a)
            weights.append(float(policy_tokens(t)))
    mean, rstd = batch_whitening(values, weights)
    out: list[Advantage] = []
    for t, a, ex in zip(trajs, advantages, excluded):
        if ex:
            out.append(a)
        elif isinstance(a, Sequence):  # the other positions stay 0, as token_advantages leaves them
            out.append([(x - mean) * rstd if j and t.loss_mask[j] else x for j, x in enumerate(a)])
        else:
            out.append((a - mean) * rstd)
    return out


def build_batch(trajs: Sequence[Trajectory], advantages: Sequence[Advantage], pad_id: int,
                exclude: Sequence[bool] | None = None, values: Sequence[Sequence[float]] | None = None,
                returns: Sequence[Sequence[float]] | None = None) -> Batch:
    """Pad `trajs` (right) into a target-aligned Batch; `advantages[i]` belongs to `trajs[i]`:
    a float per episode, or a [len(token_ids)] list per token (token_advantages).
    `exclude[i]` True gives episode i loss mask 0 (StepAdvantages.excluded); its tokens
    still go through the model, but nothing of them reaches the loss. With a critic,
    `values` and `returns` (gae.CriticTargets') are [len(token_ids)] lists per episode.

    Raises ValueError when the lengths differ, `trajs` is empty, or a per-token list
    does not match its episode's length.
    """
    if not trajs or len(trajs) != len(advantages):
        raise ValueError(f"need one advantage per trajectory, got {len(advantages)} for {len(trajs)}")
    if exclude is not None and len(exclude) != len(trajs):
        raise ValueError(f"need one exclude flag per trajectory, got {len(exclude)} for {len(trajs)}")
    B = len(trajs)
    T = max(2, max(len(t.token_ids) for t in trajs))
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    loss_mask = torch.zeros((B, T), dtype=torch.float32)
    logprobs = torch.zeros((B, T), dtype=torch.float32)
    for b, t in enumerate(trajs):
        n = len(t.token_ids)
        if n == 0:
            # an empty episode (an error before the prompt): one attended pad token, as a
            # row with nothing to attend to gives NaN attention
            attention_mask[b, 0] = 1
            continue
        input_ids[b, :n] = torch.tensor(t.token_ids, dtype=torch.long)
        attention_mask[b, :n] = 1
        if exclude is not None and exclude[b]:
            continue
        # shift left by one: column j describes token j+1
        loss_mask[b, : n - 1] = torch.tensor(t.loss_mask[1:], dtype=torch.float32)
        logprobs[b, : n - 1] = torch.tensor(t.logprobs[1:], dtype=torch.float32)
    logprobs *= loss_mask
    images = tuple(im for t in trajs for im in t.images)
    critic = [None if x is None else _aligned(trajs, x, T, name) * loss_mask
              for x, name in ((values, "values"), (returns, "returns"))]
    if not any(isinstance(a, Sequence) for a in advantages):
        return Batch(input_ids, attention_mask, loss_mask, logprobs,
                     torch.tensor(list(advantages), dtype=torch.float32), images, *critic)
    adv = _aligned(trajs, advantages, T, "advantages")
    return Batch(input_ids, attention_mask, loss_mask, logprobs, adv * loss_mask, images, *critic)


def _aligned(trajs: Sequence[Trajectory], lists: Sequence[Advantage], T: int, name: str) -> torch.Tensor:
    """[B, T] target-aligned from per-token lists aligned with token_ids (column j holds
    element j + 1). Raises ValueError when a list is not of its episode's length."""
    out = torch.zeros((len(trajs), T), dtype=torch.float32)
    for b, (t, a) in enumerate(zip(trajs, lists)):
        if not isinstance(a, Sequence) or len(a) != len(t.token_ids):
            raise ValueError(f"episode {b}: per-token {name} must all be lists of len(token_ids)")
        if len(a) > 1:
            out[b, : len(a) - 1] = torch.tensor(list(a[1:]), dtype=torch.float32)
    return out


def micro_batch_indices(lengths: Sequence[int], micro_batch_size: int, max_tokens: int = 0) -> list[list[int]]:
    """The episodes (indices into `lengths`, tokens per episode) of each micro-batch:
    sorted by length, at most `micro_batch_size` per batch and, with `max_tokens` > 0,
    at most that many padded tokens (B * T). Raises ValueError for micro_batch_size < 1."""
    if micro_batch_size < 1:
        raise ValueError("micro_batch_size must be >= 1")
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        cur = groups[-1] if groups else None
        n = max(2, lengths[i])  # sorted: the longest of the batch so far
        if cur is None or len(cur) >= micro_batch_size or (max_tokens > 0 and (len(cur) + 1) * n > max_tokens):
            groups.append([i])
        else:
            cur.append(i)
    return groups


def shard_updates(micro_batches: Sequence[Batch], updates: Sequence[Sequence[int]], rank: int,
                  world_size: int) -> tuple[list[Batch], list[list[int]]]:
    """Rank `rank`'s share of a step, data parallel over `world_size` ranks.

    micro_batches: the step's distinct micro-batches; updates: per optimizer update,
    its micro-batches (indices into `micro_batches`). Rank r takes micro-batches r,
    r + world_size, ... of each update. A rank left short gets a token-less pad (the
    update's first micro-batch with loss mask 0; one pad per distinct first
    micro-batch, so an epoch's repeat of an update reuses it), so every rank runs as
    many forward/backward passes per update and their gradient all-reduces pair up
    (engine_deepspeed.TrainEngine.train_step). Returns (the rank's micro-batches, in
    order of first use, pads included; per update, indices into them). Raises
    ValueError for a rank outside [0, world_size).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of {world_size}: must be in [0, {world_size})")
    mine: list[Batch] = []
    local: dict[int, int] = {}  # index in `micro_batches` -> index in `mine`
    pads: dict[int, int] = {}   # first micro-batch's index -> its pad's index in `mine`
    out: list[list[int]] = []
    for u in updates:
        per_rank = -(-len(u) // world_size)  # the most micro-batches of `u` any rank holds
        share = []
        for i in u[rank::world_size]:
            if i not in local:
                local[i] = len(mine)
                mine.append(micro_batches[i])
            share.append(local[i])
        if len(share) < per_rank:
            if u[0] not in pads:
                pads[u[0]] = len(mine)
                first = micro_batches[u[0]]
                mine.append(first._replace(loss_mask=torch.zeros_like(first.loss_mask)))
            share += [pads[u[0]]] * (per_rank - len(share))
        out.append(share)
    return mine, out


def micro_batches(trajs: Sequence[Trajectory], advantages: Sequence[Advantage], micro_batch_size: int,
                  pad_id: int, exclude: Sequence[bool] | None = None, max_tokens: int = 0,
                  values: Sequence[Sequence[float]] | None = None,
                  returns: Sequence[Sequence[float]] | None = None) -> list[Batch]:
    """Split episodes into Batches of at most `micro_batch_size` episodes and, with
    `max_tokens` > 0, at most that many padded tokens (B * T; an episode longer than
    that gets a Batch of its own). Episodes are sorted by length so that little compute
    goes to padding (length packing; the gradient is a sum over episodes, so order does
    not matter; micro_batch_indices). `exclude`, `values` and `returns` as in build_batch.
    """
    groups = micro_batch_indices([len(t.token_ids) for t in trajs], micro_batch_size, max_tokens)

    def part(seq, idx):
        return None if seq is None else [seq[i] for i in idx]

    return [build_batch([trajs[i] for i in idx], [advantages[i] for i in idx], pad_id, part(exclude, idx),
                        part(values, idx), part(returns, idx)) for idx in groups]


class MiniBatchPlan(NamedTuple):
    """A step's optimizer updates over its episodes.

    mini_batches: [k] lists of episode indices, the distinct mini-batches
    updates:      [epochs * k] the mini-batch (index into `mini_batches`) each update
                  trains on, in order
    """

    mini_batches: list[list[int]]
    updates: list[int]


def update_plan(episodes: Sequence[int], mini_batches: int, epochs: int, seed: int) -> MiniBatchPlan:
    """Which episodes each optimizer update of a step trains on: `epochs` passes over
    the episodes, each split into `mini_batches` updates of near-equal size (PPO's
    epochs and mini-batches, arXiv 1707.06347 Alg. 1; verl's ppo_epochs and
    ppo_mini_batch_size). The episodes are shuffled once per step, by a generator
    seeded with `seed` (deterministic), and every epoch trains on the same k =
    min(mini_batches, len(episodes)) mini-batches, in the same order (so their
    micro-batches are built once): updates are [0, ..., k - 1] `epochs` times. No
    episode: no mini-batch and no update.
    """
    if not episodes:
        return MiniBatchPlan([], [])
    g = torch.Generator().manual_seed(seed)
    perm = ([episodes[i] for i in torch.randperm(len(episodes), generator=g).tolist()] if mini_batches > 1
            else list(episodes))
    k = min(mini_batches, len(perm))
    parts = [perm[j * len(perm) // k:(j + 1) * len(perm) // k] for j in range(k)]
    return MiniBatchPlan(parts, [j for _ in range(epochs) for j in range(k)])


def policy_tokens(traj: Trajectory) -> int:
    """The episode's policy tokens as build_batch counts them (target-aligned: the
    first token, which nothing predicts, never is one)."""
    return int(sum(traj.loss_mask[1:]))


class PlannedUpdate(NamedTuple):
    """One optimizer update of a step: the mini-batch it forwards (an index into
    UpdatePlan.mini_batches), its loss's normalizers and the fraction of the step's
    updates done before it (for the lr schedule)."""

    mini_batch: int
    totals: AggTotals
    progress: float


class UpdatePlan(NamedTuple):
    """plan_updates' answer. mini_batches: the episodes each distinct mini-batch
    forwards (none empty); updates: the optimizer updates, in order (an epoch repeats
    the same mini-batch indices)."""

    mini_batches: list[list[int]]
    updates: list[PlannedUpdate]


def plan_updates(trainable: Sequence[int], skipped: Sequence[bool], tokens: Sequence[int], mini_batches: int,
                 epochs: int, seed: int, max_len: float) -> UpdatePlan:
    """The step's optimizer updates with the zero-variance groups left out of the
    forward but not out of the loss's normalizers.

    trainable: the episodes the loss covers (StepAdvantages: not excluded); skipped[i]:
    episode i is in a group whose advantages are all 0 (and the loss has no KL or entropy
    term), so its loss terms are exactly 0; tokens[i]: its policy tokens (policy_tokens);
    max_len: Dr. GRPO's constant L. The plan is update_plan over every trainable episode;
    each update then forwards its episodes that are not skipped, and its AggTotals count
    all of them. So the loss, and its gradient, are those of the update with the skipped
    episodes forwarded: skipping saves their compute and changes nothing else (TRL's
    GRPOTrainer, which forwards them, normalizes its "dapo"/token-mean loss over the
    whole batch likewise). Leaving them out of the normalizers would instead scale a step's
    gradient by 1 / (the fraction of its tokens with signal), up to 8x at 1 group of 8
    with signal. Mini-batches left with no episode are dropped, and their updates with
    them: their gradient is 0 and an AdamW step would still move the weights by momentum.
    Raises ValueError when skipped or tokens do not cover an episode.
    """
    if any(i >= len(skipped) or i >= len(tokens) for i in trainable):
        raise ValueError(f"skipped ({len(skipped)}) and tokens ({len(tokens)}) must cover every episode")
    plan = update_plan(trainable, mini_batches, epochs, seed)
    forwarded: list[list[int]] = []
    index: dict[int, int] = {}  # update_plan's mini-batch -> its index in `forwarded`
    for j, part in enumerate(plan.mini_batches):
        kept = [i for i in part if not skipped[i]]
        if kept:
            index[j] = len(forwarded)
            forwarded.append(kept)
    updates = []
    for n, j in enumerate(plan.updates):
        if j in index:
            part = plan.mini_batches[j]
            totals = AggTotals(tokens=float(sum(tokens[i] for i in part)),
                               seqs=float(sum(1 for i in part if tokens[i] > 0)), max_len=float(max_len))
            updates.append(PlannedUpdate(index[j], totals, n / len(plan.updates)))
    return UpdatePlan(forwarded, updates)
