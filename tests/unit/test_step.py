"""A whole training step planned from toy trajectories (services/learner/step.py): which
episodes are forwarded and which only count in the normalizers, PPO's epochs and
mini-batches as indices into micro-batches built once, the learning-rate schedule, the
seeded shuffle, the reward bonuses; then one plan run by a tiny engine."""

from __future__ import annotations

import math
import os

import pytest
import torch

from opentinker.schemas import JobSpec, SamplingParams, Trajectory, TurnRecord
from opentinker.schemas.stats import derived_seed
from opentinker.services.learner.batching import policy_tokens, update_plan
from opentinker.services.learner.step import RewardBonus, plan_step, reward_bonus

PAD = 0


def _traj(i: int, prompt: int, gen: int, reward: float, error: str = "", finish: str = "stop") -> Trajectory:
    """Episode `i`: its first token is 100 + i, so a micro-batch row names its episode."""
    ids = [100 + i] + [(7 * i + 3 * k) % 50 + 10 for k in range(1, prompt + gen)]
    return Trajectory(job_id="j", request_id="r", episode_id=f"e{i}", step=0, group_index=0, group_size=2,
                      token_ids=ids, loss_mask=[0] * prompt + [1] * gen, logprobs=[0.0] * prompt + [-2.0] * gen,
                      prompt_len=prompt, reward=reward, policy_version=0, error=error,
                      turns=[TurnRecord(gen_start=prompt, gen_end=prompt + gen, obs_end=prompt + gen,
                                        finish_reason=finish)])


def _forwarded(plan) -> list[int]:
    """The episodes the plan's micro-batches hold, each row once, by first token."""
    return sorted(int(row[0]) - 100 for b in plan.micro_batches for row in b.input_ids)


def _spec(**kw) -> JobSpec:
    base = dict(prompts_per_step=3, group_size=3, micro_batch_size=2, lr=1e-3, steps=10)
    return JobSpec(**{**base, **kw})


