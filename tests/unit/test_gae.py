"""PPO with a critic, the pure parts (services/learner/gae.py, step.plan_step with
advantage_estimator "gae"): GAE by hand, over policy tokens only; where an episode's
rewards go; the whitening; the clipped value loss; explained variance; the spec's rules."""

from __future__ import annotations

import math

import pytest
import torch

from opentinker.schemas import JobSpec, SpecError, Trajectory, TurnRecord
from opentinker.schemas.job import validate_job_spec
from opentinker.services.learner.gae import explained_variance, gae, gae_targets, token_rewards, value_loss
from opentinker.services.learner.step import plan_step


def _traj(prompt: int, turns: list[tuple[int, int, float]], reward: float | None = None, error: str = "",
          i: int = 0) -> Trajectory:
    """`prompt` prompt tokens, then per turn (policy tokens, env tokens after, reward)."""
    mask, recs, pos = [0] * prompt, [], prompt
    for gen, obs, r in turns:
        recs.append(TurnRecord(gen_start=pos, gen_end=pos + gen, obs_end=pos + gen + obs, reward=r))
        mask += [1] * gen + [0] * obs
        pos += gen + obs
    ids = [(5 * i + k) % 50 + 3 for k in range(pos)]
    total = sum(r for _, _, r in turns) if reward is None else reward
    return Trajectory(job_id="j", request_id="r", episode_id=f"e{i}", step=0, group_index=0, group_size=1,
                      token_ids=ids, loss_mask=mask, logprobs=[-1.0 * m for m in mask], prompt_len=prompt,
                      turns=recs, reward=total, policy_version=0, error=error)


def test_gae_by_hand():
    r, v = [0.0, 0.0, 1.0], [0.5, 0.25, 0.75]
    # lambda 1, gamma 1: Monte-Carlo return minus the value
    adv, ret = gae(r, v, 1.0, 1.0)
    assert adv == pytest.approx([0.5, 0.75, 0.25]) and ret == pytest.approx([1.0, 1.0, 1.0])
    # lambda 0: one-step TD errors r_k + gamma V_{k+1} - V_k
    adv, ret = gae(r, v, 0.9, 0.0)
    assert adv == pytest.approx([0.9 * 0.25 - 0.5, 0.9 * 0.75 - 0.25, 1.0 - 0.75])
    assert ret == pytest.approx([a + b for a, b in zip(adv, v)])
    # gamma 0.9, lambda 0.5: A_k = delta_k + 0.45 A_{k+1}
    d = [0.9 * 0.25 - 0.5, 0.9 * 0.75 - 0.25, 1.0 - 0.75]
    a2 = d[2]
    a1 = d[1] + 0.45 * a2
    assert gae(r, v, 0.9, 0.5)[0] == pytest.approx([d[0] + 0.45 * a1, a1, a2])
    with pytest.raises(ValueError, match="2 rewards for 3 values"):
        gae([0.0, 1.0], v, 1.0, 1.0)


def test_rewards_sit_on_each_turns_last_policy_token():
    t = _traj(2, [(2, 3, 0.5), (3, 1, 0.25)], reward=1.0)  # tokens: pp gg ooo ggg o
    r = token_rewards(t, bonus=-0.125)
    assert r[3] == 0.5  # turn 1's last policy token
    assert r[9] == pytest.approx(0.25 + (1.0 - 0.75) - 0.125)  # turn 2's, with the rest and the bonus
    assert sum(r) == pytest.approx(1.0 - 0.125) and r.count(0.0) == len(r) - 2
    no_turns = Trajectory(job_id="j", request_id="r", episode_id="e", step=0, group_index=0, group_size=1,
                          token_ids=[1, 2, 3, 4], loss_mask=[0, 1, 1, 0], logprobs=[0, -1, -1, 0], prompt_len=1,
                          turns=[], reward=2.0, policy_version=0)
    assert token_rewards(no_turns) == [0.0, 0.0, 2.0, 0.0]
    assert token_rewards(_traj(3, [])) == [0.0] * 3


