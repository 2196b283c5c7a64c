"""The learner engine's training step on a tiny model (real DeepSpeed, CPU): logprobs
computed only at policy positions equal the full-logits computation; one optimizer
update per planned update, whatever the micro-batch count; no update changes nothing;
the behaviour correction's proximal logprobs and statistics."""

from __future__ import annotations

import os

import pytest
import torch

from opentinker.schemas import JobSpec, Trajectory, TurnRecord
from opentinker.services.learner.batching import build_batch, micro_batches
from opentinker.services.learner.loss import AggTotals, token_logprobs


@pytest.fixture
def rank_env(monkeypatch):
    # the engine sets its one-process group's rank variables; keep them out of the
    # environment that services started by later tests inherit
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(key, os.environ.get(key, value))


def _traj(i: int, prompt: int, gen: int, reward: float, logp: float = -2.0) -> Trajectory:
    ids = [(7 * i + 3 * k) % 500 + 10 for k in range(prompt + gen)]
    return Trajectory(job_id="j", request_id="r", episode_id=f"e{i}", step=0, group_index=0, group_size=2,
                      token_ids=ids, loss_mask=[0] * prompt + [1] * gen, logprobs=[0.0] * prompt + [logp] * gen,
                      prompt_len=prompt,
                      turns=[TurnRecord(gen_start=prompt, gen_end=prompt + gen, obs_end=prompt + gen)],
                      reward=reward, policy_version=0)


def _engine(tiny_model, **kw):
    from opentinker.services.learner.engine_deepspeed import TrainEngine

    spec = JobSpec(lora_rank=0, lr=1e-3, micro_batch_size=2, prompts_per_step=2, group_size=2, **kw)
    return TrainEngine(spec, tiny_model, device="cpu")


def _params(eng) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in eng.module.parameters() if p.requires_grad])


def test_an_engine_on_another_device_than_deepspeeds_is_refused(tiny_model, rank_env, monkeypatch):
    """DeepSpeed fixes its accelerator at its first import, here the CPU's: an engine asked
    for CUDA in the same process says so, instead of failing at its first batch."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    import deepspeed  # noqa: F401

    from opentinker.services.learner.engine_deepspeed import TrainEngine

    spec = JobSpec(lora_rank=0, micro_batch_size=2, prompts_per_step=2, group_size=2)
    with pytest.raises(RuntimeError, match="a learner on 'cuda' needs a process of its own: DeepSpeed's "
                                           "accelerator in this process is 'cpu'"):
        TrainEngine(spec, tiny_model, device="cuda")
    assert os.environ["DS_ACCELERATOR"] == "cpu"


def test_policy_position_logprobs_equal_the_full_logits(tiny_model, rank_env):
    eng = _engine(tiny_model)
    try:
        trajs = [_traj(0, 5, 3, 1.0), _traj(1, 9, 4, 0.0), _traj(2, 3, 6, 1.0)]
        b = build_batch(trajs, [1.0, -1.0, 0.5], eng.pad_id)
        with torch.no_grad():
            fast, ent = eng._logprobs(eng.engine, b, 0.7)
            logits = eng.engine(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
            full, full_ent = token_logprobs(logits, b.input_ids, 0.7)
        keep = b.loss_mask > 0
        assert torch.allclose(fast[keep], full[keep], atol=1e-5)
        assert torch.allclose(ent[keep], full_ent[keep], atol=1e-4)
        assert torch.all(fast[~keep] == 0)
    finally:
        eng.close()


def test_a_bfloat16_learner_on_cpu_attends_eagerly_with_sdpa_s_logprobs(tiny_model, rank_env):
    """On a CPU a bfloat16 learner loads eager attention (SDPA's CPU kernel is slow in
    bfloat16, models.training_attention); over a padded batch its policy logprobs equal
    those of the same weights under SDPA, within bfloat16's rounding. A float32 learner
    keeps transformers' default."""
    from opentinker.services.core.models import load_policy_model

    eng = _engine(tiny_model, dtype="bfloat16")
    try:
        assert eng.module.config._attn_implementation == "eager"
        trajs = [_traj(0, 5, 3, 1.0), _traj(1, 9, 4, 0.0), _traj(2, 3, 6, 1.0)]
        b = build_batch(trajs, [1.0, -1.0, 0.5], eng.pad_id)
        assert not bool(b.attention_mask.all())  # padded: the mask matters
        sdpa = load_policy_model(tiny_model, dtype=torch.bfloat16, attn_implementation="sdpa")
        with torch.no_grad():
            eager_logp, _ = eng._logprobs(eng.engine, b, 1.0)
            ref, _ = token_logprobs(sdpa(input_ids=b.input_ids, attention_mask=b.attention_mask).logits, b.input_ids)
        keep = b.loss_mask > 0
        assert torch.allclose(eager_logp[keep], ref[keep], atol=0.05), (eager_logp[keep] - ref[keep]).abs().max()
    finally:
        eng.close()
    fp32 = _engine(tiny_model)
    try:
        assert fp32.module.config._attn_implementation == "sdpa"
    finally:
        fp32.close()


