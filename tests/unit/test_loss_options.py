"""The policy objective's options, each against a hand computation from its paper's
formula (plain Python arithmetic, never the function under test called another way):
advantage estimators, clip-higher, dual clip, loss aggregation, GSPO's sequence ratio,
the rollout (behaviour-policy) correction, KL estimators, the entropy bonus, DAPO's
overlong penalty, the learning-rate schedule, LossConfig.from_spec and the spec checks
of these options. Step-level advantages and micro-batching are in test_batching.py."""

import math

import pytest
import torch

from opentinker.schemas.job import JobSpec, SamplingParams, SpecError, spec_from_dict, validate_job_spec
from opentinker.services.learner.loss import (AggTotals, LossConfig, aggregation_weights, batch_whitening,
                                              group_advantages, kl_estimate, lr_factor, overlong_penalty,
                                              policy_loss, resolve_loss_agg, rollout_is_weights,
                                              turn_advantages)

EPS = 1e-6  # the advantage denominator's floor


def mean(xs):
    return sum(xs) / len(xs)


def sample_std(xs):
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def pop_std(xs):
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def logs(*ps):
    """[1, n] float32 logprobs of probabilities (or ratios) `ps`."""
    return torch.log(torch.tensor([list(ps)], dtype=torch.float32))


# --- advantage estimators ---------------------------------------------------------------

REWARDS = [1.0, 0.0, 0.5, 0.0]  # mean 0.375


def test_grpo_divides_the_centred_reward_by_the_sample_std():
    s = sample_std(REWARDS)  # sqrt((0.390625 + 0.140625 + 0.015625 + 0.140625) / 3)
    assert s == pytest.approx(math.sqrt(0.6875 / 3))
    adv = group_advantages(torch.tensor([REWARDS]), "grpo")[0].tolist()
    assert adv == pytest.approx([0.625 / (s + EPS), -0.375 / (s + EPS), 0.125 / (s + EPS), -0.375 / (s + EPS)],
                                rel=1e-6)


def test_dr_grpo_only_centres():
    adv = group_advantages(torch.tensor([REWARDS]), "dr_grpo")[0].tolist()
    assert adv == pytest.approx([0.625, -0.375, 0.125, -0.375], rel=1e-6)


def test_rloo_subtracts_the_mean_of_the_other_episodes():
    # r_i - mean_{j != i} r_j: 1 - 0.5/3, 0 - 1.5/3, 0.5 - 1/3, 0 - 1.5/3
    adv = group_advantages(torch.tensor([REWARDS]), "rloo")[0].tolist()
    assert adv == pytest.approx([1 - 0.5 / 3, -0.5, 0.5 - 1 / 3, -0.5], rel=1e-6)


def test_reinforce_pp_centres_per_group_and_whitens_over_the_batch_s_tokens():
    adv = group_advantages(torch.tensor([REWARDS, [2.0, 2.0, 0.0, 4.0]]), "reinforce_pp").tolist()
    assert adv[0] == pytest.approx([0.625, -0.375, 0.125, -0.375], rel=1e-6)
    assert adv[1] == pytest.approx([0.0, 0.0, -2.0, 2.0], rel=1e-6)
    flat = adv[0] + adv[1]
    # one token each: the plain mean 0 and population variance 8.6875 / 8
    mean, rstd = batch_whitening(flat, [1.0] * 8)
    assert mean == pytest.approx(0.0, abs=1e-12) and rstd == pytest.approx(1 / math.sqrt(8.6875 / 8), rel=1e-9)
    # a value carried by 3 tokens counts 3 times (OpenRLHF's masked mean over action tokens):
    # values [1, -1] on 3 and 1 tokens: mean (3 - 1) / 4 = 0.5, var (3 * 0.25 + 2.25) / 4 = 0.75
    mean, rstd = batch_whitening([1.0, -1.0], [3.0, 1.0])
    assert (mean, rstd) == pytest.approx((0.5, 1 / math.sqrt(0.75)), rel=1e-9)
    # no spread: rstd at OpenRLHF's floor 1 / sqrt(1e-8); no token at all: unchanged
    assert batch_whitening([0.0, 0.0], [2.0, 5.0]) == pytest.approx((0.0, 1e4), rel=1e-9)
    assert batch_whitening([0.3], [0.0]) == (0.0, 1.0)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_a_zero_variance_group_gets_exactly_zero_for_every_estimator(estimator):
    adv = group_advantages(torch.tensor([[0.1 + 0.2, 0.3, 0.3], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]],
                                        dtype=torch.float64), estimator)
    assert torch.equal(adv[:2], torch.zeros(2, 3))
    assert adv[2, 0] > 0  # the third group does carry signal
    # per-turn returns equal at every turn, up to rounding
    [group] = turn_advantages([[[0.1 + 0.2, 0.5, -1.0], [0.3, 0.5, -1.0]]], gamma=1.0, estimator=estimator)
    assert group == [[0.0] * 3, [0.0] * 3]