def test_gae_runs_over_policy_tokens_skipping_the_environments():
    """The env's tokens between turns are no actions: the last token of turn 1 bootstraps
    from the first of turn 2, as if they were adjacent (verl's masked GAE)."""
    t = _traj(1, [(2, 3, 0.0), (1, 0, 1.0)])  # p gg ooo g
    values = [0.0, 0.5, 0.25, 9.0, 9.0, 9.0, 0.75]  # the env tokens' (9.0) must not count
    out = gae_targets([t], [values], [False], 1.0, 0.5)
    policy = [1, 2, 6]
    raw, ret = gae([0.0, 0.0, 1.0], [0.5, 0.25, 0.75], 1.0, 0.5)
    assert [out.returns[0][k] for k in policy] == pytest.approx(ret)
    assert [out.values[0][k] for k in policy] == [0.5, 0.25, 0.75]
    mean = sum(raw) / 3
    std = math.sqrt(sum((a - mean) ** 2 for a in raw) / 3)
    assert [out.advantages[0][k] for k in policy] == pytest.approx([(a - mean) / std for a in raw], rel=1e-5)
    assert all(out.advantages[0][k] == out.returns[0][k] == 0.0 for k in (0, 3, 4, 5))


def test_whitening_spans_the_step_and_leaves_excluded_episodes_at_zero():
    trajs = [_traj(2, [(3, 0, 1.0)], i=0), _traj(2, [(2, 0, 0.0)], i=1), _traj(2, [(4, 0, 1.0)], i=2, error="x")]
    values = [[0.1] * len(t.token_ids) for t in trajs]
    out = gae_targets(trajs, values, [False, False, True], 1.0, 1.0)
    trained = [a for t, adv in zip(trajs[:2], out.advantages[:2]) for a, m in zip(adv, t.loss_mask) if m]
    assert len(trained) == 5
    assert sum(trained) == pytest.approx(0.0, abs=1e-9)
    assert sum(a * a for a in trained) / 5 == pytest.approx(1.0, rel=1e-6)
    assert not any(out.advantages[2]) and not any(out.returns[2]) and not any(out.values[2])
    with pytest.raises(ValueError, match="episode 1: 3 values for 4 tokens"):
        gae_targets(trajs[:2], [values[0], [0.0] * 3], [False, False], 1.0, 1.0)


def test_the_value_loss_clips_around_the_old_values():
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    old = torch.zeros(1, 4)
    ret = torch.tensor([[0.0, 1.0, 1.0, -1.0]])
    v = torch.tensor([[5.0, 2.0, 0.25, 0.0]])
    out = value_loss(v, old, ret, mask, 0.5, torch.tensor([1.0 / 3]))
    # token 1 moved past old + 0.5, overshooting R: max((2-1)^2, (0.5-1)^2) is the
    # unclipped term; tokens 2 and 3 are inside the clip; column 0 is off the mask
    assert float(out.loss) == pytest.approx(0.5 * (1.0 + 0.75 ** 2 + 1.0) / 3)
    assert out.tokens == 3 and out.value_sum == pytest.approx(2.25) and out.clipped_sum == 0
    assert out.error_sum == pytest.approx(0.5 * (1.0 + 0.75 ** 2 + 1.0))
    # a prediction moved toward R by more than eps: the clipped term (1.1-3)^2 is the
    # larger, it is the loss, and its gradient through that token is 0
    d = torch.tensor([[0.0, 2.0, 0.0, 0.0]], requires_grad=True)
    down = value_loss(d, torch.tensor([[0.0, 1.0, 0.0, 0.0]]), torch.tensor([[0.0, 3.0, 0.0, 0.0]]), mask, 0.1,
                      torch.ones(1))
    assert down.clipped_sum == 1 and float(down.loss.detach()) == pytest.approx(0.5 * 1.9 ** 2)
    down.loss.backward()
    assert d.grad[0, 1] == 0
    # moved away from R by more than eps: the unclipped (0.75-3)^2 is the larger
    up = value_loss(torch.tensor([[0.0, 0.75, 0.0, 0.0]]), torch.tensor([[0.0, 1.0, 0.0, 0.0]]),
                    torch.tensor([[0.0, 3.0, 0.0, 0.0]]), mask, 0.1, torch.ones(1))
    assert up.clipped_sum == 0 and float(up.loss) == pytest.approx(0.5 * 2.25 ** 2)
    # eps 0: the unclipped 0.5 (V - R)^2, whatever V_old
    plain = value_loss(torch.tensor([[0.0, 3.0, 0.0, 0.0]]), old, ret, mask, 0.0, torch.ones(1))
    assert float(plain.loss) == pytest.approx(0.5 * (4.0 + 1.0 + 1.0)) and plain.clipped_sum == 0