def test_excluded_episodes_and_zero_variance_groups_are_not_forwarded_but_count_in_the_normalizers():
    # group 0 has signal; group 1's rewards are equal; group 2's episode 8 failed
    rewards = [1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    trajs = [_traj(i, 3, 2 + i, r, error="env crashed" if i == 8 else "") for i, r in enumerate(rewards)]
    plan = plan_step(trajs, _spec(), step=0, pad_id=PAD)
    assert _forwarded(plan) == [0, 1, 2, 6, 7]
    (tot,) = plan.totals  # one update: every trained episode's tokens and sequences, group 1's too
    assert tot.tokens == sum(policy_tokens(trajs[i]) for i in range(8)) and tot.seqs == 8.0
    assert tot.max_len == 32.0  # max_generated_tokens: sampling.max_new_tokens
    assert plan.stats == {"excluded_frac": 1 / 9, "zero_variance_frac": 1 / 3, "skipped_frac": 1 - 5 / 9,
                          "lr": 1e-3}
    # without skip_zero_variance the silent group is forwarded (loss mask on, advantage 0)
    assert _forwarded(plan_step(trajs, _spec(skip_zero_variance=False), 0, PAD)) == [0, 1, 2, 3, 4, 5, 6, 7]


def test_an_entropy_term_forwards_the_zero_variance_groups():
    trajs = [_traj(i, 3, 2, float(i % 2)) for i in range(2)] + [_traj(i, 3, 2, 1.0) for i in range(2, 4)]
    assert _forwarded(plan_step(trajs, _spec(prompts_per_step=2, group_size=2), 0, PAD)) == [0, 1]
    spec = _spec(prompts_per_step=2, group_size=2, entropy_coef=0.01)
    assert _forwarded(plan_step(trajs, spec, 0, PAD)) == [0, 1, 2, 3]


def test_two_epochs_of_two_mini_batches_are_four_updates_over_two_distinct_mini_batches():
    trajs = [_traj(i, 3, 2 + i % 3, float(i % 2)) for i in range(8)]
    spec = _spec(prompts_per_step=4, group_size=2, ppo_epochs=2, mini_batches=2, micro_batch_size=2)
    plan = plan_step(trajs, spec, step=3, pad_id=PAD)
    assert len(plan.updates) == len(plan.totals) == len(plan.lrs) == 4
    assert plan.updates[:2] == plan.updates[2:]  # the second epoch reuses the first's micro-batches
    first, second = plan.updates[:2]
    assert set(first).isdisjoint(second) and sorted(first + second) == list(range(len(plan.micro_batches)))
    assert _forwarded(plan) == list(range(8))  # each episode built into one micro-batch, once
    assert len(plan.micro_batches) == 4  # 4 episodes per mini-batch, 2 per micro-batch
    assert plan.totals[:2] == plan.totals[2:]


def test_the_mini_batches_are_shuffled_by_the_step_s_derived_seed():
    trajs = [_traj(i, 3, 2, float(i % 2)) for i in range(8)]
    spec = _spec(prompts_per_step=4, group_size=2, mini_batches=2, micro_batch_size=8, seed=11)

    def episodes(plan) -> list[list[int]]:
        return [sorted(int(r[0]) - 100 for i in u for r in plan.micro_batches[i].input_ids) for u in plan.updates]

    got = [episodes(plan_step(trajs, spec, step, PAD)) for step in (0, 1)]
    for step in (0, 1):
        want = update_plan(list(range(8)), 2, 1, derived_seed("update", spec.seed, step)).mini_batches
        assert got[step] == [sorted(m) for m in want]
    assert got[0] != got[1]  # another step, another shuffle
    assert episodes(plan_step(trajs, spec, 1, PAD)) == got[1]  # deterministic


def test_the_learning_rate_follows_the_schedule_update_by_update():
    trajs = [_traj(i, 3, 2, float(i % 2)) for i in range(4)]
    # warmup over 2 steps: step 1's two updates are at progress 1.0 and 1.5
    spec = _spec(prompts_per_step=2, group_size=2, mini_batches=2, lr_warmup_steps=2)
    plan = plan_step(trajs, spec, step=1, pad_id=PAD)
    assert plan.lrs == pytest.approx([0.5e-3, 0.75e-3]) and plan.stats["lr"] == plan.lrs[0]
    # linear decay to 0 at step 10: step 5 of 10, no warmup
    linear = plan_step(trajs, _spec(prompts_per_step=2, group_size=2, lr_schedule="linear"), 5, PAD)
    assert linear.lrs == pytest.approx([0.5e-3])


def test_a_step_without_signal_plans_no_update():
    trajs = [_traj(i, 3, 2, 1.0) for i in range(4)]
    plan = plan_step(trajs, _spec(prompts_per_step=2, group_size=2, ppo_epochs=2), 0, PAD)
    assert plan.micro_batches == [] and plan.updates == [] and plan.totals == [] and plan.lrs == []
    assert plan.stats["skipped_frac"] == 1.0 and plan.stats["lr"] == 0.0


def test_the_overlong_penalty_follows_dapo_s_soft_punishment():
    """L_max = 12, L_cache = 4: 0 up to 8 tokens, (8 - |y|) / 4 inside the buffer, -1
    past 12; times overlong_penalty (DAPO arXiv 2503.14476 eq. 13)."""
    spec = _spec(prompts_per_step=2, group_size=2, overlong_buffer=4, overlong_penalty=0.5,
                 sampling=SamplingParams(max_new_tokens=12))
    trajs = [_traj(0, 3, 8, 1.0), _traj(1, 3, 10, 1.0), _traj(2, 3, 13, 1.0), _traj(3, 3, 9, 1.0)]
    bonus = reward_bonus(trajs, spec, PAD)
    assert bonus.episode == pytest.approx([0.0, 0.5 * -0.5, 0.5 * -1.0, 0.5 * -0.25]) and bonus.kl is None
    assert bonus.per_episode() == pytest.approx(bonus.episode)
    assert reward_bonus(trajs[:1], spec, PAD) == RewardBonus(None, None)  # nothing penalized: no bonus
    assert RewardBonus(None, None).per_episode() is None
    # with the KL in the reward too: an outcome advantage sees the sum of both
    assert RewardBonus([-0.5, 0.0], [[0.0, -0.1, -0.2], [0.0] * 3]).per_episode() == pytest.approx([-0.8, 0.0])
    # equal rewards, different lengths: the penalty gives both groups a signal
    plan = plan_step(trajs, spec, 0, PAD)
    assert plan.stats["zero_variance_frac"] == 0.0 and _forwarded(plan) == [0, 1, 2, 3]
    silent = plan_step(trajs, _spec(prompts_per_step=2, group_size=2, sampling=SamplingParams(max_new_tokens=12)),
                       0, PAD)
    assert silent.stats["zero_variance_frac"] == 1.0


def test_kl_in_reward_subtracts_kl_coef_times_the_episode_s_summed_kl_to_the_reference():
    """k3 of the sampler's logprob -2.0 to a reference at -2.5 is exp(d) - d - 1 with
    d = -0.5, on each policy token; the bonus is -kl_coef times its sum over the episode."""
    spec = _spec(prompts_per_step=1, group_size=3, kl_in_reward=True, kl_coef=0.1, kl_estimator="k3")
    trajs = [_traj(0, 3, 2, 1.0), _traj(1, 4, 5, 1.0), _traj(2, 2, 3, 0.0)]
    seen = []

    def ref_logprobs(batches):
        seen.extend(b.input_ids.shape[0] for b in batches)
        return [torch.full_like(b.logprobs, -2.5) for b in batches]

    k3 = math.exp(-0.5) + 0.5 - 1
    bonus = reward_bonus(trajs, spec, PAD, ref_logprobs)
    assert bonus.per_episode() == pytest.approx([-0.1 * k3 * n for n in (2, 5, 3)]) and bonus.episode is None
    # per token, aligned with token_ids: the penalty on each policy token, 0 on the prompt
    assert bonus.kl[0] == pytest.approx([0.0] * 3 + [-0.1 * k3] * 2)
    assert sorted(seen) == [1, 2]  # in micro-batches of micro_batch_size
    k1 = _spec(prompts_per_step=1, group_size=3, kl_in_reward=True, kl_coef=0.1, kl_estimator="k1")
    assert reward_bonus(trajs, k1, PAD, ref_logprobs).per_episode() == pytest.approx([-0.1 * 0.5 * n
                                                                                     for n in (2, 5, 3)])
    # equal rewards, different KLs: the bonus makes the group's advantages differ
    plan = plan_step(trajs[:2] + [_traj(2, 2, 3, 1.0)], spec, 0, PAD, ref_logprobs)
    assert plan.stats["zero_variance_frac"] == 0.0
    with pytest.raises(ValueError, match="kl_in_reward"):
        plan_step(trajs, spec, 0, PAD)


def test_with_a_critic_the_kl_penalty_is_each_token_s_reward_not_the_episode_s_last():
    """verl's apply_kl_penalty: token_level_rewards = scores - beta * kld, then GAE over
    them. With gamma = lambda = 1 and values 0, a token's return is the reward plus the
    penalties of it and the tokens after it, not of the tokens before it; an overlong
    penalty stays on the last token."""
    kw = dict(prompts_per_step=2, group_size=1, kl_in_reward=True, kl_coef=0.1, kl_estimator="k1",
              advantage_estimator="gae", gae_gamma=1.0, gae_lambda=1.0, micro_batch_size=4)
    spec = _spec(**kw)
    trajs = [_traj(0, 3, 3, 1.0), _traj(1, 2, 2, 0.0)]

    def ref_logprobs(batches):
        return [torch.full_like(b.logprobs, -2.5) for b in batches]  # k1 = -2.0 - -2.5 = 0.5 a token

    def values(batches):
        return [torch.zeros_like(b.logprobs) for b in batches]

    plan = plan_step(trajs, spec, 0, PAD, ref_logprobs, values)
    [mb] = plan.micro_batches
    got = {int(row[0]) - 100: ret[mask > 0].tolist() for row, ret, mask in zip(mb.input_ids, mb.returns, mb.loss_mask)}
    assert got[0] == pytest.approx([1.0 - 0.15, 1.0 - 0.10, 1.0 - 0.05])
    assert got[1] == pytest.approx([-0.10, -0.05])
    overlong = _spec(**kw, overlong_buffer=2, overlong_penalty=0.5, sampling=SamplingParams(max_new_tokens=3))
    [mb] = plan_step(trajs, overlong, 0, PAD, ref_logprobs, values).micro_batches
    row = [int(r[0]) - 100 for r in mb.input_ids].index(0)  # 3 tokens of 3: 0.5 * (1 - 3) / 2 = -0.5
    assert mb.returns[row][mb.loss_mask[row] > 0].tolist() == pytest.approx([0.35, 0.40, 0.45])


def test_an_episode_cut_at_the_length_limit_is_filtered_out_but_counts_in_its_group_s_baseline():
    trajs = [_traj(0, 3, 2, 1.0), _traj(1, 3, 2, 0.0, finish="length"), _traj(2, 3, 2, 0.0),
             _traj(3, 3, 2, 1.0)]
    spec = _spec(prompts_per_step=1, group_size=4, overlong_filter=True)
    plan = plan_step(trajs, spec, 0, PAD)
    assert _forwarded(plan) == [0, 2, 3] and plan.stats["excluded_frac"] == 0.25
    # episode 1 counts in the group's mean: the others' advantages are (r - 0.5) / std
    advs = {int(r[0]) - 100: float(a) for b in plan.micro_batches for r, a in zip(b.input_ids, b.advantages)}
    assert advs[0] == pytest.approx(-advs[2]) and advs[0] > 0
    assert plan.totals[0].seqs == 3.0


@pytest.fixture
def rank_env(monkeypatch):
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(key, os.environ.get(key, value))


def test_an_engine_runs_a_planned_step_with_proximal_logprobs_once_per_distinct_micro_batch(tiny_model, rank_env):
    """2 epochs x 2 mini-batches under the behaviour correction: 4 optimizer updates,
    and the proximal logprobs computed once, before the first, for each of the step's
    distinct micro-batches (not once per epoch)."""
    from opentinker.services.learner.engine_deepspeed import TrainEngine

    spec = JobSpec(lora_rank=0, lr=1e-5, prompts_per_step=2, group_size=2, micro_batch_size=1, ppo_epochs=2,
                   mini_batches=2, rollout_is="token")
    eng = TrainEngine(spec, tiny_model, device="cpu")
    try:
        trajs = [_traj(i, 4 + i, 3, float(i % 2)) for i in range(4)]
        plan = plan_step(trajs, spec, 0, eng.pad_id)
        calls = []
        logprobs = eng.sequence_logprobs
        eng.sequence_logprobs = lambda batches, reference: calls.append(list(batches)) or logprobs(batches, reference)
        steps0 = eng.engine.global_steps
        out = eng.train_step(plan.micro_batches, plan.updates, plan.totals, plan.lrs)
        assert eng.engine.global_steps == steps0 + 4 and out["updates"] == 4.0
        (batches,) = calls
        assert len(batches) == len(plan.micro_batches) == 4
        assert sorted(int(b.input_ids[0, 0]) for b in batches) == [100, 101, 102, 103]
        assert out["grad_norm"] > 0 and out["tokens"] == sum(b.num_tokens for b in plan.micro_batches)
    finally:
        eng.close()
