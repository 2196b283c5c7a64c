"""Tinker's built-in losses: each value and its gradient w.r.t. the learner's logprobs,
computed by hand on small numbers, and the requests they refuse."""

import math

import numpy as np
import pytest
import torch

from opentinker.services.learner.tinker_losses import (LOSS_FNS, REQUIRED_INPUTS, LossInputError, check_inputs,
                                                       datum_loss)

e = math.exp

# Six positions. Log ratios lp - q: 0.2, -0.1, -1.0, -0.5, 0.3, 0.0, so with PPO's
# default bounds [0.8, 1.2]: t0 is clipped (A > 0, r > 1.2), t3 is clipped (A < 0,
# r < 0.8), t2 (A > 0, r < 0.8) and t4 (A < 0, r > 1.2) are outside the bounds but
# keep the unclipped term, t5 has no advantage.
LP = [-0.1, -0.5, -2.0, -1.5, -0.2, -0.7]
Q = [-0.3, -0.4, -1.0, -1.0, -0.5, -0.7]
ADV = [2.0, -1.0, 0.5, -1.0, -1.0, 0.0]


def rl_inputs(q=Q, adv=ADV, **extra):
    n = len(q)
    return {"target_tokens": torch.arange(n, dtype=torch.int64), "logprobs": torch.tensor(q),
            "advantages": torch.tensor(adv), **{k: torch.tensor(v) for k, v in extra.items()}}


def loss_and_grad(loss_fn, inputs, config=None, lp=LP):
    """(loss value, d loss / d lp as a list, metrics)."""
    lp_t = torch.tensor(lp, requires_grad=True)
    loss, metrics = datum_loss(loss_fn, lp_t, inputs, config)
    (grad,) = torch.autograd.grad(loss, lp_t)
    return float(loss.detach()), grad.tolist(), metrics


def approx(values):
    return pytest.approx(values, rel=1e-5, abs=1e-6)


def test_cross_entropy_is_the_weighted_sum_and_takes_negative_weights():
    inputs = {"target_tokens": torch.tensor([5, 6, 7]), "weights": torch.tensor([1.0, -0.5, 0.0])}
    loss, grad, metrics = loss_and_grad("cross_entropy", inputs, lp=[-0.1, -0.5, -2.0])
    assert loss == approx(-(-0.1 * 1.0 + -0.5 * -0.5 + -2.0 * 0.0))  # -0.15: the negative weight lowers it
    assert grad == approx([-1.0, 0.5, 0.0])  # d/dlp_i = -w_i: a negative weight pushes lp_i down
    assert metrics == {"loss": approx(-0.15)}


def test_importance_sampling_value_and_gradient():
    loss, grad, metrics = loss_and_grad("importance_sampling", rl_inputs())
    ratios = [e(0.2), e(-0.1), e(-1.0), e(-0.5), e(0.3), e(0.0)]
    assert loss == approx(-(ratios[0] * 2.0 + ratios[1] * -1.0 + ratios[2] * 0.5 + ratios[3] * -1.0
                            + ratios[4] * -1.0 + ratios[5] * 0.0))
    # d(-r A)/dlp = -r A, since dr/dlp = r
    assert grad == approx([-ratios[0] * 2.0, ratios[1], -ratios[2] * 0.5, ratios[3], ratios[4], 0.0])
    assert metrics["active_tokens"] == 5.0
    assert metrics["ratio_mean"] == approx(sum(ratios[:5]) / 5)
    assert metrics["loss"] == approx(loss)


def test_ppo_default_bounds_clip_where_the_min_takes_the_clipped_term():
    loss, grad, metrics = loss_and_grad("ppo", rl_inputs())
    assert loss == approx(-(1.2 * 2.0            # t0: r = e^0.2 > 1.2, A > 0 -> clipped
                            + e(-0.1) * -1.0     # t1: inside [0.8, 1.2]
                            + e(-1.0) * 0.5      # t2: r < 0.8 but A > 0 -> min keeps r A
                            + 0.8 * -1.0         # t3: r = e^-0.5 < 0.8, A < 0 -> clipped
                            + e(0.3) * -1.0      # t4: r > 1.2 but A < 0 -> min keeps r A
                            + 0.0))
    # clipped tokens carry no gradient; the others -r A
    assert grad == approx([0.0, e(-0.1), -e(-1.0) * 0.5, 0.0, e(0.3), 0.0])
    assert metrics["clipped_tokens"] == 2.0
    assert metrics["active_tokens"] == 5.0