def test_an_unknown_estimator_is_refused():
    with pytest.raises(ValueError, match="advantage estimator"):
        group_advantages(torch.tensor([[1.0, 0.0]]), "ppo")


# a multi-turn group, gamma 0.5: A [0, 1] -> returns [0.5, 1]; B [1] -> [1]; C [0, 0, -1] -> [-0.25, -0.5, -1]
MULTI = [[0.0, 1.0], [1.0], [0.0, 0.0, -1.0]]
WHOLE = [0.5, 1.0, -0.25]  # R_{j,0}


def test_turn_advantages_rloo_takes_each_turns_baseline_from_the_other_episodes_same_turn():
    [group] = turn_advantages([MULTI], gamma=0.5, estimator="rloo")
    # turn 0: whole returns, baselines of the other two; turn 1: A and C only; turn 2: C
    # alone, which takes its turn 0's advantage
    assert group[0] == pytest.approx([0.5 - (1.0 - 0.25) / 2, 1.0 - (-0.5)])
    assert group[1] == pytest.approx([1.0 - (0.5 - 0.25) / 2])
    assert group[2] == pytest.approx([-0.25 - 0.75, -0.5 - 1.0, -0.25 - 0.75])


def test_turn_advantages_dr_grpo_and_reinforce_pp_centre_without_the_std():
    m0, m1 = mean(WHOLE), mean([1.0, -0.5])  # turn 0 of all three; turn 1 of A and C
    for est in ("dr_grpo", "reinforce_pp"):
        [group] = turn_advantages([MULTI], gamma=0.5, estimator=est)
        assert group[0] == pytest.approx([0.5 - m0, 1.0 - m1], rel=1e-9)
        assert group[1] == pytest.approx([1.0 - m0], rel=1e-9)
        assert group[2] == pytest.approx([-0.25 - m0, -0.5 - m1, -0.25 - m0], rel=1e-9)
    [grpo] = turn_advantages([MULTI], gamma=0.5, estimator="grpo")
    s0, s1 = sample_std(WHOLE), sample_std([1.0, -0.5])
    c0 = (-0.25 - m0) / (s0 + EPS)
    assert grpo[2] == pytest.approx([c0, (-0.5 - m1) / (s1 + EPS), c0], rel=1e-9)


# --- clip-higher, dual clip ---------------------------------------------------------------

def test_clip_higher_uses_separate_bounds_and_counts_what_it_clips():
    cfg = LossConfig(clip_low=0.2, clip_high=0.28)
    ratios = [1.25, 1.3, 0.75, 0.85]
    old = torch.zeros(1, 4)
    for a in (1.0, -1.0):
        logp = logs(*ratios).requires_grad_()
        out = policy_loss(logp, old, torch.tensor([a]), torch.ones(1, 4), cfg)
        hand = [-min(r * a, min(max(r, 0.8), 1.28) * a) for r in ratios]
        # A = 1: [-1.25, -1.28, -0.75, -0.85]; A = -1: [1.25, 1.3, 0.8, 0.85]
        assert hand == pytest.approx([-1.25, -1.28, -0.75, -0.85] if a > 0 else [1.25, 1.3, 0.8, 0.85])
        assert out.loss.item() == pytest.approx(sum(hand) / 4, rel=1e-6)
        assert out.clipped_sum == 2.0  # 1.3 > 1.28 and 0.75 < 0.8; 1.25 is inside [0.8, 1.28]
        out.loss.backward()
        # d/dlogp of -r A / 4 is -r A / 4 where the unclipped term is the min, else 0
        live = [r * a <= min(max(r, 0.8), 1.28) * a for r in ratios]
        expect = [-r * a / 4 if ok else 0.0 for r, ok in zip(ratios, live)]
        assert logp.grad[0].tolist() == pytest.approx(expect, rel=1e-5, abs=1e-7)
    # symmetric 0.2 clips the 1.25 token too
    sym = policy_loss(logs(*ratios), old, torch.tensor([1.0]), torch.ones(1, 4), LossConfig(0.2, 0.2))
    assert sym.clipped_sum == 3.0
    assert sym.loss.item() == pytest.approx((-1.2 - 1.2 - 0.75 - 0.85) / 4, rel=1e-6)


