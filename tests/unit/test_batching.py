"""Trajectories -> target-aligned tensors: shifting, padding, micro-batches, checks."""

import msgspec
import pytest
import torch

from opentinker.schemas import Trajectory, TurnRecord
from opentinker.services.learner.batching import build_batch, check_trajectory, micro_batches
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
