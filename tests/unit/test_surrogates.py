"""The per-token surrogates (services/learner/surrogates.py), shared by GRPO jobs
(loss.policy_loss, `surrogate` in the job spec) and the Tinker API's losses: each
checked by hand through policy_loss, and the three lists of names kept equal."""

import math
import typing

import msgspec
import pytest
import torch

from opentinker.schemas import JobSpec
from opentinker.schemas.job import SpecError, Surrogate, validate_job_spec
from opentinker.services.learner import surrogates
from opentinker.services.learner.loss import LossConfig, policy_loss
from opentinker.services.learner.tinker_losses import LOSS_FNS

RATIOS = [1.5, 0.6, 1.1]  # against PPO's [0.8, 1.2]: above, below, inside


def case(a: float):
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    logp = (old + torch.log(torch.tensor([RATIOS]))).requires_grad_()
    return logp, old, torch.tensor([a]), torch.ones(1, 3)


def test_the_registry_the_job_spec_and_the_tinker_losses_name_the_same_surrogates():
    assert set(typing.get_args(Surrogate)) == set(surrogates.SURROGATES) == set(LOSS_FNS)
    assert surrogates.CLIPPED == {"ppo", "gspo", "cispo", "stable_reinforce"}
    with pytest.raises(ValueError, match="surrogate must be one of"):
        surrogates.get("trpo")
    with pytest.raises(ValueError, match="registered twice"):
        surrogates.surrogate("ppo")(surrogates.ppo)


@pytest.mark.parametrize("a", [1.0, -2.0])
def test_cispo_keeps_a_gradient_on_clipped_tokens(a):
    logp, old, adv, mask = case(a)
    out = policy_loss(logp, old, adv, mask, LossConfig(surrogate="cispo"))
    coef = [min(max(r, 0.8), 1.2) for r in RATIOS]  # sg(clip(r))
    lp = logp.detach()[0].tolist()
    assert out.loss.item() == pytest.approx(sum(-c * a * x for c, x in zip(coef, lp)) / 3, rel=1e-6)
    out.loss.backward()
    # d/dlogp = -clip(r) A / 3 on every token, clipped or not (PPO's would be 0 on a clipped one)
    assert logp.grad[0].tolist() == pytest.approx([-c * a / 3 for c in coef], rel=1e-6)
    assert out.clipped_sum == 2.0  # 1.5 and 0.6 lie outside [0.8, 1.2]


def test_gspo_clips_the_sequence_ratio_and_gives_each_token_its_own_gradient():
    logp, old, _, mask = case(1.0)
    s = math.prod(RATIOS) ** (1 / 3)  # 0.9967: the geometric mean of the token ratios
    per_token_adv = torch.tensor([[1.0, -2.0, 0.5]])
    out = policy_loss(logp, old, per_token_adv, mask, LossConfig(surrogate="gspo"))
    assert out.loss.item() == pytest.approx(-s * (1.0 - 2.0 + 0.5) / 3, rel=1e-6)
    out.loss.backward()
    # GSPO-token: d/dlogp_t = -s A_t / 3, each token by its own advantage
    assert logp.grad[0].tolist() == pytest.approx([-s * 1.0 / 3, s * 2.0 / 3, -s * 0.5 / 3], rel=1e-5)
    assert out.clipped_sum == 0.0  # s lies inside [0.8, 1.2], though 1.5 and 0.6 do not
    # with one advantage per sequence it is GSPO's own gradient (PPO on the sequence ratio)
    for a in (1.0, -1.0):
        grads = []
        for cfg in (LossConfig(surrogate="gspo"), LossConfig(ratio_level="sequence")):
            logp, old, adv, mask = case(a)
            policy_loss(logp, old, adv, mask, cfg).loss.backward()
            grads.append(logp.grad[0].tolist())
        assert grads[0] == pytest.approx(grads[1], rel=1e-5)
    # the paper's bounds (3e-4, 4e-4): s = 0.9967 lies below 1 - 3e-4, so with A < 0 the
    # whole sequence is clipped (no gradient), with A > 0 it keeps s A
    for a, clipped in ((-1.0, True), (1.0, False)):
        logp, old, adv, mask = case(a)
        out = policy_loss(logp, old, adv, mask, LossConfig(surrogate="gspo", clip_low=3e-4, clip_high=4e-4))
        out.loss.backward()
        assert out.clipped_sum == 3.0
        assert logp.grad[0].tolist() == pytest.approx([0.0] * 3 if clipped else [-s / 3] * 3, rel=1e-5)