def test_dual_clip_bounds_negative_advantage_tokens_only():
    c = 3.0
    ratios = [5.0, 2.0, 5.0, 0.1]
    adv = torch.tensor([[-1.0, -1.0, 1.0, 2.0]])
    old, mask = torch.zeros(1, 4), torch.ones(1, 4)
    cfg = LossConfig(clip_low=0.2, clip_high=0.2, dual_clip=c)
    logp = logs(*ratios).requires_grad_()
    out = policy_loss(logp, old, adv, mask, cfg)
    # plain PPO: -min(rA, clip(r)A) = [5, 2, -1.2, -0.2]; dual clip min(pg, -cA) where A < 0:
    # [min(5, 3), min(2, 3)] = [3, 2]; the positive-advantage tokens keep -1.2 and -0.2
    # (misapplied, min(-0.2, -6) would give -6)
    assert out.loss.item() == pytest.approx((3.0 + 2.0 - 1.2 - 0.2) / 4, rel=1e-6)
    plain = policy_loss(logs(*ratios), old, adv, mask, cfg._replace(dual_clip=0.0))
    assert plain.loss.item() == pytest.approx((5.0 + 2.0 - 1.2 - 0.2) / 4, rel=1e-6)
    out.loss.backward()
    # token 0 bound by the constant -cA: no gradient; token 1: d(-rA)/dlogp / 4 = r / 4;
    # token 2 clipped at 1.2: 0; token 3 live: -r A / 4 = -0.05
    assert logp.grad[0].tolist() == pytest.approx([0.0, 0.5, 0.0, -0.05], rel=1e-5, abs=1e-7)


# --- loss aggregation ---------------------------------------------------------------------

# two sequences of 2 and 4 policy tokens; ratio 1 so that each token's loss is -A_t
AGG_MASK = torch.tensor([[0.0, 1.0, 1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]])
AGG_ADV = torch.tensor([[0.0, 1.0, 2.0, 0.0, 0.0, 0.0], [3.0, 4.0, 5.0, 6.0, 0.0, 0.0]])


@pytest.mark.parametrize("mode,expected", [
    ("token-mean", -(1 + 2 + 3 + 4 + 5 + 6) / 6),             # sum / N
    ("seq-mean-token-mean", -((1 + 2) / 2 + (3 + 4 + 5 + 6) / 4) / 2),  # mean of per-seq means
    ("seq-mean-token-sum", -(1 + 2 + 3 + 4 + 5 + 6) / 2),     # sum / S
    ("seq-mean-token-sum-norm", -(1 + 2 + 3 + 4 + 5 + 6) / (2 * 8)),  # sum / (S L), L = 8
])
def test_loss_aggregation_modes(mode, expected):
    totals = AggTotals(tokens=6.0, seqs=2.0, max_len=8.0)
    w = aggregation_weights(AGG_MASK, mode, totals)
    hand_w = {"token-mean": [1 / 6, 1 / 6], "seq-mean-token-mean": [1 / 4, 1 / 8],
              "seq-mean-token-sum": [1 / 2, 1 / 2], "seq-mean-token-sum-norm": [1 / 16, 1 / 16]}[mode]
    assert w.tolist() == pytest.approx(hand_w, rel=1e-6)
    logp = torch.full((2, 6), -0.7)
    out = policy_loss(logp, logp.clone(), AGG_ADV, AGG_MASK, weights=w)
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)


def test_default_weights_are_the_token_mean_and_empty_sequences_weigh_nothing():
    logp = torch.full((2, 6), -0.7)
    out = policy_loss(logp, logp.clone(), AGG_ADV, AGG_MASK)
    assert out.loss.item() == pytest.approx(-21 / 6, rel=1e-6)
    mask = torch.cat([AGG_MASK, torch.zeros(1, 6)])
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        assert aggregation_weights(mask, mode, AggTotals(6.0, 2.0, 8.0))[2].item() == 0.0
    with pytest.raises(ValueError, match="loss_agg"):
        aggregation_weights(AGG_MASK, "sum", AggTotals(6.0, 2.0, 8.0))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                  "seq-mean-token-sum-norm"])
def test_micro_batches_with_the_update_totals_give_the_whole_loss_and_gradient(mode):
    g = torch.Generator().manual_seed(3)
    B, T = 5, 7
    base = -torch.rand(B, T, generator=g)
    behav = base + 0.3 * torch.randn(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.4).float()
    mask[4] = 0.0  # a sequence with no policy token
    adv = torch.randn(B, generator=g)
    ref = base - 0.2
    cfg = LossConfig(clip_low=0.2, clip_high=0.28, kl_coef=0.05)
    totals = AggTotals(tokens=float(mask.sum()), seqs=float((mask.sum(1) > 0).sum()), max_len=float(T))

    whole_logp = base.clone().requires_grad_()
    whole = policy_loss(whole_logp, behav, adv, mask, cfg, logp_ref=ref,
                        weights=aggregation_weights(mask, mode, totals))
    whole.loss.backward()
    part_logp = base.clone().requires_grad_()
    parts = 0.0
    for sl in (slice(0, 2), slice(2, 3), slice(3, 5)):
        parts = parts + policy_loss(part_logp[sl], behav[sl], adv[sl], mask[sl], cfg, logp_ref=ref[sl],
                                    weights=aggregation_weights(mask[sl], mode, totals)).loss
    parts.backward()
    assert parts.item() == pytest.approx(whole.loss.item(), rel=1e-6, abs=1e-7)
    assert torch.allclose(part_logp.grad, whole_logp.grad, rtol=1e-6, atol=1e-8)
    assert whole_logp.grad.abs().sum() > 0


# --- GSPO's sequence-level ratio ------------------------------------------------------------

