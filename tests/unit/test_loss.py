"""The GRPO objective: advantages, clipped surrogate, masking, KL, normalization.

Options beyond GRPO's defaults (estimators, clip-higher, dual clip, GSPO, loss
aggregation, rollout correction, ...) are in test_loss_options.py."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opentinker.services.learner.loss import (AggTotals, LossConfig, aggregation_weights, group_advantages,
                                              k3_kl, policy_loss, token_logprobs)


def clip(eps: float, **kw) -> LossConfig:
    """GRPO's symmetric clip [1 - eps, 1 + eps], other options as given."""
    return LossConfig(clip_low=eps, clip_high=eps, **kw)


def test_advantages_are_group_relative_and_zero_for_a_flat_group():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    adv = group_advantages(rewards)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()  # sample std, as TRL and verl
    assert torch.allclose(adv[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-6))
    assert torch.equal(adv[1], torch.zeros(4))


def test_advantages_reject_a_flat_vector():
    with pytest.raises(ValueError, match="n_groups, group_size"):
        group_advantages(torch.tensor([1.0, 0.0]))


def test_clipped_surrogate_matches_hand_computation():
    eps = 0.2
    logp_old = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    # ratios 1.5 (clipped to 1.2), 0.6 (clipped to 0.8), 1.1 (inside)
    logp = torch.log(torch.tensor([[0.75, 0.3, 0.55]]))
    mask = torch.ones(1, 3)
    for a in (1.0, -2.0):
        out = policy_loss(logp, logp_old, torch.tensor([a]), mask, clip(eps))
        hand = [-min(r * a, max(min(r, 1 + eps), 1 - eps) * a) for r in (1.5, 0.6, 1.1)]
        assert out.loss.item() == pytest.approx(sum(hand) / 3, rel=1e-5)
    assert out.clipped_sum == 2.0  # |rho - 1| > eps at the first two tokens


def test_gradient_is_zero_where_the_clip_binds():
    logp_old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[1.5, 1.1]])).requires_grad_()
    policy_loss(logp, logp_old, torch.tensor([1.0]), torch.ones(1, 2), clip(0.2)).loss.backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] != 0


def test_masked_tokens_contribute_nothing():
    torch.manual_seed(0)
    logp = (-torch.rand(2, 5)).requires_grad_()
    logp_old, logp_ref = -torch.rand(2, 5), -torch.rand(2, 5)
    mask = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 1, 1, 1]], dtype=torch.float32)
    adv = torch.tensor([1.0, -1.0])
    out = policy_loss(logp, logp_old, adv, mask, clip(0.2, kl_coef=0.1), logp_ref=logp_ref)
    out.loss.backward()
    assert torch.all(logp.grad[mask == 0] == 0)
    assert out.tokens == 5.0
    # wild values under the mask (padding, prompt tokens) change nothing
    wild = logp.detach().clone()
    wild[mask == 0] = -50.0
    out2 = policy_loss(wild, logp_old, adv, mask, clip(0.2, kl_coef=0.1), logp_ref=logp_ref)
    assert out2.loss.item() == pytest.approx(out.loss.item())
    assert out2.kl_sum == pytest.approx(out.kl_sum)


def test_k3_kl_is_zero_for_equal_policies_and_positive_otherwise():
    logp = -torch.rand(3, 4)
    assert torch.all(k3_kl(logp, logp) == 0)
    assert torch.all(k3_kl(logp, logp - 0.3) > 0)
    out = policy_loss(logp, logp, torch.ones(3), torch.ones(3, 4), clip(0.2, kl_coef=1.0), logp_ref=logp)
    assert out.kl_sum == 0.0 and out.approx_kl_sum == 0.0


def test_micro_batch_losses_add_up_to_the_token_mean():
    torch.manual_seed(1)
    logp, logp_old = -torch.rand(4, 6), -torch.rand(4, 6)
    mask = (torch.rand(4, 6) > 0.3).float()
    adv = torch.randn(4)
    whole = policy_loss(logp, logp_old, adv, mask, clip(0.2)).loss
    total = float(mask.sum())
    # each micro-batch weighted by the whole update's token count (old num_tokens=)
    parts = sum(policy_loss(logp[k:k + 2], logp_old[k:k + 2], adv[k:k + 2], mask[k:k + 2], clip(0.2),
                            weights=torch.full((2,), 1.0 / total)).loss for k in (0, 2))
    assert parts.item() == pytest.approx(whole.item(), rel=1e-6)
    # the same through aggregation_weights with the update's totals
    totals = AggTotals(tokens=total, seqs=float((mask.sum(1) > 0).sum()), max_len=6.0)
    parts = sum(policy_loss(logp[k:k + 2], logp_old[k:k + 2], adv[k:k + 2], mask[k:k + 2], clip(0.2),
                            weights=aggregation_weights(mask[k:k + 2], "token-mean", totals)).loss
                for k in (0, 2))
    assert parts.item() == pytest.approx(whole.item(), rel=1e-6)