def test_explained_variance():
    mask = torch.ones(1, 4)
    r = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    assert explained_variance(r, r, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(r, 2.5), r, mask) == pytest.approx(0.0)
    assert math.isnan(explained_variance(r, torch.ones(1, 4), mask))
    assert math.isnan(explained_variance(r, r, torch.tensor([[0.0, 0.0, 1.0, 0.0]])))


def test_plan_step_with_a_critic_carries_its_values_and_returns():
    spec = JobSpec(advantage_estimator="gae", group_size=1, prompts_per_step=3, micro_batch_size=2, lora_rank=0,
                   gae_lambda=0.95)
    trajs = [_traj(2, [(3, 0, 1.0)], i=0), _traj(3, [(2, 1, 0.0), (2, 0, 0.5)], i=1), _traj(2, [(2, 0, 0.0)], i=2)]
    seen = []

    def values(batches):  # a value of 0.1 * (column + 1) at every position
        seen.extend(batches)
        return [torch.arange(1, b.input_ids.shape[1] + 1).float().expand_as(b.loss_mask) * 0.1 * b.loss_mask
                for b in batches]

    plan = plan_step(trajs, spec, 0, pad_id=0, values=values)
    assert sum(b.input_ids.shape[0] for b in seen) == 3
    assert plan.stats["zero_variance_frac"] == 0.0 and plan.stats["skipped_frac"] == 0.0
    rows = [(b, r) for b in plan.micro_batches for r in range(b.input_ids.shape[0])]
    assert len(rows) == 3
    for b, r in rows:
        keep = b.loss_mask[r] > 0
        cols = keep.nonzero().flatten()
        assert torch.allclose(b.values[r][keep], (cols + 1).float() * 0.1)
        assert torch.all(b.values[r][~keep] == 0) and torch.all(b.returns[r][~keep] == 0)
        assert torch.all(b.advantages[r][~keep] == 0)
    # the returns with gamma 1: R = A_raw + V, and the last policy token's is its reward
    for b, r in rows:
        last = int((b.loss_mask[r] > 0).nonzero().flatten()[-1])
        n = int(b.attention_mask[r].sum())
        ep = next(t for t in trajs if len(t.token_ids) == n)
        assert float(b.returns[r, last]) == pytest.approx(ep.turns[-1].reward)
    with pytest.raises(ValueError, match="needs the critic's values"):
        plan_step(trajs, spec, 0, pad_id=0)


@pytest.mark.parametrize("change, field", [
    (dict(group_size=1), "group_size"),
    (dict(advantage_estimator="gae", learner_ranks=2), "learner_ranks"),
    (dict(advantage_estimator="gae", advantage="turn"), "advantage"),
    (dict(advantage_estimator="gae", dynamic_sampling=2), "dynamic_sampling"),
    (dict(critic_warmup=2), "critic_warmup"),  # no critic to warm up
])
def test_the_spec_rules_of_a_critic(change, field):
    with pytest.raises(SpecError) as e:
        validate_job_spec(JobSpec(**change))
    assert e.value.field == field
    validate_job_spec(JobSpec(advantage_estimator="gae", group_size=1))
    validate_job_spec(JobSpec(advantage_estimator="gae", group_size=1, steps=5, critic_warmup=5))  # critic alone
