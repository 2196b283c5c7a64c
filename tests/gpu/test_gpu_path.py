"""The GPU path, on a machine with CUDA (`pytest -m gpu tests/gpu`; skipped without a
device): the DeepSpeed learner on CUDA against the same step on CPU (and a CPU learner
refused in a process whose DeepSpeed took CUDA), the bf16 learner (and `dtype = "auto"`
resolving to it),
vLLM's CUDA engine with an in-place weight reload, the transformers engine's compiled
decode and on-GPU LoRA merge, and the data-parallel learner on
every GPU (one rank each, nccl) against one rank."""

from __future__ import annotations

import gc
import math
import os

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture
def rank_env(monkeypatch):
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(key, os.environ.get(key, value))


def _step(tiny_model: str, device: str, dtype: str = "float32") -> tuple[dict, torch.Tensor]:
    """Two train steps of the engine_step.py batch on `device`; (last metrics, LoRA B)."""
    from ranks.engine_step import trajectory

    from opentinker.schemas import JobSpec
    from opentinker.services.learner.batching import micro_batches
    from opentinker.services.learner.engine_deepspeed import TrainEngine
    from opentinker.services.learner.loss import AggTotals

    torch.manual_seed(0)
    spec = JobSpec(lora_rank=4, lora_alpha=8, lr=1e-2, micro_batch_size=2, prompts_per_step=1, group_size=8,
                   dtype=dtype)
    eng = TrainEngine(spec, tiny_model, device=device)
    try:
        trajs = [trajectory(i, 4 + i % 3, 3 + i % 4, float(i % 2)) for i in range(7)]
        mbs = micro_batches(trajs, [1.0 if t.reward else -1.0 for t in trajs], 2, eng.pad_id)
        mbs = [b._replace(logprobs=lp.detach().cpu()) for b, lp in zip(mbs, eng.sequence_logprobs(mbs, False))]
        tot = AggTotals(tokens=float(sum(b.num_tokens for b in mbs)), seqs=7.0, max_len=32.0)
        out = [eng.train_step(mbs, [list(range(len(mbs)))], [tot], [spec.lr]) for _ in range(2)][-1]
        b = torch.cat([p.detach().float().cpu().flatten() for n, p in eng.module.named_parameters() if "lora_B" in n])
        return out, b
    finally:
        eng.close()


@pytest.mark.timeout(900)
def test_the_learner_on_cuda_trains_as_on_cpu(tmp_path, tiny_model):
    """Two steps of tests/ranks/engine_step.py on each device, each in a process of its
    own (DeepSpeed fixes its accelerator at its first import)."""
    from conftest import run_ranks

    cuda, w_cuda = run_ranks(1, tiny_model, tmp_path / "cuda", 0, "cuda")
    cpu, w_cpu = run_ranks(1, tiny_model, tmp_path / "cpu", 0, "cpu")
    assert cuda["steps"][-1]["loss"] == pytest.approx(cpu["steps"][-1]["loss"], rel=1e-3, abs=1e-5)
    assert cuda["steps"][-1]["grad_norm"] == pytest.approx(cpu["steps"][-1]["grad_norm"], rel=1e-3)
    assert w_cuda.keys() == w_cpu.keys() and any("lora_B" in k for k in w_cpu)
    assert all(torch.allclose(w_cuda[k], w_cpu[k], atol=1e-4) for k in w_cpu)
    assert sum(w_cpu[k].abs().sum() for k in w_cpu if "lora_B" in k) > 0  # it trained


@pytest.mark.timeout(600)
def test_a_cpu_learner_beside_a_cuda_one_is_refused(tiny_model, rank_env):
    _step(tiny_model, "cuda")
    with pytest.raises(RuntimeError, match="a learner on 'cpu' needs a process of its own"):
        _step(tiny_model, "cpu")


@pytest.mark.timeout(600)
def test_the_bf16_learner_on_cuda_trains(tiny_model, rank_env):
    out, b = _step(tiny_model, "cuda", dtype="bfloat16")
    assert math.isfinite(out["loss"]) and out["grad_norm"] > 0 and b.abs().sum() > 0


@pytest.mark.timeout(600)
def test_dtype_auto_on_cuda_is_a_bfloat16_learner_with_sdpa(tiny_model, rank_env):
    """`dtype = "auto"` on a GPU with bf16: a bfloat16 learner, which keeps transformers'
    SDPA attention (eager is the CPU's choice); the sampler's "auto" is bfloat16 there."""
    from opentinker.schemas import JobSpec
    from opentinker.services.core.models import native_bf16, resolve_sampler_dtype
    from opentinker.services.learner.engine_deepspeed import TrainEngine

    assert native_bf16("cuda")
    assert resolve_sampler_dtype("auto", "cuda", "auto") == "bfloat16"
    spec = JobSpec(lora_rank=4, lora_alpha=8, micro_batch_size=2, prompts_per_step=1, group_size=8, dtype="auto")
    eng = TrainEngine(spec, tiny_model, device="cuda")
    try:
        assert eng.dtype == "bfloat16"
        assert next(eng.module.parameters()).dtype == torch.bfloat16
        assert eng.module.config._attn_implementation == "sdpa"
    finally:
        eng.close()