def test_token_logprobs_are_target_aligned():
    V = 5
    logits = torch.randn(1, 4, V)
    ids = torch.tensor([[1, 3, 0, 4]])
    logp, entropy = token_logprobs(logits, ids)
    ref = torch.log_softmax(logits, -1)
    for t in range(3):
        assert logp[0, t].item() == pytest.approx(ref[0, t, ids[0, t + 1]].item(), abs=1e-6)
    assert logp[0, 3] == 0 and entropy[0, 3] == 0
    assert 0 < entropy[0, 0].item() <= math.log(V) + 1e-6


def test_temperature_scales_logits():
    logits = torch.randn(1, 3, 7)
    ids = torch.tensor([[0, 1, 2]])
    hot, _ = token_logprobs(logits, ids, temperature=0.5)
    ref, _ = token_logprobs(logits * 2, ids)
    assert torch.allclose(hot, ref, atol=1e-6)


def test_non_finite_values_under_the_mask_do_not_leak():
    logp = torch.tensor([[float("nan"), -1.0, float("-inf")]], requires_grad=True)
    logp_old = torch.tensor([[0.0, -1.2, float("nan")]])
    mask = torch.tensor([[0.0, 1.0, 0.0]])
    logp_ref = torch.tensor([[float("nan"), -1.1, float("nan")]])
    out = policy_loss(logp, logp_old, torch.tensor([1.0]), mask, clip(0.2, kl_coef=0.5), logp_ref=logp_ref,
                      entropy=torch.tensor([[float("nan"), 2.0, 0.0]]))
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(logp.grad).all()
    assert out.entropy_sum == 2.0 and math.isfinite(out.kl_sum) and out.kl_sum > 0


def test_turn_advantages_equal_grpo_for_single_turn_episodes():
    from opentinker.services.learner.loss import turn_advantages

    rewards = [[1.0, 0.0, 0.0, 1.0], [0.2, 0.9, 0.4, 0.4]]
    per_turn = turn_advantages([[[r] for r in g] for g in rewards], gamma=0.9)
    expected = group_advantages(torch.tensor(rewards))
    assert torch.allclose(torch.tensor([[a[0] for a in g] for g in per_turn]), expected, atol=1e-6)


def test_turn_advantages_compare_each_turn_with_the_same_turn_of_the_group():
    from opentinker.services.learner.loss import discounted_returns, turn_advantages

    assert discounted_returns([0.0, -0.1, 1.0], 0.5) == [0.0 + 0.5 * (-0.1 + 0.5 * 1.0), -0.1 + 0.5, 1.0]
    # three episodes: turn 0 of all three, turn 1 of the first two, turn 2 of the first only
    [group] = turn_advantages([[[0.0, -0.1, 1.0], [0.0, 1.0], [-1.0]]], gamma=1.0)
    at0 = group_advantages(torch.tensor([[0.9, 1.0, -1.0]])).view(-1).tolist()
    at1 = group_advantages(torch.tensor([[0.9, 1.0]])).view(-1).tolist()
    assert [g[0] for g in group] == pytest.approx(at0, rel=1e-5)
    assert [group[0][1], group[1][1]] == pytest.approx(at1, rel=1e-5)
    assert group[0][2] == pytest.approx(at0[0], rel=1e-5)  # no other episode reached turn 2: its episode's
    # equal returns at a turn index carry no signal there
    [g2] = turn_advantages([[[0.0, 1.0], [1.0, 1.0]]], gamma=1.0)
    assert g2[0][1] == g2[1][1] == 0.0 and g2[0][0] < 0 < g2[1][0]
    with pytest.raises(ValueError, match=">= 2 episodes"):
        turn_advantages([[[1.0]]], gamma=1.0)


def test_turn_advantages_of_the_reported_blow_ups_stay_within_the_episode_bound():
    """Issue 31: per-turn returns over the whole returns' statistics gave +7.9 to a seat
    that won all 4 games of a group (discount 0.9, gomoku_selfplay.toml) and 282 to
    shaped rewards at discount 1."""
    from opentinker.services.learner.loss import turn_advantages

    bound = 3 / math.sqrt(4)  # (G - 1) / sqrt(G), G = 4
    wins = [[0.0] * (n - 1) + [1.0] for n in (5, 6, 7, 9)]  # identical outcomes, different lengths
    shaped = [[0.1] * 10 + [1.0], [0.1] * 10 + [1.0 + 1e-4], [0.1, 1.0], [0.1] * 3 + [1.0]]
    for group, gamma in ((wins, 0.9), (shaped, 1.0), (wins, 1.0)):
        [adv] = turn_advantages([group], gamma)
        assert max(abs(a) for ep in adv for a in ep) <= bound + 1e-5, (gamma, adv)
    [adv] = turn_advantages([wins], 1.0)  # undiscounted identical wins: no signal at all
    assert all(a == 0.0 for ep in adv for a in ep)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.floats(-5, 5, allow_nan=False), min_size=0, max_size=6), min_size=2, max_size=8),
       st.floats(0.0, 1.0), st.sampled_from(["grpo", "rloo", "dr_grpo"]))
