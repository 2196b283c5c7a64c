"""Trajectories -> target-aligned tensors: shifting, padding, micro-batches, checks."""

import math

import msgspec
import pytest
import torch

from opentinker.schemas import Trajectory, TurnRecord
from opentinker.services.learner.batching import build_batch, check_trajectory, micro_batches, shard_updates
from opentinker.services.learner.loss import token_logprobs


def traj(token_ids, loss_mask, logprobs, reward=1.0, episode="e0"):
    n = len(token_ids)
    return Trajectory(job_id="j", request_id="r", episode_id=episode, step=0, group_index=0,
                      group_size=2, token_ids=token_ids, loss_mask=loss_mask, logprobs=logprobs,
                      prompt_len=2, turns=[TurnRecord(gen_start=2, gen_end=n, obs_end=n)],
                      reward=reward, policy_version=0)


def test_masks_and_logprobs_shift_left_by_one_and_pad():
    a = traj([10, 11, 12, 13, 14], [0, 0, 1, 1, 0], [0.0, 0.0, -1.0, -2.0, 0.0])
    b = traj([20, 21, 22], [0, 1, 1], [0.0, -0.5, -0.25])
    batch = build_batch([a, b], [0.5, -0.5], pad_id=7)
    assert batch.input_ids.tolist() == [[10, 11, 12, 13, 14], [20, 21, 22, 7, 7]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    # column t: is token t+1 a policy token, and the sampler's logprob of token t+1
    assert batch.loss_mask.tolist() == [[0, 1, 1, 0, 0], [1, 1, 0, 0, 0]]
    assert batch.logprobs.tolist() == [[0, -1, -2, 0, 0], [-0.5, -0.25, 0, 0, 0]]
    assert batch.advantages.tolist() == [0.5, -0.5]
    assert batch.num_tokens == 4


def test_learner_logprobs_line_up_with_the_samplers():
    """If the learner's model is the sampler, its logprobs equal the trajectory's on
    every policy token: the alignment of batching.py and loss.py agree."""
    torch.manual_seed(0)
    V, ids = 11, [3, 5, 1, 8, 2, 9]
    logits = torch.randn(1, len(ids), V)
    dist = torch.log_softmax(logits[0], -1)
    mask = [0, 0, 1, 1, 0, 1]
    sampler = [float(dist[t - 1, ids[t]]) if mask[t] else 0.0 for t in range(len(ids))]
    batch = build_batch([traj(ids, mask, sampler)], [1.0], pad_id=0)
    logp, _ = token_logprobs(logits, batch.input_ids)
    sel = batch.loss_mask.bool()
    assert torch.allclose(logp[sel], batch.logprobs[sel], atol=1e-6)
    assert sel.sum() == 3


def test_micro_batches_cover_every_episode_once():
    trajs = [traj(list(range(1, 3 + k)), [0] + [1] * (1 + k), [0.0] + [-0.1] * (1 + k), episode=f"e{k}")
             for k in range(5)]
    mbs = micro_batches(trajs, [float(k) for k in range(5)], 2, pad_id=0)
    assert [b.input_ids.shape[0] for b in mbs] == [2, 2, 1]
    assert sorted(a for b in mbs for a in b.advantages.tolist()) == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert sum(b.num_tokens for b in mbs) == sum(sum(t.loss_mask) for t in trajs)


@pytest.mark.parametrize("kw,field", [
    (dict(loss_mask=[0, 1]), "loss_mask"),
    (dict(logprobs=[0.0]), "logprobs"),
    (dict(loss_mask=[1, 1, 1]), "loss_mask"),
    (dict(token_ids=[1, 2, 99]), "token_ids"),
    (dict(logprobs=[0.0, float("nan"), -1.0]), "logprobs"),
])
def test_bad_trajectories_are_refused_naming_the_field(kw, field):
    base = dict(token_ids=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0.0, -1.0, -1.0])
    t = traj(**{**base, **kw})
    with pytest.raises(ValueError, match=f"Trajectory.{field}"):
        check_trajectory(t, vocab_size=50)