def test_sequence_ratio_is_the_geometric_mean_and_clips_the_whole_sequence():
    cfg = LossConfig(ratio_level="sequence")
    # sequence 0: log-ratios [0.1, -0.3] (and a masked position) -> s = exp(-0.1), inside the clip;
    # sequence 1: [0.5, 0.3] -> s = exp(0.4) = 1.49 > 1.2, clipped (A > 0)
    old = torch.tensor([[-1.0, -2.0, -1.0], [-1.5, -0.5, -1.0]])
    delta = torch.tensor([[0.1, -0.3, 7.0], [0.5, 0.3, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    logp = (old + delta).requires_grad_()
    out = policy_loss(logp, old, torch.tensor([1.0, 1.0]), mask, cfg)
    s0, s1 = math.exp(-0.1), math.exp(0.4)
    assert s1 > 1.2
    # token-mean over 4 tokens: each of sequence 0's tokens -s0, each of sequence 1's -1.2
    assert out.loss.item() == pytest.approx((2 * -s0 + 2 * -1.2) / 4, rel=1e-6)
    assert out.clipped_sum == 2.0  # both tokens of sequence 1, none of sequence 0
    out.loss.backward()
    # d(-s0 * 2 / 4)/dlogp_t = -(2 / 4) * s0 * (1 / 2) = -s0 / 4 for each token of sequence 0
    assert logp.grad.flatten().tolist() == pytest.approx([-s0 / 4, -s0 / 4, 0.0, 0.0, 0.0, 0.0], rel=1e-5, abs=1e-8)
    # the token-level ratio would differ per token: exp(0.1) and exp(-0.3)
    tok = policy_loss(old + delta, old, torch.tensor([1.0, 1.0]), mask)
    assert tok.loss.item() == pytest.approx((-math.exp(0.1) - math.exp(-0.3) - 1.2 - 1.2) / 4, rel=1e-6)


def test_an_unknown_ratio_level_is_refused():
    with pytest.raises(ValueError, match="importance_sampling_level"):
        policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2),
                    LossConfig(ratio_level="episode"))


# --- the rollout (behaviour-policy) correction ---------------------------------------------

# proximal / behaviour ratios per token, threshold C = 2 (window [0.5, 2] for "mask")
IS_RATIOS = [3.0, 0.25, 1.5, 0.4]


def test_token_level_is_weights_truncate_and_mask():
    behav = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.5, 0.3]]))
    prox = behav + torch.log(torch.tensor([IS_RATIOS + [9.0]]))
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    w, capped = rollout_is_weights(prox, behav, mask, "token", "truncate", 2.0)
    assert w[0].tolist() == pytest.approx([2.0, 0.25, 1.5, 0.4, 0.0], rel=1e-6)
    assert capped[0].tolist() == [True, False, False, False, False]
    w, capped = rollout_is_weights(prox, behav, mask, "token", "mask", 2.0)
    assert w[0].tolist() == pytest.approx([0.0, 0.0, 1.5, 0.0, 0.0], rel=1e-6)
    assert capped[0].tolist() == [True, True, False, True, False]


def test_sequence_level_is_weights_are_the_product_over_the_sequence():
    behav = torch.full((3, 3), -1.0)
    ratios = torch.tensor([[1.5, 1.2, 50.0], [2.0, 1.5, 1.0], [0.5, 0.6, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    prox = behav + torch.log(ratios)
    # products over policy tokens: 1.8 (masked 50 left out), 3.0, 0.3
    w, capped = rollout_is_weights(prox, behav, mask, "sequence", "truncate", 2.0)
    assert w.flatten().tolist() == pytest.approx([1.8, 1.8, 0, 2.0, 2.0, 0, 0.3, 0.3, 0], rel=1e-6)
    assert capped.tolist() == [[False, False, False], [True, True, False], [False, False, False]]
    w, capped = rollout_is_weights(prox, behav, mask, "sequence", "mask", 2.0)
    assert w.flatten().tolist() == pytest.approx([1.8, 1.8, 0, 0, 0, 0, 0, 0, 0], rel=1e-6)
    assert capped.tolist() == [[False, False, False], [True, True, False], [True, True, False]]
    with pytest.raises(ValueError, match="rollout_is"):
        rollout_is_weights(prox, behav, mask, "episode", "mask", 2.0)
    with pytest.raises(ValueError, match="rollout_is_mode"):
        rollout_is_weights(prox, behav, mask, "token", "clip", 2.0)


def test_policy_loss_weights_each_token_by_the_is_weight_against_the_proximal_policy():
    behav = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.5]]))
    prox = behav + torch.log(torch.tensor([IS_RATIOS]))
    # current / proximal ratios near 1: inside the clip; against the behaviour policy
    # (ratios 3.3, 0.25...) most tokens would be clipped
    cur_over_prox = [1.1, 0.9, 1.05, 1.0]
    logp = (prox + torch.log(torch.tensor([cur_over_prox]))).detach().requires_grad_()
    A = 2.0
    mask = torch.ones(1, 4)
    cfg = LossConfig(rollout_is="token", rollout_is_mode="truncate", rollout_is_threshold=2.0)
    out = policy_loss(logp, behav, torch.tensor([A]), mask, cfg, logp_prox=prox)
    w = [min(x, 2.0) for x in IS_RATIOS]  # [2, 0.25, 1.5, 0.4]
    assert out.loss.item() == pytest.approx(sum(-r * A * wt for r, wt in zip(cur_over_prox, w)) / 4, rel=1e-5)
    assert out.clipped_sum == 0.0
    assert out.is_weight_sum == pytest.approx(sum(w), rel=1e-6)
    assert out.is_capped_sum == 1.0
    # sum over tokens of (w - 1) - log w with the untruncated w = prox / behav
    assert out.mismatch_kl_sum == pytest.approx(sum(x - 1 - math.log(x) for x in IS_RATIOS), rel=1e-5)
    out.loss.backward()
    # w is a constant: d(-r A w / 4)/dlogp = -r A w / 4
    assert logp.grad[0].tolist() == pytest.approx([-r * A * wt / 4 for r, wt in zip(cur_over_prox, w)], rel=1e-5)
    # the weights carry no gradient even when the logprobs they come from do
    wt, _ = rollout_is_weights(prox.clone().requires_grad_(), behav, mask, "token", "truncate", 2.0)
    assert not wt.requires_grad
    # without the correction the proximal policy is still PPO's old one, unweighted
    plain = policy_loss(logp.detach(), behav, torch.tensor([A]), mask, logp_prox=prox)
    assert plain.loss.item() == pytest.approx(sum(-r * A for r in cur_over_prox) / 4, rel=1e-5)
    assert plain.mismatch_kl_sum == 0.0 and plain.is_weight_sum == 0.0