@pytest.mark.timeout(900)
def test_vllm_on_cuda_generates_and_scores_a_reload_as_a_fresh_engine(tiny_model, tmp_path):
    pytest.importorskip("vllm")
    from safetensors.torch import load_file

    from opentinker.schemas import SamplingParams
    from opentinker.services.rollout.engine_vllm import VLLMEngine

    base = load_file(f"{tiny_model}/model.safetensors")
    key = "model.layers.0.self_attn.q_proj.weight"
    engine = VLLMEngine(tiny_model, device="cuda")
    try:
        prompt = list(range(10, 40))
        outs = engine.generate([prompt] * 4, SamplingParams(temperature=1.0, max_new_tokens=8))
        assert all(len(o.token_ids) == 8 and len(o.logprobs) == 8 for o in outs)
        before = engine.prompt_logprobs([prompt])[0][1:]
        engine.load_weights({key: base[key] * 1.5})
        after = engine.prompt_logprobs([prompt])[0][1:]
        assert max(abs(a - b) for a, b in zip(after, before)) > 1e-3  # the reload took effect
    finally:
        del engine
        gc.collect()


@pytest.mark.timeout(900)
def test_the_transformers_engine_on_cuda_decodes_compiled_and_merges_lora_on_the_gpu(tiny_model):
    """hf_decode "auto" on CUDA is the compiled static-cache decode: the same greedy
    tokens as the growing cache, before and after a LoRA version merged on the GPU
    (W0 and the merged weights never leave the device)."""
    from conftest import make_lora

    from opentinker.schemas import SamplingParams
    from opentinker.services.rollout.engine_hf import HFEngine
    from opentinker.services.rollout.weights import lora_pairs, lora_scale, merge_lora

    dyn = HFEngine(tiny_model, device="cuda", decode="dynamic")
    eng = HFEngine(tiny_model, device="cuda", decode="auto")
    assert eng.decode == "compiled"
    sd, peft_merged = make_lora(tiny_model, r=4, alpha=8, std=0.05, seed=0)
    greedy = SamplingParams(temperature=0, max_new_tokens=16)
    prompts = [list(range(10, 40)), list(range(50, 60)), list(range(7, 30))]
    for version in (0, 1):
        if version:
            pairs = lora_pairs(sd)
            for e in (dyn, eng):
                merged = merge_lora(e.base_weights, pairs, lora_scale(8, 4, pairs), e.merge_dtype)
                assert all(t.is_cuda for t in merged.values())
                e.load_weights(merged)
            for name in pairs:
                assert torch.allclose(eng.model.get_parameter(name).cpu(), peft_merged.get_parameter(name), atol=1e-5)
        a, b = dyn.generate(prompts, greedy), eng.generate(prompts, greedy)
        assert [o.token_ids for o in b] == [o.token_ids for o in a], version
        assert eng.decode == "compiled" and eng._compiled_ok
    del dyn, eng
    gc.collect()


@pytest.mark.timeout(900)
def test_a_seeded_row_on_cuda_draws_as_on_the_cpu_whatever_its_batch(tiny_model):
    """A seeded row's draws come from its seed's CPU stream (per_request_uniforms), one
    transfer a generation, and the whole batch samples at once: on CUDA its completion
    does not depend on the rows beside it (compiled decode too), and its logprobs are
    those the CPU engine computes for the same tokens."""
    from opentinker.schemas import SamplingParams
    from opentinker.services.rollout.engine_hf import HFEngine

    sp = SamplingParams(temperature=1.0, max_new_tokens=12)
    prompts = [[1, 20 + i, 30, 40] for i in range(3)]
    seeds = [101, 102, 103]
    for decode in ("dynamic", "auto"):  # every batch below is 3-4 rows: one compiled shape
        eng = HFEngine(tiny_model, device="cuda", decode=decode)
        first = [o.token_ids for o in eng.generate(prompts, sp, seeds=seeds)]
        beside = eng.generate(prompts[1:2] + [[1, 99]] * 2, sp, seeds=seeds[1:2] + [None] * 2)
        mixed = eng.generate(prompts[::-1] + [[1, 99]], sp, seeds=seeds[::-1] + [None])
        assert beside[0].token_ids == first[1], decode
        assert [o.token_ids for o in mixed[:3]][::-1] == first, decode
        del eng
        gc.collect()
    cpu = HFEngine(tiny_model, device="cpu")
    mine = cpu.generate(prompts[1:2], sp, seeds=seeds[1:2])[0]
    # the same uniforms: where the two devices' probabilities agree the tokens agree
    n = next((i for i, (a, b) in enumerate(zip(mine.token_ids, beside[0].token_ids)) if a != b), len(mine.token_ids))
    assert n >= 4 and all(abs(a - b) < 1e-3 for a, b in zip(mine.logprobs[:n], beside[0].logprobs[:n]))


@pytest.mark.timeout(900)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more GPUs")
def test_the_data_parallel_learner_on_every_gpu_trains_as_one_rank(tmp_path, tiny_model):
    from conftest import run_ranks

    one, w1 = run_ranks(1, tiny_model, tmp_path / "one", 0, "cuda")
    many, wn = run_ranks(torch.cuda.device_count(), tiny_model, tmp_path / "many", 2, "cuda")
    assert many["steps"][-1]["loss"] == pytest.approx(one["steps"][-1]["loss"], rel=1e-3, abs=1e-5)
    assert all(torch.allclose(w1[k], wn[k], atol=1e-4) for k in w1)