def test_a_bfloat16_learner_sums_micro_batch_gradients_in_float32():
    """In bfloat16 each micro-batch's gradient would be added into a bfloat16 sum (8
    significant bits); the config asks DeepSpeed for float32 sums (`data_types.
    grad_accum_dtype`), which it gives under ZeRO only, so stage 0 runs at stage 1. A
    float32 learner, and a tinker session (stage 0, .grad across calls), are unchanged."""
    from opentinker.services.learner.ds_config import deepspeed_config

    for stage in (0, 1, 2, 3):
        c = deepspeed_config(JobSpec(zero_stage=stage), 1, "bfloat16")
        assert c["bf16"] == {"enabled": True} and c["data_types"] == {"grad_accum_dtype": "fp32"}
        assert c["zero_optimization"] == {"stage": max(stage, 1)}
    f32 = deepspeed_config(JobSpec(zero_stage=0, micro_batch_size=4), 2, "float32")
    assert "data_types" not in f32 and f32["zero_optimization"] == {"stage": 0} and not f32["bf16"]["enabled"]
    assert (f32["train_micro_batch_size_per_gpu"], f32["train_batch_size"], f32["gradient_accumulation_steps"]) == \
        (4, 8, 1)
    tinker = deepspeed_config(JobSpec(algorithm="tinker"), 1, "bfloat16")
    assert "data_types" not in tinker and tinker["zero_optimization"] == {"stage": 0}


def test_a_bfloat16_engine_accumulates_in_float32_and_updates_once(tiny_model, rank_env):
    eng = _engine(tiny_model, dtype="bfloat16")  # zero_stage 0
    try:
        assert eng.engine.get_data_types() == (torch.bfloat16, torch.float32)
        trajs = [_traj(i, 4 + i, 3, float(i % 2)) for i in range(4)]
        mbs = micro_batches(trajs, [1.0, -1.0, 1.0, -1.0], 1, eng.pad_id)  # 4 micro-batches, one update
        tot = AggTotals(tokens=float(sum(b.num_tokens for b in mbs)), seqs=4.0, max_len=32.0)
        before, steps0 = _params(eng), eng.engine.global_steps
        out = eng.train_step(mbs, [[0, 1, 2, 3]], [tot], [1e-3])
        assert eng.engine.global_steps == steps0 + 1 and out["grad_norm"] > 0
        assert not torch.equal(before, _params(eng))
    finally:
        eng.close()