def test_a_stale_batch_under_the_sampler_relative_clip_stops_pushing_tokens_already_moved():
    """The main job's asynchronous objective (rollout_is = "none", one update a step): the
    ratio is taken against the sampler, so a token the policy already moved past the clip
    since the batch was drawn gets no further push, where the decoupled form (the ratio
    against the learner's own policy, 1 at the first update, times TIS weights) pushes it
    on with weight min(w, C)."""
    behav = torch.log(torch.tensor([[0.2, 0.2, 0.2, 0.2]]))
    moved = [1.5, 1.1, 0.9, 0.6]  # the policy's drift since the sampler drew the batch
    logp = (behav + torch.log(torch.tensor([moved]))).detach()
    mask = torch.ones(1, 4)
    for A, pushed in ((1.0, [False, True, True, True]), (-1.0, [True, True, True, False])):
        cur = logp.clone().requires_grad_()
        out = policy_loss(cur, behav, torch.tensor([A]), mask, LossConfig(rollout_is="none"))
        out.loss.backward()
        # unclipped tokens: d(-r A / 4)/dlogp = -r A / 4; a token beyond the clip in the
        # advantage's direction: 0
        assert cur.grad[0].tolist() == pytest.approx(
            [-r * A / 4 if p else 0.0 for r, p in zip(moved, pushed)], abs=1e-6)
        assert out.clipped_sum == 2.0
        dec = logp.clone().requires_grad_()
        policy_loss(dec, behav, torch.tensor([A]), mask, LossConfig(rollout_is="token"),
                    logp_prox=logp).loss.backward()
        assert dec.grad[0].tolist() == pytest.approx([-min(r, 2.0) * A / 4 for r in moved], rel=1e-5)


def test_rollout_is_needs_the_proximal_logprobs():
    with pytest.raises(ValueError, match="logp_prox"):
        policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2),
                    LossConfig(rollout_is="token"))


# --- KL estimators, entropy bonus ------------------------------------------------------------