def test_ppo_config_bounds_are_ratio_bounds_not_epsilons():
    config = {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05}
    loss, grad, metrics = loss_and_grad("ppo", rl_inputs(q=[-0.3, -0.4], adv=[2.0, -1.0]), config, lp=[-0.1, -0.5])
    # t0: r = e^0.2 > 1.05, A > 0 -> 1.05 A; t1: r = e^-0.1 ~ 0.905 < 0.95, A < 0 -> 0.95 A
    assert loss == approx(-(1.05 * 2.0 + 0.95 * -1.0))
    assert grad == approx([0.0, 0.0])
    assert metrics["clipped_tokens"] == 2.0


def test_ppo_per_token_bounds_win_over_config():
    config = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.0}  # would clip both tokens
    inputs = rl_inputs(q=[-0.3, -1.0], adv=[2.0, -1.0], clip_low_threshold=[0.5, 0.5], clip_high_threshold=[1.3, 1.1])
    loss, grad, metrics = loss_and_grad("ppo", inputs, config, lp=[-0.1, -1.5])
    # r = e^0.2 ~ 1.22 < 1.3 and r = e^-0.5 ~ 0.61 > 0.5: neither is clipped
    assert loss == approx(-(e(0.2) * 2.0 + e(-0.5) * -1.0))
    assert grad == approx([-e(0.2) * 2.0, e(-0.5)])
    assert metrics["clipped_tokens"] == 0.0


def test_cispo_clipped_weight_is_a_constant_coefficient():
    config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    loss, grad, metrics = loss_and_grad("cispo", rl_inputs(), config)
    coef = [1.2, e(-0.1), 0.8, 0.8, 1.2, 1.0]  # clip(r) per token
    assert loss == approx(-(coef[0] * -0.1 * 2.0 + coef[1] * -0.5 * -1.0 + coef[2] * -2.0 * 0.5
                            + coef[3] * -1.5 * -1.0 + coef[4] * -0.2 * -1.0 + coef[5] * -0.7 * 0.0))
    # sg(): d/dlp_i = -coef_i A_i only. Were the ratio differentiated, t1 (unclipped)
    # would get -r A (lp + 1) instead.
    assert grad == approx([-coef[0] * 2.0, coef[1], -coef[2] * 0.5, coef[3], coef[4], 0.0])
    assert metrics["clipped_tokens"] == 4.0  # t0, t2, t3, t4; t5 has r = 1 and A = 0


def test_cispo_default_is_tinkers_one_sided_clip():
    # Tinker's CISPO page: defaults clip_low_threshold 0.0, clip_high_threshold 4.0.
    loss, grad, metrics = loss_and_grad("cispo", rl_inputs(q=[-2.0, -0.5], adv=[1.0, 1.0]), lp=[-0.1, -3.0])
    # t0: r = e^1.9 ~ 6.7 -> 4.0; t1: r = e^-2.5 ~ 0.08, no lower bound
    assert loss == approx(-(4.0 * -0.1 * 1.0 + e(-2.5) * -3.0 * 1.0))
    assert grad == approx([-4.0, -e(-2.5)])
    assert metrics["clipped_tokens"] == 1.0


def test_cispo_mixes_a_per_token_bound_with_a_config_bound():
    inputs = rl_inputs(q=[-0.3, -1.0], adv=[2.0, -1.0], clip_high_threshold=[1.1, 2.0])
    loss, grad, _ = loss_and_grad("cispo", inputs, {"clip_low_threshold": 0.9}, lp=[-0.1, -1.5])
    # r = e^0.2 ~ 1.22 -> 1.1 (its own high bound); r = e^-0.5 ~ 0.61 -> 0.9 (config low)
    assert loss == approx(-(1.1 * -0.1 * 2.0 + 0.9 * -1.5 * -1.0))
    assert grad == approx([-1.1 * 2.0, 0.9])