def test_one_optimizer_update_per_planned_update(tiny_model, rank_env):
    eng = _engine(tiny_model, rollout_is="token")
    try:
        trajs = [_traj(i, 4 + i, 3, float(i % 2)) for i in range(4)]
        adv = [1.0, -1.0, 1.0, -1.0]
        mbs = micro_batches(trajs, adv, 1, eng.pad_id)  # 4 micro-batches, one update
        tot = AggTotals(tokens=float(sum(b.num_tokens for b in mbs)), seqs=4.0, max_len=32.0)
        before, steps0 = _params(eng), eng.engine.global_steps
        out = eng.train_step(mbs, [[0, 1, 2, 3]], [tot], [1e-3])
        assert eng.engine.global_steps == steps0 + 1 and out["updates"] == 1.0
        assert "kl" not in out  # kl_coef 0: no reference, so no KL to it (not a 0 that reads as one)
        assert out["grad_norm"] > 0 and not torch.equal(before, _params(eng))
        # a single update: the proximal policy is the current one, so the weights are
        # pi_prox / pi_behav of the sampler's logprobs (-2.0 here) and the gap is measured
        assert out["mismatch_kl"] > 0 and out["is_weight_mean"] > 0
        # two updates (mini-batches): two optimizer steps, the proximal logprobs computed once
        halves = [[0, 1], [2, 3]]
        tots = [AggTotals(float(sum(mbs[i].num_tokens for i in h)), 2.0, 32.0) for h in halves]
        out2 = eng.train_step(mbs, halves, tots, [1e-3, 5e-4])
        assert eng.engine.global_steps == steps0 + 3 and out2["updates"] == 2.0
        assert eng.engine.optimizer.param_groups[0]["lr"] == 5e-4
        # nothing to train: no step, no change (AdamW momentum would still move them)
        frozen = _params(eng)
        assert eng.train_step([], [], [], [])["updates"] == 0.0
        assert eng.engine.global_steps == steps0 + 3 and torch.equal(frozen, _params(eng))
        with pytest.raises(ValueError, match="totals"):
            eng.train_step(mbs, halves, tots[:1])
    finally:
        eng.close()


def test_the_sampler_learner_gap_is_reported_without_the_correction_too(tiny_model, rank_env):
    """rollout_is "none" (the main job's) computes no proximal logprobs, and reported a
    mismatch_kl of 0 whatever the gap. Before the first optimizer step the current
    policy is the proximal one: the gap is measured there, as a "token" job measures it
    on the same batch and weights, and over the first update only when there are two."""
    trajs = [_traj(i, 4 + i, 3, float(i % 2)) for i in range(4)]
    got = {}
    for mode in ("token", "none"):
        torch.manual_seed(0)
        eng = _engine(tiny_model, rollout_is=mode)
        try:
            mbs = micro_batches(trajs, [1.0, -1.0, 1.0, -1.0], 1, eng.pad_id)
            tot = AggTotals(tokens=float(sum(b.num_tokens for b in mbs)), seqs=4.0, max_len=32.0)
            got[mode] = eng.train_step(mbs, [[0, 1, 2, 3]], [tot], [1e-3])
            if mode == "none":
                halves = [[0, 1], [2, 3]]
                tots = [AggTotals(float(sum(mbs[i].num_tokens for i in h)), 2.0, 32.0) for h in halves]
                first = eng.train_step(mbs, halves[:1], tots[:1], [0.0])  # lr 0: the first half, weights kept
                moved = eng.train_step(mbs, halves, tots, [1.0, 1e-3])  # the second update past a big step
        finally:
            eng.close()
    assert got["none"]["mismatch_kl"] > 0.1  # the sampler's logprobs (-2.0) are far from the tiny model's
    assert got["none"]["mismatch_kl"] == pytest.approx(got["token"]["mismatch_kl"], rel=1e-4)
    assert got["none"]["mismatch_kl"] == pytest.approx(got["none"]["approx_kl"], rel=1e-6)
    # two updates: the gap over the first one's tokens, at the weights before the step
    # (the second update's tokens, past a step of lr 1, are not at the proximal policy)
    assert moved["mismatch_kl"] == pytest.approx(first["mismatch_kl"], rel=1e-4)
    assert moved["approx_kl"] != pytest.approx(first["mismatch_kl"], rel=1e-2)


def test_an_engine_made_after_its_process_group_lost_the_rank_variables_starts(tiny_model, rank_env, monkeypatch):
    """The one-process group outlives the environment it was made in (a test's rank
    variables restored at its end); DeepSpeed asserts LOCAL_RANK at each engine, so a
    later engine in that process failed (seen in CI: test_gpu_bench after this file)."""
    _engine(tiny_model).close()  # the group exists from here on, whoever made it
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    eng = _engine(tiny_model)
    try:
        assert eng.world_size == 1 and os.environ["LOCAL_RANK"] == "0"
    finally:
        eng.close()