def test_dro_pays_a_quadratic_penalty_and_clips_nothing():
    logp, old, adv, mask = case(1.0)
    beta = 0.05
    out = policy_loss(logp, old, adv, mask, LossConfig(surrogate="dro", dro_beta=beta))
    lp, lr = logp.detach()[0].tolist(), [math.log(r) for r in RATIOS]
    assert out.loss.item() == pytest.approx(sum(-x + 0.5 * beta * d * d for x, d in zip(lp, lr)) / 3, rel=1e-6)
    out.loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([(-1 + beta * d) / 3 for d in lr], rel=1e-5)
    assert out.clipped_sum == 0.0


def test_importance_sampling_is_the_unclipped_ratio_times_the_advantage():
    logp, old, adv, mask = case(-2.0)
    out = policy_loss(logp, old, adv, mask, LossConfig(surrogate="importance_sampling"))
    assert out.loss.item() == pytest.approx(sum(2.0 * r for r in RATIOS) / 3, rel=1e-6)
    out.loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([2.0 * r / 3 for r in RATIOS], rel=1e-5)


def test_ppo_is_the_default_and_matches_the_tinker_ppo_on_one_sequence():
    from opentinker.services.learner.tinker_losses import datum_loss

    logp, old, adv, mask = case(1.0)
    grpo = policy_loss(logp, old, adv, mask)  # token-mean
    tinker, metrics = datum_loss("ppo", logp[0], {"target_tokens": torch.zeros(3), "logprobs": old[0],
                                                  "advantages": torch.ones(3)})
    assert grpo.loss.item() == pytest.approx(tinker.item() / 3, rel=1e-6)
    assert metrics["clipped_tokens"] == 1.0  # only 1.5's clipped term wins the min for A > 0


@pytest.mark.parametrize("kw, field", [
    (dict(surrogate="dro"), "dro_beta"),
    (dict(surrogate="ppo", dro_beta=0.1), "dro_beta"),
    (dict(surrogate="cispo", dual_clip=3.0), "dual_clip"),
])
def test_a_spec_with_surrogate_options_that_do_not_fit_is_refused(kw, field):
    with pytest.raises(SpecError) as e:
        validate_job_spec(JobSpec(**kw))
    assert e.value.field == field


def test_a_spec_names_a_surrogate_and_the_loss_config_follows_it():
    spec = JobSpec(surrogate="dro", dro_beta=0.05)
    validate_job_spec(spec)
    assert LossConfig.from_spec(spec)[-2:] == ("dro", 0.05)
    with pytest.raises(msgspec.ValidationError, match="surrogate"):
        msgspec.convert({"surrogate": "trpo"}, JobSpec)


def test_stable_reinforce_truncates_each_weight_and_masks_a_sequence_outside_its_trust_region():
    # C = 1.2: the token of ratio 1.5 is weighted 1.2, never differentiated
    logp, old, adv, mask = case(-2.0)
    out = policy_loss(logp, old, adv, mask, LossConfig(surrogate="stable_reinforce", rollout_is_threshold=1.2))
    w = [min(r, 1.2) for r in RATIOS]
    lp = logp.detach()[0].tolist()
    assert out.loss.item() == pytest.approx(sum(-c * -2.0 * x for c, x in zip(w, lp)) / 3, rel=1e-6)
    out.loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([2.0 * c / 3 for c in w], rel=1e-5)
    # its geometric-mean ratio 0.9967 leaves the trust region [0.999, 1.001]: nothing trains
    logp, old, adv, mask = case(-2.0)
    out = policy_loss(logp, old, adv, mask, LossConfig(surrogate="stable_reinforce", clip_low=1e-3, clip_high=1e-3))
    out.loss.backward()
    assert out.loss.item() == 0.0 and logp.grad[0].tolist() == [0.0, 0.0, 0.0]