def test_dro_value_gradient_and_penalty():
    beta = 0.05
    loss, grad, metrics = loss_and_grad("dro", rl_inputs(), {"beta": beta})
    log_ratios = [0.2, -0.1, -1.0, -0.5, 0.3, 0.0]
    penalty = 0.5 * beta * (0.2 ** 2 + 0.1 ** 2 + 1.0 ** 2 + 0.5 ** 2 + 0.3 ** 2 + 0.0 ** 2)
    assert loss == approx(-(-0.1 * 2.0 + -0.5 * -1.0 + -2.0 * 0.5 + -1.5 * -1.0 + -0.2 * -1.0 + -0.7 * 0.0) + penalty)
    # d/dlp_i = -A_i + beta (lp_i - q_i)
    assert grad == approx([-a + beta * d for a, d in zip(ADV, log_ratios)])
    assert metrics["penalty"] == approx(penalty)


def test_gspo_clips_the_sequence_ratio_of_the_sampled_tokens_by_default():
    loss, grad, metrics = loss_and_grad("gspo", rl_inputs())
    # M = the tokens with A != 0 (t0..t4): log s = mean(0.2, -0.1, -1.0, -0.5, 0.3) = -0.22,
    # below the default lower bound 1 - 3e-4; A > 0 (t0, t2) keeps the unclipped s A, A < 0
    # (t1, t3, t4) takes the clipped term (no gradient), t5 has no advantage
    s, low = e(-0.22), 1 - 3e-4
    assert loss == approx(-(s * 2.0 + s * 0.5) + 3 * low)
    # every token carries s's value with its own logprob's gradient: d/dlp_i = -s A_i
    assert grad == approx([-s * 2.0, 0.0, -s * 0.5, 0.0, 0.0, 0.0])
    assert metrics["ratio_mean"] == approx(s) and metrics["clipped_tokens"] == 3.0


def test_gspo_takes_the_ratio_over_the_sequence_ratio_mask_and_config_bounds():
    mask = [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]  # log s = mean(0.2, -0.1) = 0.05
    s = e(0.05)
    loss, grad, metrics = loss_and_grad("gspo", rl_inputs(sequence_ratio_mask=mask))
    high = 1 + 4e-4  # s > high: A > 0 clipped (t0, t2), A < 0 unclipped (t1, t3, t4)
    assert loss == approx(-(high * 2.0 + high * 0.5) + 3 * s)
    assert grad == approx([0.0, s, 0.0, s, s, 0.0])
    loss, grad, _ = loss_and_grad("gspo", rl_inputs(sequence_ratio_mask=mask), {"clip_high_threshold": 1.2})
    assert grad == approx([-s * a for a in ADV])  # inside [1 - 3e-4, 1.2]: nothing clipped


def test_rl_losses_ignore_weights_as_tinker_does():
    plain, _, _ = loss_and_grad("importance_sampling", rl_inputs())
    weighted, _, _ = loss_and_grad("importance_sampling", rl_inputs(weights=[0.0] * 6))
    assert weighted == plain != 0.0


def test_a_datum_without_advantages_reports_the_on_policy_ratio():
    loss, grad, metrics = loss_and_grad("ppo", rl_inputs(adv=[0.0] * 6))
    assert (loss, grad) == (0.0, [0.0] * 6)
    assert metrics["active_tokens"] == 0.0 and metrics["ratio_mean"] == 1.0