def test_an_errored_empty_episode_is_valid_and_pads_safely():
    empty = msgspec.structs.replace(traj([], [], [], reward=0.0), error="env reset failed", turns=[])
    check_trajectory(empty, vocab_size=50)
    check_trajectory(traj([1, 2, 3], [0, 0, 0], [0.0] * 3), vocab_size=50)  # no policy token
    batch = build_batch([empty, traj([5, 6, 7], [0, 1, 1], [0.0, -1.0, -1.0])], [0.0, 1.0], pad_id=0)
    assert batch.loss_mask[0].sum() == 0
    assert batch.attention_mask[0].tolist() == [1, 0, 0]  # never a row with nothing to attend to


def test_per_token_advantages_follow_the_turns_and_shift_like_the_mask():
    from opentinker.services.learner.batching import token_advantages

    # prompt [0, 2), turn 0 policy [2, 4), observation [4, 5), turn 1 policy [5, 7)
    t = Trajectory(job_id="j", request_id="r", episode_id="e", step=0, group_index=0, group_size=2,
                   token_ids=[1, 2, 3, 4, 5, 6, 7], loss_mask=[0, 0, 1, 1, 0, 1, 1],
                   logprobs=[0, 0, -1, -1, 0, -1, -1], prompt_len=2,
                   turns=[TurnRecord(gen_start=2, gen_end=4, obs_end=5),
                          TurnRecord(gen_start=5, gen_end=7, obs_end=7)], reward=1.0, policy_version=0)
    per_token = token_advantages(t, [0.5, -2.0])
    assert per_token == [0, 0, 0.5, 0.5, 0, -2.0, -2.0]
    batch = build_batch([t], [per_token], pad_id=0)
    assert batch.advantages.tolist() == [[0, 0.5, 0.5, 0, -2.0, -2.0, 0]]
    with pytest.raises(ValueError, match="turn advantages"):
        token_advantages(t, [1.0])


def episode(reward, error="", group=0, k=0):
    """A one-turn episode: prompt [1, 2], policy tokens [3, 4]."""
    return Trajectory(job_id="j", request_id=f"r{group}", episode_id=f"g{group}e{k}", step=0,
                      group_index=group, group_size=4, token_ids=[1, 2, 3, 4], loss_mask=[0, 0, 1, 1],
                      logprobs=[0.0, 0.0, -1.0, -1.0], prompt_len=2,
                      turns=[TurnRecord(gen_start=2, gen_end=4, obs_end=4, reward=reward)],
                      reward=reward, policy_version=0, error=error)


def test_error_episodes_are_left_out_of_the_loss_and_of_their_group_statistics():
    from opentinker.services.learner.batching import step_advantages

    # group 0: three successes and an env crash (its reward -1 says nothing about the
    # policy); group 1: a single success among three crashes (nothing to compare with)
    g0 = [episode(1.0, k=0), episode(0.0, k=1), episode(-1.0, "env crashed", k=2), episode(1.0, k=3)]
    g1 = [episode(1.0, group=1, k=0)] + [episode(0.0, "engine error", group=1, k=k) for k in (1, 2, 3)]
    step = step_advantages(g0 + g1, prompts_per_step=2, group_size=4)
    # non-error rewards [1, 0, 1]: mean 2/3, sample std sqrt((1/9 + 4/9 + 1/9) / 2) = 1/sqrt(3)
    s = 3 ** -0.5 + 1e-6
    assert step.advantages[:4] == pytest.approx([(1 / 3) / s, -(2 / 3) / s, 0.0, (1 / 3) / s], rel=1e-6)
    assert step.advantages[4:] == [0.0] * 4
    assert step.excluded == [False, False, True, False, True, True, True, True]
    assert step.excluded_frac == 5 / 8

    batch = build_batch(g0, step.advantages[:4], pad_id=0, exclude=step.excluded[:4])
    assert batch.loss_mask.tolist() == [[0, 1, 1, 0]] * 2 + [[0, 0, 0, 0]] + [[0, 1, 1, 0]]
    assert batch.logprobs[2].tolist() == [0.0] * 4
    mbs = micro_batches(g0 + g1, step.advantages, 3, pad_id=0, exclude=step.excluded)
    assert sum(b.num_tokens for b in mbs) == 3 * 2  # only group 0's three successes train