def test_no_turn_advantage_exceeds_what_the_episode_level_estimator_could_give(group, gamma, estimator):
    """The property: per turn index, the group's turns are baselined as an episode group
    is, so no turn's advantage exceeds the episode-level estimator's bound for a group
    of that size ("grpo": (G - 1) / sqrt(G); "rloo"/"dr_grpo": G/(G-1) resp. 1 times the
    spread of that turn's returns)."""
    from opentinker.services.learner.loss import discounted_returns, turn_advantages

    [adv] = turn_advantages([group], gamma, estimator)
    g = len(group)
    returns = [discounted_returns(ep, gamma) for ep in group]
    spread = max((max(r[t] for r in returns if len(r) > t) - min(r[t] for r in returns if len(r) > t)
                  for t in range(max(map(len, returns), default=0))), default=0.0)
    spread = max(spread, max((r[0] if r else 0.0) for r in returns) - min((r[0] if r else 0.0) for r in returns))
    bound = {"grpo": (g - 1) / math.sqrt(g), "rloo": spread * g / (g - 1), "dr_grpo": spread}[estimator]
    assert [len(a) for a in adv] == [len(ep) for ep in group]
    assert all(abs(a) <= bound * (1 + 1e-5) + 1e-5 for ep in adv for a in ep), (bound, adv)


def test_per_token_advantages_weight_each_token():
    logp_old = torch.log(torch.full((1, 4), 0.5))
    logp = logp_old.clone().requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    adv = torch.tensor([[2.0, 2.0, 9.0, -1.0]])
    out = policy_loss(logp, logp_old, adv, mask, clip(0.2))
    out.loss.backward()
    # d(-rho * A)/d logp at rho = 1 is -A, over 3 policy tokens; the masked one gets nothing
    assert logp.grad[0].tolist() == pytest.approx([-2 / 3, -2 / 3, 0.0, 1 / 3])
    with pytest.raises(ValueError, match="advantages must be"):
        policy_loss(logp, logp_old, torch.zeros(1, 3), mask, clip(0.2))


def test_a_group_of_equal_rewards_gets_exactly_zero_advantage():
    # equal up to rounding (0.1 + 0.2 != 0.3 in floating point): still no signal, not
    # a rounding error divided by 1e-6
    adv = group_advantages(torch.tensor([[0.1 + 0.2, 0.3, 0.3], [-1.0, -1.0, -1.0]], dtype=torch.float64))
    assert torch.equal(adv, torch.zeros(2, 3))


def test_turn_advantages_are_bounded_not_huge_when_the_whole_returns_are_equal():
    """Two gomoku games (illegal="retry"), both lost with one illegal move (-0.1) at
    different turns: equal whole returns (-1.1), different per-turn returns. Dividing
    those differences by the whole returns' std (the 1e-6 floor) once gave 1e5; compared
    turn by turn, turn 1's illegal move is the only difference, credited as such."""
    from opentinker.services.learner.loss import turn_advantages

    lost_a = [-0.1, 0.0, -1.0]   # illegal move on turn 0, lost on turn 2
    lost_b = [0.0, -0.1, -1.0]   # illegal move on turn 1, lost on turn 2
    [group] = turn_advantages([[lost_a, lost_b]], gamma=1.0)
    h = 1 / math.sqrt(2)  # (G - 1) / sqrt(G), G = 2
    assert group == [pytest.approx([0.0, h, 0.0], rel=1e-4, abs=1e-9),
                     pytest.approx([0.0, -h, 0.0], rel=1e-4, abs=1e-9)]
    # the same rewards in another order: whole returns equal only up to rounding
    [group] = turn_advantages([[[0.1, 0.2, -1.0], [0.2, 0.1, -1.0]]], gamma=1.0)
    assert group[0][0] == group[1][0] == 0.0 and group[0][2] == group[1][2] == 0.0
    assert max(abs(a) for ep in group for a in ep) <= h + 1e-5


def test_turn_advantages_of_a_normal_group_match_the_hand_computation():
    from opentinker.services.learner.loss import turn_advantages

    # gamma 0.5: returns A [0 + 0.5 * 1, 1] = [0.5, 1], B [0], C [1]; whole returns
    # [0.5, 0, 1]: mean 0.5, sample std sqrt((0 + 0.25 + 0.25) / 2) = 0.5
    # turn 1 of A has no comparable turn: it takes A's turn-0 advantage
    [group] = turn_advantages([[[0.0, 1.0], [0.0], [1.0]]], gamma=0.5)
    s = 0.5 + 1e-6
    assert group[0] == pytest.approx([0.0, 0.0], abs=1e-12)
    assert group[1] == pytest.approx([-0.5 / s], rel=1e-12)
    assert group[2] == pytest.approx([0.5 / s], rel=1e-12)