def test_valid_requests_pass_the_front_end_check():
    n = 4
    tokens, floats = np.arange(n, dtype=np.int64), np.zeros(n, dtype=np.float32)
    for loss_fn in LOSS_FNS:
        inputs = {key: tokens if key in ("target_tokens", "recorded_sequence") else floats
                  for key in REQUIRED_INPUTS[loss_fn]}
        config = {"beta": 0.05} if loss_fn == "dro" else {}
        assert check_inputs(loss_fn, inputs, n, config) is None
    per_token = {"clip_low_threshold": np.full(n, 0.5, np.float32), "clip_high_threshold": np.full(n, 1.5, np.float32)}
    check_inputs("ppo", {"target_tokens": tokens, "logprobs": floats, "advantages": floats, **per_token}, n, None)


# --- refused requests: the same cases through check_inputs (numpy, before torch) and
# datum_loss (tensors), where datum_loss checks them too.

N = 4
GOOD = {"target_tokens": [1, 2, 3, 4], "logprobs": [-1.0] * N, "advantages": [1.0] * N}


def numpy_inputs(inputs):
    return {k: np.asarray(v, dtype=np.int64 if k == "target_tokens" else np.float32) for k, v in inputs.items()}


def both_paths(loss_fn, inputs, config):
    """Yield a thunk per path: check_inputs on arrays, datum_loss on tensors."""
    yield lambda: check_inputs(loss_fn, numpy_inputs(inputs), N, config)
    tensors = {k: torch.as_tensor(v) for k, v in numpy_inputs(inputs).items()}
    yield lambda: datum_loss(loss_fn, torch.zeros(N, requires_grad=True), tensors, config)


@pytest.mark.parametrize("loss_fn, inputs, config, message", [
    ("trpo", GOOD, None, r"loss_fn 'trpo' is not supported \(supported: cross_entropy, importance_sampling, ppo"),
    ("ppo", {**GOOD, "sequence_ratio_mask": [1.0] * N}, None, r"'sequence_ratio_mask'\] is not an input of 'ppo'"),
    ("ppo", {k: v for k, v in GOOD.items() if k != "advantages"}, None, r"needs loss_fn_inputs\['advantages'\]"),
    ("cross_entropy", {"target_tokens": [1, 2, 3, 4]}, None, r"needs loss_fn_inputs\['weights'\]"),
    ("ppo", {**GOOD, "advantages": [1.0, 2.0, 3.0]}, None,
     r"loss_fn_inputs\['advantages'\]: shape \[3\] does not match the 4 target tokens"),
    ("cross_entropy", {"target_tokens": [[1, 2]] * N, "weights": [1.0] * N}, None,
     r"loss_fn_inputs\['target_tokens'\]: shape \[4, 2\] does not match"),
    ("importance_sampling", {**GOOD, "mask": [1.0] * N}, None, r"loss_fn_inputs\['mask'\] is not an input of"),
    ("importance_sampling", {**GOOD, "clip_low_threshold": [0.8] * N}, None, r"'clip_low_threshold'\] is not an input"),
    ("ppo", GOOD, {"clip_ratio": 0.2}, r"loss_fn_config key 'clip_ratio' is not accepted by 'ppo'"),
    ("cross_entropy", {"target_tokens": [1, 2, 3, 4], "weights": [1.0] * N}, {"beta": 0.1},
     r"key 'beta' is not accepted by 'cross_entropy' \(accepted: none\)"),
    ("ppo", GOOD, {"clip_low_threshold": "0.8"},
     r"loss_fn_config\['clip_low_threshold'\]: '0.8' is not a finite number"),
    ("cispo", GOOD, {"clip_high_threshold": math.inf}, r"'clip_high_threshold'\]: inf is not a finite number"),
    ("ppo", GOOD, {"clip_low_threshold": 1.3}, r"clip_low_threshold 1.3 exceeds clip_high_threshold 1.2"),
    ("ppo", {**GOOD, "clip_high_threshold": [1.2, 0.5, 1.2, 1.2]}, {"clip_low_threshold": 0.8},
     r"clip_low_threshold 0.8 exceeds clip_high_threshold \(per token, 0.5\.\.1.2\)"),
    ("dro", GOOD, None, r"loss_fn 'dro' needs loss_fn_config\['beta'\]"),
    ("dro", GOOD, {"beta": -0.1}, r"loss_fn_config\['beta'\]: -0.1 is negative"),
])
def test_bad_requests_are_refused_naming_the_field(loss_fn, inputs, config, message):
    for run in both_paths(loss_fn, inputs, config):
        with pytest.raises(LossInputError, match=message):
            run()