def test_turn_credit_also_leaves_error_episodes_out():
    from opentinker.services.learner.batching import step_advantages

    g = [episode(1.0, k=0), episode(0.0, k=1), episode(-1.0, "env crashed", k=2), episode(0.0, k=3)]
    step = step_advantages(g, prompts_per_step=1, group_size=4, credit="turn", turn_discount=0.9)
    # non-error returns [1, 0, 0]: mean 1/3, sample std sqrt((4/9 + 1/9 + 1/9) / 2) = 1/sqrt(3)
    s = 3 ** -0.5 + 1e-6
    assert step.advantages[0] == pytest.approx([0, 0, (2 / 3) / s, (2 / 3) / s], rel=1e-6)
    assert step.advantages[1] == pytest.approx([0, 0, -(1 / 3) / s, -(1 / 3) / s], rel=1e-6)
    assert step.advantages[2] == [0.0] * 4
    assert step.excluded == [False, False, True, False]
    batch = build_batch(g, step.advantages, pad_id=0, exclude=step.excluded)
    assert batch.advantages[2].tolist() == [0.0] * 4 and batch.loss_mask[2].sum() == 0


def test_step_advantages_without_errors_are_grpos_and_check_the_step_size():
    from opentinker.services.learner.batching import step_advantages
    from opentinker.services.learner.loss import group_advantages

    rewards = [1.0, 0.0, 0.5, 0.5, 0.2, 0.2]
    step = step_advantages([episode(r, k=k) for k, r in enumerate(rewards)], prompts_per_step=3, group_size=2)
    assert step.advantages == pytest.approx(group_advantages(torch.tensor(rewards).view(3, 2)).view(-1).tolist())
    assert step.excluded == [False] * 6 and step.excluded_frac == 0.0
    with pytest.raises(ValueError, match="3 groups of 2"):
        step_advantages([episode(1.0)] * 5, prompts_per_step=3, group_size=2)
    with pytest.raises(ValueError, match="credit"):
        step_advantages([episode(1.0)] * 2, prompts_per_step=1, group_size=2, credit="token")


# --- the objective's options at the step level (estimators, reward shaping, filtering) ---