def test_skipping_zero_variance_groups_leaves_the_update_unchanged(tiny_model, rank_env):
    """Two steps from the same weights: the second with group 1 (episodes 2, 3) without
    signal. Forwarding it, and skipping it with the normalizers batching.plan_updates
    gives, end at the same weights; normalizing over the forwarded episodes only (a
    gradient 2x larger here) does not, as AdamW's second step is not scale-free."""
    from opentinker.services.learner.batching import plan_updates, policy_tokens

    trajs = [_traj(i, 4 + i, 3 + i, 0.0) for i in range(4)]
    tokens = [policy_tokens(t) for t in trajs]
    first = [1.0, -1.0, 1.0, -1.0]  # the first step: every episode with signal
    adv = [1.0, -1.0, 0.0, 0.0]
    ends = {}
    for way in ("forward all", "skip", "skip, normalize over the forwarded"):
        eng = _engine(tiny_model, max_grad_norm=1e6)
        try:
            mbs = micro_batches(trajs, first, 2, eng.pad_id)
            eng.train_step(mbs, [[0, 1]], [AggTotals(float(sum(tokens)), 4.0, 32.0)], [1e-3])
            if way == "forward all":
                mbs = micro_batches(trajs, adv, 2, eng.pad_id)
                eng.train_step(mbs, [[0, 1]], [AggTotals(float(sum(tokens)), 4.0, 32.0)], [1e-3])
            else:
                plan = plan_updates([0, 1, 2, 3], [False, False, True, True], tokens, 1, 1, 0, 32)
                (u,) = plan.updates
                episodes = plan.mini_batches[u.mini_batch]
                assert episodes == [0, 1]
                totals = u.totals if way == "skip" else AggTotals(float(tokens[0] + tokens[1]), 2.0, 32.0)
                mbs = micro_batches([trajs[i] for i in episodes], [adv[i] for i in episodes], 2, eng.pad_id)
                eng.train_step(mbs, [list(range(len(mbs)))], [totals], [1e-3])
            ends[way] = _params(eng)
        finally:
            eng.close()
    assert torch.allclose(ends["forward all"], ends["skip"], atol=1e-6)
    assert not torch.allclose(ends["forward all"], ends["skip, normalize over the forwarded"], atol=1e-6)


def test_a_kl_term_reports_the_kl_to_the_reference(tiny_model, rank_env):
    eng = _engine(tiny_model, kl_coef=0.1)
    try:
        trajs = [_traj(i, 4 + i, 3, float(i % 2)) for i in range(4)]
        mbs = micro_batches(trajs, [1.0, -1.0, 1.0, -1.0], 1, eng.pad_id)
        tot = AggTotals(tokens=float(sum(b.num_tokens for b in mbs)), seqs=4.0, max_len=32.0)
        assert eng.train_step(mbs, [[0, 1, 2, 3]], [tot], [1e-3])["kl"] == 0.0  # the policy is still the reference
        assert eng.train_step(mbs, [[0, 1, 2, 3]], [tot], [1e-3])["kl"] > 0  # one update later it is not
    finally:
        eng.close()


def test_the_gradient_norm_is_the_float32_norm_of_every_gradient(tiny_model, rank_env):
    eng = _engine(tiny_model, dtype="bfloat16", algorithm="tinker")  # stage 0: the norm is the engine's own
    try:
        params = [p for p in eng.module.parameters() if p.requires_grad]
        for p in params:
            p.grad = None
        for i, p in enumerate(params[:3]):
            p.grad = torch.full_like(p, 0.5 * (i + 1))  # exact in bfloat16
        expect = sum((0.5 * (i + 1)) ** 2 * p.numel() for i, p in enumerate(params[:3])) ** 0.5
        assert abs(eng._grad_norm() - expect) <= 1e-6 * expect
        for p in params:
            p.grad = None
        assert eng._grad_norm() == 0.0
    finally:
        eng.close()