@pytest.mark.parametrize("key, value, message", [
    ("target_tokens", np.array([1.0, 2.0, 3.0, 4.0]), r"'target_tokens'\]: dtype float64 is not an integer"),
    ("target_tokens", np.array([1, -2, 3, 4]), r"token ids must be >= 0"),
    ("advantages", np.array([1.0, np.nan, 0.0, 0.0]), r"'advantages'\]: contains NaN or infinity"),
    ("logprobs", np.array(["a", "b", "c", "d"]), r"'logprobs'\]: dtype <U1 is not a real number"),
])
def test_front_end_refuses_bad_dtypes_and_values(key, value, message):
    with pytest.raises(LossInputError, match=message):
        check_inputs("importance_sampling", {**numpy_inputs(GOOD), key: value}, N, None)


def test_loss_input_error_is_a_value_error():
    with pytest.raises(ValueError):
        check_inputs("sft", {}, 0, None)


def test_stable_reinforce_weighs_by_the_recorded_sampler_and_masks_a_sequence_off_its_trust_region():
    # positions 0-1: prompt (no sampled sequence: nothing trains, whatever the advantage);
    # 2-3: sequence 0, log ratios 0.8 and -0.7 (mean 0.05, inside [ln 0.9, ln 1.1]), the
    # first weight e^0.8 = 2.23 truncated to C = 2; 4-5: sequence 1, log ratios 0.3 and
    # 0.2 (geometric mean e^0.25 = 1.28 > 1.1): masked whole
    lp = [-0.5, -0.6, -0.2, -1.7, -0.4, -0.3]
    mu = [0.0, 0.0, -1.0, -1.0, -0.7, -0.5]
    adv = [5.0, 5.0, 1.5, -2.0, 1.0, 1.0]
    inputs = {"target_tokens": torch.arange(6), "advantages": torch.tensor(adv),
              "recorded_logprobs": torch.tensor(mu), "recorded_sequence": torch.tensor([-1, -1, 0, 0, 1, 1]),
              "logprobs": torch.tensor([9.0] * 6)}  # the client's: not read
    loss, grad, metrics = loss_and_grad("stable_reinforce", inputs, lp=lp)
    assert loss == approx(-(2.0 * 1.5 * -0.2 + e(-0.7) * -2.0 * -1.7))
    assert grad == approx([0.0, 0.0, -2.0 * 1.5, -e(-0.7) * -2.0, 0.0, 0.0])
    assert metrics["active_tokens"] == 4.0 and metrics["masked_tokens"] == 2.0
    assert metrics["truncated_tokens"] == 1.0 and metrics["clipped_tokens"] == 3.0
    assert metrics["ratio_mean"] == approx((e(0.8) + e(-0.7) + e(0.3) + e(0.2)) / 4)
    # a wider trust region keeps sequence 1; a larger C keeps the first weight whole
    loss, grad, _ = loss_and_grad("stable_reinforce", inputs, {"clip_high_threshold": 1.5, "is_threshold": 3.0},
                                  lp=lp)
    assert grad == approx([0.0, 0.0, -e(0.8) * 1.5, -e(-0.7) * -2.0, -e(0.3), -e(0.2)])
    for config, message in (({"is_threshold": 0.5}, "is_threshold"), ({"clip_low_threshold": 2.0}, "exceeds"),
                            ({"beta": 0.1}, "not accepted")):
        with pytest.raises(LossInputError, match=message):
            datum_loss("stable_reinforce", torch.tensor(lp), inputs, config)
    bad = dict(inputs, recorded_sequence=np.array([-2, -1, 0, 0, 1, 1]))
    with pytest.raises(LossInputError, match="sequence indices must be >= -1"):
        check_inputs("stable_reinforce", {k: np.asarray(v) for k, v in bad.items()}, 6)