def test_kl_estimators_by_hand():
    logp = torch.log(torch.tensor([0.5, 0.5, 0.3]))
    ref = torch.log(torch.tensor([0.25, 0.5, 0.3 * math.exp(0.5)]))
    # d = ref - logp = [-log 2, 0, 0.5]
    d = [-math.log(2), 0.0, 0.5]
    assert kl_estimate(logp, ref, "k1").tolist() == pytest.approx([-x for x in d], abs=1e-6)
    assert kl_estimate(logp, ref, "k2").tolist() == pytest.approx([x * x / 2 for x in d], abs=1e-6)
    assert kl_estimate(logp, ref, "k3").tolist() == pytest.approx([math.exp(x) - x - 1 for x in d], abs=1e-6)
    assert kl_estimate(logp, ref, "k3")[0].item() == pytest.approx(0.5 + math.log(2) - 1, abs=1e-6)
    assert kl_estimate(logp, ref, "k1")[2].item() < 0  # k1 can be negative, k3 cannot
    g = torch.Generator().manual_seed(0)
    a, b = -3 * torch.rand(1000, generator=g), -3 * torch.rand(1000, generator=g)
    assert (kl_estimate(a, b, "k3") >= 0).all()
    with pytest.raises(ValueError, match="KL estimator"):
        kl_estimate(logp, ref, "k4")


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_coef_adds_the_chosen_estimator_to_the_loss(est):
    logp0 = torch.log(torch.tensor([[0.5, 0.5, 0.3]]))
    ref = torch.log(torch.tensor([[0.25, 0.5, 0.3 * math.exp(0.5)]]))
    d = [-math.log(2), 0.0, 0.5]
    per = {"k1": [-x for x in d], "k2": [x * x / 2 for x in d], "k3": [math.exp(x) - x - 1 for x in d]}[est]
    dper = {"k1": [1.0] * 3, "k2": [-x for x in d], "k3": [1 - math.exp(x) for x in d]}[est]  # d/dlogp
    logp = logp0.clone().requires_grad_()
    # A = 0 and ratio 1: the policy term is 0, the loss is kl_coef * mean KL
    out = policy_loss(logp, logp0, torch.zeros(1), torch.ones(1, 3), LossConfig(kl_coef=0.1, kl_estimator=est),
                      logp_ref=ref)
    assert out.loss.item() == pytest.approx(0.1 * sum(per) / 3, rel=1e-5, abs=1e-7)
    assert out.kl_sum == pytest.approx(sum(per), rel=1e-5, abs=1e-7)
    out.loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([0.1 * x / 3 for x in dper], rel=1e-5, abs=1e-7)
    # kl_coef 0 still reports the KL, but adds nothing
    off = policy_loss(logp0, logp0, torch.zeros(1), torch.ones(1, 3), LossConfig(kl_estimator=est), logp_ref=ref)
    assert off.loss.item() == 0.0 and off.kl_sum == pytest.approx(sum(per), rel=1e-5, abs=1e-7)


def test_kl_coef_without_the_reference_is_refused():
    with pytest.raises(ValueError, match="logp_ref"):
        policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2), LossConfig(kl_coef=0.1))


def test_entropy_bonus_lowers_the_loss_by_coef_times_the_mean_entropy_and_has_a_gradient():
    logp = torch.log(torch.tensor([[0.5, 0.4, 0.3]]))
    old = logp + torch.log(torch.tensor([[1.0, 1.1, 0.9]]))  # ratios 1, 1/1.1, 1/0.9
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    entropy = torch.tensor([[1.5, float("nan"), 0.5]], requires_grad=True)  # NaN under the mask
    A = 1.0
    base = (-1.0 * A - (1 / 0.9) * A) / 2
    out = policy_loss(logp, old, torch.tensor([A]), mask, LossConfig(entropy_coef=0.01), entropy=entropy)
    assert out.loss.item() == pytest.approx(base - 0.01 * (1.5 + 0.5) / 2, rel=1e-6)
    assert out.entropy_sum == 2.0
    out.loss.backward()
    assert entropy.grad[0].tolist() == pytest.approx([-0.01 / 2, 0.0, -0.01 / 2], rel=1e-6)
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(logp, old, torch.tensor([A]), mask, LossConfig(entropy_coef=0.01))


# --- DAPO's overlong penalty, learning-rate schedule -----------------------------------------

@pytest.mark.parametrize("gen,expected", [
    (0, 0.0), (76, 0.0), (80, 0.0),    # |y| <= L - Lc = 80
    (81, -1 / 20), (90, -10 / 20), (99, -19 / 20), (100, -1.0),  # (80 - |y|) / 20 inside the buffer
    (101, -1.0), (5000, -1.0),          # beyond L
])
def test_overlong_penalty_at_the_boundaries(gen, expected):
    assert overlong_penalty(gen, max_len=100, buffer=20) == pytest.approx(expected)
    assert overlong_penalty(gen, max_len=100, buffer=20, factor=0.5) == pytest.approx(0.5 * expected)
    assert overlong_penalty(gen, max_len=100, buffer=0) == 0.0


def test_lr_factor_schedules():
    # warmup 10 steps, total 110: 100 post-warmup steps
    for sched in ("constant", "linear", "cosine"):
        assert lr_factor(0, 110, 10, sched) == 0.0
        assert lr_factor(5, 110, 10, sched) == pytest.approx(0.5)
        assert lr_factor(2.5, 110, 10, sched) == pytest.approx(0.25)
        assert lr_factor(10, 110, 10, sched) == pytest.approx(1.0)
    assert lr_factor(60, 110, 10, "constant") == 1.0 and lr_factor(500, 110, 10, "constant") == 1.0
    assert lr_factor(60, 110, 10, "linear") == pytest.approx(0.5)
    assert lr_factor(85, 110, 10, "linear") == pytest.approx(0.25)
    assert lr_factor(110, 110, 10, "linear") == pytest.approx(0.0)
    assert lr_factor(200, 110, 10, "linear") == pytest.approx(0.0)
    assert lr_factor(35, 110, 10, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))  # 0.8536
    assert lr_factor(60, 110, 10, "cosine") == pytest.approx(0.5)
    assert lr_factor(85, 110, 10, "cosine") == pytest.approx(0.5 * (1 + math.cos(3 * math.pi / 4)))
    assert lr_factor(110, 110, 10, "cosine") == pytest.approx(0.0, abs=1e-12)
    assert lr_factor(0, 100, 0, "linear") == 1.0 and lr_factor(25, 100, 0, "linear") == pytest.approx(0.75)
    with pytest.raises(ValueError, match="lr_schedule"):
        lr_factor(1, 10, 0, "step")