def test_reinforce_pp_whitens_the_group_centred_advantages_over_the_whole_step():
    from opentinker.services.learner.batching import step_advantages

    # group 0 [1, 0, 0]: mean 1/3 -> [2/3, -1/3, -1/3]; group 1 [2, 2, -1]: mean 1 -> [1, 1, -2]
    rewards = [1.0, 0.0, 0.0, 2.0, 2.0, -1.0]
    centred = [2 / 3, -1 / 3, -1 / 3, 1.0, 1.0, -2.0]
    # 2 policy tokens each: token mean 0, variance (4/9 + 1/9 + 1/9 + 1 + 1 + 4) / 6 = 10/9
    rstd = (10 / 9) ** -0.5
    step = step_advantages([episode(r, group=k // 3, k=k) for k, r in enumerate(rewards)],
                           prompts_per_step=2, group_size=3, estimator="reinforce_pp")
    assert step.advantages == pytest.approx([c * rstd for c in centred], rel=1e-6)
    # an errored episode is left out of its group's mean and of the step's statistics
    trajs = [episode(r, group=k // 3, k=k) for k, r in enumerate(rewards)]
    trajs[5] = episode(-1.0, "env crashed", group=1, k=5)
    step = step_advantages(trajs, prompts_per_step=2, group_size=3, estimator="reinforce_pp")
    # group 1 is now [2, 2]: all 0; the statistics over [2/3, -1/3, -1/3, 0, 0]: mean 0, var (6/9) / 5
    rstd = (6 / 45) ** -0.5
    assert step.advantages == pytest.approx([2 / 3 * rstd, -1 / 3 * rstd, -1 / 3 * rstd, 0, 0, 0], rel=1e-6)
    assert step.zero_groups == [False, True]


def _answer(reward, n_policy, group, k):
    """A one-turn episode of prompt [1, 2] and `n_policy` policy tokens."""
    ids = [1, 2] + [3] * n_policy
    return Trajectory(job_id="j", request_id=f"r{group}", episode_id=f"g{group}e{k}", step=0, group_index=group,
                      group_size=2, token_ids=ids, loss_mask=[0, 0] + [1] * n_policy,
                      logprobs=[0.0, 0.0] + [-1.0] * n_policy, prompt_len=2,
                      turns=[TurnRecord(gen_start=2, gen_end=len(ids), obs_end=len(ids), reward=reward)],
                      reward=reward, policy_version=0)


def test_reinforce_pp_whitens_over_tokens_so_long_answers_count_for_their_length():
    """REINFORCE++ normalizes over the batch's tokens (arXiv 2501.03262 §3; OpenRLHF's
    masked mean and variance over every action token): a wrong answer of 3 tokens
    counts 3 times in the mean and the variance, and a group of equal rewards, centred
    to 0, moves by -mean * rstd like every other token (so it is no zero group)."""
    from opentinker.services.learner.batching import step_advantages

    # group 0 [1, 0] with 1 and 3 policy tokens -> [0.5, -0.5]; group 1 [1, 1], 2 tokens each -> [0, 0]
    trajs = [_answer(1.0, 1, 0, 0), _answer(0.0, 3, 0, 1), _answer(1.0, 2, 1, 0), _answer(1.0, 2, 1, 1)]
    # tokens: 0.5 x1, -0.5 x3, 0 x4: mean -1/8; variance (0.625^2 + 3 * 0.375^2 + 4 * 0.125^2) / 8
    mean, var = -1 / 8, (0.625 ** 2 + 3 * 0.375 ** 2 + 4 * 0.125 ** 2) / 8
    expected = [(a - mean) / math.sqrt(var) for a in (0.5, -0.5, 0.0, 0.0)]
    step = step_advantages(trajs, prompts_per_step=2, group_size=2, estimator="reinforce_pp")
    assert step.advantages == pytest.approx(expected, rel=1e-9)
    per_token = [a for a, t in zip(step.advantages, trajs) for _ in range(sum(t.loss_mask[1:]))]
    assert sum(per_token) / 8 == pytest.approx(0.0, abs=1e-12)  # whitened over the tokens
    assert sum(x * x for x in per_token) / 8 == pytest.approx(1.0, rel=1e-9)
    assert step.zero_groups == [False, False]
    # turn credit: the same numbers on every policy token, 0 on the prompt
    turn = step_advantages(trajs, prompts_per_step=2, group_size=2, credit="turn", estimator="reinforce_pp")
    for a, t, e in zip(turn.advantages, trajs, expected):
        assert a[:2] == [0.0, 0.0] and a[2:] == pytest.approx([e] * (len(t.token_ids) - 2), rel=1e-9)


def test_rloo_and_dr_grpo_step_advantages():
    from opentinker.services.learner.batching import step_advantages

    trajs = [episode(r, k=k) for k, r in enumerate([1.0, 0.0, 0.0, 0.5])]  # mean 0.375
    rloo = step_advantages(trajs, prompts_per_step=1, group_size=4, estimator="rloo")
    assert rloo.advantages == pytest.approx([1 - 0.5 / 3, 0 - 1.5 / 3, 0 - 1.5 / 3, 0.5 - 1 / 3], rel=1e-6)
    dr = step_advantages(trajs, prompts_per_step=1, group_size=4, estimator="dr_grpo")
    assert dr.advantages == pytest.approx([0.625, -0.375, -0.375, 0.125], rel=1e-6)


def test_reward_bonus_shifts_the_rewards_before_the_advantages():
    from opentinker.services.learner.batching import step_advantages

    # equal rewards, no signal; the bonus (a KL or overlong penalty) makes [1, 0.5]:
    # mean 0.75, sample std sqrt(2 * 0.0625) = 0.25 * sqrt(2)
    trajs = [episode(1.0, k=0), episode(1.0, k=1)]
    assert step_advantages(trajs, 1, 2).advantages == [0.0, 0.0]
    step = step_advantages(trajs, 1, 2, reward_bonus=[0.0, -0.5])
    s = 0.25 * 2 ** 0.5 + 1e-6
    assert step.advantages == pytest.approx([0.25 / s, -0.25 / s], rel=1e-6)
    assert step.zero_groups == [False]
    with pytest.raises(ValueError, match="reward_bonus"):
        step_advantages(trajs, 1, 2, reward_bonus=[0.0])


def test_reward_bonus_with_turn_credit_goes_to_the_last_turn():
    from opentinker.services.learner.batching import step_advantages

    def two_turns(r0, r1, k):
        # prompt [0, 2), turn 0 policy [2, 4), observation [4, 5), turn 1 policy [5, 7)
        return Trajectory(job_id="j", request_id="r", episode_id=f"e{k}", step=0, group_index=0, group_size=2,
                          token_ids=[1, 2, 3, 4, 5, 6, 7], loss_mask=[0, 0, 1, 1, 0, 1, 1],
                          logprobs=[0, 0, -1, -1, 0, -1, -1], prompt_len=2,
                          turns=[TurnRecord(gen_start=2, gen_end=4, obs_end=5, reward=r0),
                                 TurnRecord(gen_start=5, gen_end=7, obs_end=7, reward=r1)],
                          reward=r0 + r1, policy_version=0)

    # gamma 0.5, bonus -1 on episode 1's last turn: turn rewards A [0, 1], B [0, 1 - 1 = 0]
    # returns A [0.5, 1], B [0, 0]. Turn 0: [0.5, 0], mean 0.25, sample std 0.25 * sqrt(2);
    # turn 1: [1, 0], mean 0.5, sample std 0.5 * sqrt(2)
    step = step_advantages([two_turns(0.0, 1.0, 0), two_turns(0.0, 1.0, 1)], 1, 2, credit="turn",
                           turn_discount=0.5, reward_bonus=[0.0, -1.0])
    s0, s1 = 0.25 * 2 ** 0.5 + 1e-6, 0.5 * 2 ** 0.5 + 1e-6
    a0, a1 = 0.25 / s0, 0.5 / s1
    b0, b1 = -0.25 / s0, -0.5 / s1
    assert step.advantages[0] == pytest.approx([0, 0, a0, a0, 0, a1, a1], rel=1e-6)
    assert step.advantages[1] == pytest.approx([0, 0, b0, b0, 0, b1, b1], rel=1e-6)


def test_mask_out_counts_in_the_statistics_but_does_not_train():
    from opentinker.services.learner.batching import step_advantages

    # DAPO's overlong filtering: episode 1 (truncated) counts in the group's mean and std
    # (rewards [1, 0, 0, 1]: mean 0.5, sample std sqrt(1/3)) but gets advantage 0, no loss
    trajs = [episode(r, k=k) for k, r in enumerate([1.0, 0.0, 0.0, 1.0])]
    step = step_advantages(trajs, 1, 4, mask_out=[False, True, False, False])
    s = 3 ** -0.5 + 1e-6
    assert step.advantages == pytest.approx([0.5 / s, 0.0, -0.5 / s, 0.5 / s], rel=1e-6)
    assert step.excluded == [False, True, False, False] and step.excluded_frac == 0.25
    batch = build_batch(trajs, step.advantages, pad_id=0, exclude=step.excluded)
    assert batch.loss_mask.sum(1).tolist() == [2.0, 0.0, 2.0, 2.0]
    # leaving it out of the statistics instead ([1, 0, 1]) would give other numbers
    s3 = 3 ** -0.5 + 1e-6
    assert step.advantages[0] != pytest.approx((1 / 3) / s3, rel=1e-3)
    with pytest.raises(ValueError, match="mask_out"):
        step_advantages(trajs, 1, 4, mask_out=[False])


def test_zero_groups_and_zero_variance_frac():
    from opentinker.services.learner.batching import StepAdvantages, step_advantages

    g0 = [episode(1.0, group=0, k=0), episode(1.0, group=0, k=1)]             # equal rewards
    g1 = [episode(1.0, group=1, k=0), episode(0.0, group=1, k=1)]             # signal
    g2 = [episode(1.0, group=2, k=0), episode(0.0, "engine error", group=2, k=1)]  # one left: no baseline
    g3 = [episode(1.0, group=3, k=0), episode(0.0, group=3, k=1)]             # signal, but all masked out
    step = step_advantages(g0 + g1 + g2 + g3, prompts_per_step=4, group_size=2,
                           mask_out=[False] * 6 + [True, True])
    assert step.zero_groups == [True, False, True, True]
    assert step.zero_variance_frac == 0.75
    assert StepAdvantages([], [], []).zero_variance_frac == 0.0
    turn = step_advantages(g0 + g1, prompts_per_step=2, group_size=2, credit="turn")
    assert turn.zero_groups == [True, False] and turn.zero_variance_frac == 0.5


def test_micro_batch_indices_respect_a_token_budget():
    from opentinker.services.learner.batching import micro_batch_indices

    lengths = [5, 2, 9, 3, 4, 20]
    # sorted by length: 1 (2), 3 (3), 4 (4), 0 (5), 2 (9), 5 (20)
    assert micro_batch_indices(lengths, 4) == [[1, 3, 4, 0], [2, 5]]
    # budget 12 padded tokens: [1, 3, 4] is 3 x 4 = 12; adding 0 would be 4 x 5 = 20;
    # [0, 2] would be 2 x 9 = 18; 20 > 12 alone
    groups = micro_batch_indices(lengths, 4, max_tokens=12)
    assert groups == [[1, 3, 4], [0], [2], [5]]
    for g in groups:
        assert len(g) * max(lengths[i] for i in g) <= 12 or len(g) == 1
    assert micro_batch_indices(lengths, 2, max_tokens=1000) == [[1, 3], [4, 0], [2, 5]]
    assert sorted(i for g in micro_batch_indices(lengths, 3, max_tokens=10) for i in g) == list(range(6))
    with pytest.raises(ValueError, match="micro_batch_size"):
        micro_batch_indices(lengths, 0)


def test_micro_batches_with_a_token_budget_pad_within_it():
    trajs = [traj(list(range(1, n + 1)), [0] + [1] * (n - 1), [0.0] + [-0.1] * (n - 1), episode=f"e{n}")
             for n in (3, 7, 4, 12, 3)]
    mbs = micro_batches(trajs, [0.0] * 5, 8, pad_id=0, max_tokens=14)
    assert [tuple(b.input_ids.shape) for b in mbs] == [(3, 4), (1, 7), (1, 12)]
    assert sum(b.num_tokens for b in mbs) == sum(sum(t.loss_mask) for t in trajs)


def test_update_plan_epochs_and_mini_batches():
    from opentinker.services.learner.batching import update_plan

    episodes = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    plan = update_plan(episodes, mini_batches=3, epochs=2, seed=7)
    assert len(plan.mini_batches) == 3 and plan.updates == [0, 1, 2, 0, 1, 2]  # every epoch reuses them
    assert sorted(len(p) for p in plan.mini_batches) == [3, 3, 4]
    assert sorted(i for p in plan.mini_batches for i in p) == episodes  # each episode once per epoch
    assert update_plan(episodes, 3, 2, seed=7) == plan  # deterministic
    others = [update_plan(episodes, 3, 2, seed=s) for s in (1, 2, 3)]
    assert any(o != plan for o in others)  # the seed shuffles
    assert [i for p in plan.mini_batches for i in p] != episodes  # shuffled, not in order
    # one mini-batch: the whole step, in order, once per epoch
    assert update_plan(episodes, 1, 3, seed=7) == ([episodes], [0, 0, 0])
    # more mini-batches than episodes: one episode each
    small = update_plan([4, 5, 6], 8, 1, seed=0)
    assert sorted(small.mini_batches) == [[4], [5], [6]] and small.updates == [0, 1, 2]
    assert update_plan([], 2, 2, seed=0) == ([], [])


def test_data_parallel_shards_split_each_update_evenly_and_pad_with_token_less_batches():
    eps = [traj([1, 2, 3, 4 + i], [0, 1, 1, 1], [0.0, -1.0, -1.0, -1.0], episode=f"e{i}") for i in range(5)]
    mbs = micro_batches(eps, [1.0] * 5, 1, 0)  # 5 micro-batches of one episode
    updates = [[0, 1, 2, 3, 4], [0, 1], []]
    shards = [shard_updates(mbs, updates, r, 2) for r in range(2)]
    assert [[len(u) for u in up] for _, up in shards] == [[3, 1, 0], [3, 1, 0]]  # as many on each rank
    # every micro-batch on exactly one rank; rank 1's third is a pad holding no policy token
    (mine0, up0), (mine1, up1) = shards
    assert [mine0[i].input_ids[0, 3] for i in up0[0]] == [4, 6, 8] and up0[1] == [up0[0][0]]
    assert [mine1[i].input_ids[0, 3] for i in up1[0][:2]] == [5, 7] and up1[1] == [up1[0][0]]
    pad = mine1[up1[0][2]]
    assert pad.num_tokens == 0 and torch.equal(pad.input_ids, mbs[0].input_ids)
    assert len(mine0) == 3 and len(mine1) == 3  # each rank holds its share once, and its pad as an entry
    assert sum(mine[i].num_tokens for mine, up in shards for i in up[0]) == sum(b.num_tokens for b in mbs)
    # an epoch repeats an update's indices: one pad entry serves both
    mine, again = shard_updates(mbs, [[0, 1, 2], [0, 1, 2]], 1, 2)
    assert again[0] == again[1] and len(mine) == 2 and mine[again[0][1]].num_tokens == 0
    # one rank: everything
    mine, whole = shard_updates(mbs, updates, 0, 1)
    assert whole == updates and len(mine) == 5 and all(a is b for a, b in zip(mine, mbs))
    with pytest.raises(ValueError, match="rank 2 of 2"):
        shard_updates(mbs, updates, 2, 2)


def test_plan_updates_skip_the_forward_not_the_normalizer():
    from opentinker.services.learner.batching import plan_updates, policy_tokens, update_plan

    # 8 episodes (4 groups of 2): group 1 (episodes 2, 3) and group 3 (6, 7) have no
    # signal; episode 5 is excluded (not trainable)
    tokens = [3, 5, 2, 4, 6, 1, 7, 2]
    skipped = [False, False, True, True, False, False, True, True]
    trainable = [0, 1, 2, 3, 4, 6, 7]
    one = plan_updates(trainable, skipped, tokens, 1, 1, seed=0, max_len=32)
    assert one.mini_batches == [[0, 1, 4]] and len(one.updates) == 1
    assert one.updates[0].mini_batch == 0 and one.updates[0].progress == 0.0
    # the normalizers are the whole step's (29 tokens in 7 sequences), not the 14 tokens
    # of the 3 forwarded episodes: the loss is that of the update with the skipped
    # episodes forwarded (their terms are 0), so the gradient is too
    totals = one.updates[0].totals
    assert totals.tokens == 29.0 and totals.seqs == 7.0 and totals.max_len == 32.0
    # mini-batches and epochs: the plan is made over every trainable episode, then
    # each update forwards its unskipped ones and counts them all
    full = update_plan(trainable, 3, 2, seed=5)
    plan = plan_updates(trainable, skipped, tokens, 3, 2, seed=5, max_len=32)
    kept = [(n, [i for i in full.mini_batches[j] if not skipped[i]], j) for n, j in enumerate(full.updates)]
    assert [plan.mini_batches[u.mini_batch] for u in plan.updates] == [k for _, k, _ in kept if k]
    assert [u.progress for u in plan.updates] == [n / 6 for n, k, _ in kept if k]
    for u, (_, _, j) in zip(plan.updates, [x for x in kept if x[1]]):
        assert u.totals.tokens == sum(tokens[i] for i in full.mini_batches[j])
    n = len(plan.updates) // 2
    assert [u.mini_batch for u in plan.updates[:n]] == [u.mini_batch for u in plan.updates[n:]]  # built once
    assert all(plan.mini_batches) and len(plan.mini_batches) == n  # only mini-batches something forwards
    # a zero-length episode counts no sequence
    assert plan_updates([0, 1], [False, True], [4, 0], 1, 1, 0, 8).updates[0].totals.seqs == 1.0
    # nothing with signal: no update at all
    assert plan_updates(trainable, [True] * 8, tokens, 2, 2, seed=0, max_len=32) == ([], [])
    with pytest.raises(ValueError, match="cover"):
        plan_updates([0, 9], skipped, tokens, 1, 1, 0, 32)
    # policy tokens as build_batch counts them: the first token is never one
    t = traj([1, 2, 3, 4], [1, 0, 1, 1], [0.0, 0.0, -0.5, -0.5])
    assert policy_tokens(t) == 2 == build_batch([t], [0.0], pad_id=0).num_tokens