# --- the JobSpec options ------------------------------------------------------------------

def test_loss_config_from_spec():
    cfg = LossConfig.from_spec(JobSpec(clip_range=0.25, kl_coef=0.04, kl_estimator="k2", dual_clip=3.0,
                                       importance_sampling_level="sequence", rollout_is="sequence",
                                       rollout_is_mode="mask", rollout_is_threshold=5.0, entropy_coef=0.001))
    assert cfg == LossConfig(clip_low=0.25, clip_high=0.25, dual_clip=3.0, ratio_level="sequence",
                             rollout_is="sequence", rollout_is_mode="mask", rollout_is_threshold=5.0,
                             kl_coef=0.04, kl_estimator="k2", entropy_coef=0.001)
    high = LossConfig.from_spec(JobSpec(clip_range=0.2, clip_range_high=0.28))
    assert (high.clip_low, high.clip_high) == (0.2, 0.28)
    # the KL goes into the reward instead: none in the loss
    assert LossConfig.from_spec(JobSpec(kl_coef=0.04, kl_in_reward=True)).kl_coef == 0.0
    # the defaults: symmetric clip, token-level correction of the behaviour policy
    d = LossConfig.from_spec(JobSpec())
    assert (d.clip_low, d.clip_high, d.rollout_is, d.kl_coef, d.dual_clip) == (0.2, 0.2, "token", 0.0, 0.0)


def test_dr_grpo_sums_each_response_over_a_constant_unless_the_spec_names_an_aggregation():
    """Dr. GRPO (arXiv 2503.20783 §3.2) drops GRPO's 1/|o_i| as well as the std: with
    loss_agg left at "auto" its loss is each response's token sum over S * L (verl's
    seq-mean-token-sum-norm), so a long response's tokens weigh as much as a short one's
    do; every other estimator keeps token-mean, and an explicit choice is kept."""
    assert JobSpec().loss_agg == "auto" and spec_from_dict({"loss_agg": "auto"}).loss_agg == "auto"
    dr = LossConfig.from_spec(JobSpec(advantage_estimator="dr_grpo"))
    assert dr.loss_agg == "seq-mean-token-sum-norm"
    # two responses of 2 and 4 policy tokens, L = 8: each token weighs 1 / (2 * 8)
    assert aggregation_weights(AGG_MASK, dr.loss_agg, AggTotals(6.0, 2.0, 8.0)).tolist() == [1 / 16, 1 / 16]
    for est in ("grpo", "rloo", "reinforce_pp"):
        assert LossConfig.from_spec(JobSpec(advantage_estimator=est)).loss_agg == "token-mean"
    explicit = JobSpec(advantage_estimator="dr_grpo", loss_agg="token-mean")
    assert LossConfig.from_spec(explicit).loss_agg == "token-mean"
    assert resolve_loss_agg("seq-mean-token-mean", "dr_grpo") == "seq-mean-token-mean"
    with pytest.raises(ValueError, match="loss_agg"):
        resolve_loss_agg("sum", "grpo")


@pytest.mark.parametrize("kw,field", [
    (dict(dual_clip=0.5), "dual_clip"),
    (dict(dual_clip=1.0), "dual_clip"),
    (dict(prompts_per_step=2, group_size=4, mini_batches=9), "mini_batches"),
    (dict(sampling=SamplingParams(max_new_tokens=32, max_turns=1), overlong_buffer=32), "overlong_buffer"),
    (dict(sampling=SamplingParams(max_new_tokens=64, max_turns=4, max_total_tokens=100),
          overlong_buffer=99), "overlong_buffer"),  # the budget is max_total_tokens - 1 = 99
])
def test_spec_refuses_inconsistent_objective_options(kw, field):
    with pytest.raises(SpecError) as e:
        validate_job_spec(JobSpec(**kw))
    assert e.value.field == field


@pytest.mark.parametrize("kw", [
    dict(dual_clip=0.0), dict(dual_clip=1.5),
    dict(prompts_per_step=2, group_size=4, mini_batches=8),
    dict(sampling=SamplingParams(max_new_tokens=32, max_turns=1), overlong_buffer=31),
    dict(sampling=SamplingParams(max_new_tokens=64, max_turns=4, max_total_tokens=100), overlong_buffer=98),
])
def test_spec_accepts_the_options_at_their_limits(kw):
    validate_job_spec(JobSpec(**kw))


# --- logprobs at the policy positions only (the learner's training path) ----------------------

def test_selected_logprobs_match_the_full_token_logprobs_in_chunks():
    from opentinker.services.learner.loss import selected_logprobs, token_logprobs

    g = torch.Generator().manual_seed(5)
    B, T, H, V = 2, 6, 4, 9
    hidden = torch.randn(B, T, H, generator=g)
    head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g))
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [1, 1, 0, 0, 1, 0]], dtype=torch.bool)
    full_logp, full_ent = token_logprobs(head(hidden), ids, temperature=0.7)
    targets = ids[:, 1:][mask[:, :-1]]
    # 6 positions in chunks of 4 (a full chunk and a partial one), via the head or from logits
    logp, ent = selected_logprobs(hidden[mask], targets, temperature=0.7, head=head, chunk=4)
    assert torch.allclose(logp, full_logp[mask], atol=1e-5) and torch.allclose(ent, full_ent[mask], atol=1e-5)
    logp2, _ = selected_logprobs(head(hidden)[mask], targets, temperature=0.7, chunk=5)
    assert torch.allclose(logp2, full_logp[mask], atol=1e-5)
    # entropy has a gradient only when asked for (an entropy bonus)
    rows = head(hidden)[mask].detach().requires_grad_()
    assert not selected_logprobs(rows, targets)[1].requires_grad
    assert selected_logprobs(rows, targets, entropy_grad=True)[1].requires_grad
    empty = selected_logprobs(rows[:0], targets[:0])
    assert empty[0].shape == (0,) and empty[1].shape == (0,)


# --- KL estimators: which gradient each one gives, and no overflow ---------------------------

def _expected_grad(estimator: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """E_{x ~ pi}[grad_theta k(x)] exactly, on a 5-token categorical pi = softmax(theta)
    (the loss's sampled tokens held fixed), and the gradients of KL(pi||ref), KL(ref||pi)."""
    from opentinker.services.learner.loss import kl_estimate

    g = torch.Generator().manual_seed(0)
    # mild enough that no token reaches the clamps (a clamped token adds no gradient)
    theta = (0.5 * torch.randn(5, generator=g, dtype=torch.float64)).requires_grad_()
    ref = torch.log_softmax(0.5 * torch.randn(5, generator=g, dtype=torch.float64), -1)
    logp = torch.log_softmax(theta, -1)
    p = logp.exp().detach()
    (expected,) = torch.autograd.grad((p * kl_estimate(logp, ref, estimator)).sum(), theta)
    logp = torch.log_softmax(theta, -1)
    (fwd,) = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), theta)          # KL(pi || ref)
    logp = torch.log_softmax(theta, -1)
    (rev,) = torch.autograd.grad((ref.exp() * (ref - logp)).sum(), theta)           # KL(ref || pi)
    return expected, fwd, rev


def test_k3s_gradient_is_that_of_kl_ref_pi_and_k2s_that_of_kl_pi_ref():
    """Issue 31: k3 was documented as KL(pi || ref) throughout; as a loss its gradient is
    KL(ref || pi)'s (the value is still KL(pi || ref)'s estimate)."""
    e3, fwd, rev = _expected_grad("k3")
    assert torch.allclose(e3, rev, atol=1e-10) and not torch.allclose(e3, fwd, atol=1e-3)
    e2, fwd, _ = _expected_grad("k2")
    assert torch.allclose(e2, fwd, atol=1e-10)


def test_k3_does_not_overflow():
    from opentinker.services.learner.loss import KL_K3_CLAMP, kl_estimate

    logp = torch.tensor([-150.0, -1.0, 0.0], requires_grad=True)
    ref = torch.tensor([-0.01, -1.0, -200.0])
    k = kl_estimate(logp, ref, "k3")
    assert torch.isfinite(k).all() and k.max() <= KL_K3_CLAMP and k[1] == 0.0
    k.sum().backward()
    assert torch.isfinite(logp.grad).all()


def test_a_step_that_forwarded_no_token_reports_no_token_statistics():
    """Issue 31: a step whose groups were all skipped reported entropy 0, IS weight 0 and
    KL 0, and the plots dived to 0 on it."""
    from opentinker.services.learner.step import CRITIC_STATS, POLICY_STATS, TOKEN_STATS, token_stats

    zeros = {k: 0.0 for k in (*POLICY_STATS, "tokens")}
    assert token_stats(zeros) == {}
    some = {**zeros, "tokens": 12.0, "entropy": 1.5, "mismatch_kl": 0.003}
    assert token_stats(some) == {k: some[k] for k in POLICY_STATS}
    # a critic's warmup step: the policy forwarded nothing, the critic trained
    warmup = {**zeros, **{k: 0.5 for k in CRITIC_STATS}}
    assert token_stats(warmup) == {k: 0.5 for k in CRITIC_STATS}
    assert token_stats({**warmup, "tokens": 3.0}) == {k: warmup[k] for k in TOKEN_STATS}
