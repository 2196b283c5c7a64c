"""LoRA merging against peft's own merge, adapter key forms, and the load plan that
moves an engine between policies."""

import hashlib

import pytest
import torch
from safetensors.torch import save

from opentinker.services.rollout.weights import (
    BaseWeights,
    HeldWeights,
    WeightsError,
    check_sha256,
    decode_tensors,
    lora_pairs,
    lora_scale,
    merge_lora,
    parse_uri,
)


@pytest.fixture(scope="module")
def adapted(tiny_model):
    """A peft LoRA (r 4, alpha 8, q/v) on the tiny model with a non-zero lora_B, its
    state dict as the learner publishes it, and peft's merged weights."""
    from conftest import make_lora

    sd, model = make_lora(tiny_model, r=4, alpha=8, std=0.05, seed=0)
    return sd, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_merge_matches_peft_merge_and_unload(tiny_model, adapted):
    sd, merged = adapted
    base = BaseWeights(tiny_model)
    pairs = lora_pairs(decode_tensors(save(sd)))
    targets = [f"model.layers.{i}.self_attn.{m}.weight" for i in range(2) for m in ("q_proj", "v_proj")]
    assert sorted(pairs) == sorted(targets)
    out = merge_lora(base, pairs, lora_scale(8, 4, pairs))
    for name, w in out.items():
        assert torch.allclose(w, merged[name], atol=1e-6), name
        assert not torch.allclose(w, base[name])
    # merging again starts from W0: the same adapter gives the same weights
    assert all(torch.equal(w, merge_lora(base, pairs, 2.0)[n]) for n, w in out.items())


def test_adapter_key_forms_are_equivalent(adapted):
    sd, _ = adapted
    plain = lora_pairs(sd)
    named = lora_pairs({k.replace(".weight", ".default.weight"): v for k, v in sd.items()})
    bare = lora_pairs({k.removeprefix("base_model.model.").removesuffix(".weight"): v for k, v in sd.items()})
    assert plain.keys() == named.keys() == bare.keys()
    assert lora_scale(16, 0, plain) == 4.0  # rank read from the adapter when the event gives 0


def test_bad_adapters_and_bytes_are_refused(tiny_model, adapted):
    sd, _ = adapted
    a_only = {k: v for k, v in sd.items() if "lora_A" in k}
    with pytest.raises(WeightsError, match="not both A and B"):
        lora_pairs(a_only)
    with pytest.raises(WeightsError, match="not a LoRA"):
        lora_pairs({"base_model.model.lm_head.modules_to_save.weight": torch.zeros(2, 2)})
    wrong = {k.replace("layers.0", "layers.9"): v for k, v in sd.items()}
    with pytest.raises(WeightsError, match="no parameter"):
        merge_lora(BaseWeights(tiny_model), lora_pairs(wrong), 2.0)
    with pytest.raises(WeightsError, match="sha256"):
        check_sha256(b"abc", hashlib.sha256(b"abd").hexdigest())
    with pytest.raises(WeightsError, match="safetensors"):
        decode_tensors(b"not a safetensors file")
    assert parse_uri("nats-os://ot_weights/j1/v3.safetensors") == ("nats-os", "ot_weights", "j1/v3.safetensors")
    assert parse_uri("file:///tmp/w.safetensors") == ("file", "", "/tmp/w.safetensors")
    with pytest.raises(WeightsError, match="scheme"):
        parse_uri("s3://bucket/w")


def test_plan_restores_old_targets_and_sends_fused_siblings():
    modules = ("q_proj", "k_proj", "v_proj", "o_proj")
    base = {f"l.{m}.weight": torch.full((2, 2), float(i)) for i, m in enumerate(modules)}
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    held = HeldWeights(base, packed)
    job_a = {"l.q_proj.weight": torch.ones(2, 2) * 10, "l.v_proj.weight": torch.ones(2, 2) * 12}
    plan = held.plan(job_a)
    # q and v change; k rides along at its base value so the fused qkv reloads whole
    assert sorted(plan) == ["l.k_proj.weight", "l.q_proj.weight", "l.v_proj.weight"]
    assert torch.equal(plan["l.k_proj.weight"], base["l.k_proj.weight"])
    held.commit(job_a)
    job_b = {"l.o_proj.weight": torch.ones(2, 2) * 13}
    plan = held.plan(job_b)
    # switching jobs puts job A's targets back to base
    assert sorted(plan) == ["l.k_proj.weight", "l.o_proj.weight", "l.q_proj.weight", "l.v_proj.weight"]
    assert torch.equal(plan["l.q_proj.weight"], base["l.q_proj.weight"])
    held.commit(job_b)
    assert sorted(held.plan({})) == ["l.o_proj.weight"]


def test_an_early_lora_update_survives_the_merge_into_a_bfloat16_checkpoint():
    """A bfloat16 checkpoint (W0) and an early adapter (|B| ~ 1e-4): the merged delta is
    W0 + scale B A computed in float32 and rounded once, by the engine that loads it.
    Cast back to W0's bfloat16, as the merge did, the delta was mostly lost (relative
    error 0.86, the same a bfloat16 engine keeps: its one rounding is that one); a
    float32 engine now receives it with float32's error."""
    torch.manual_seed(0)
    n, r, scale = 576, 8, 2.0
    w0 = (torch.randn(n, n) * 0.02).to(torch.bfloat16)
    a = (torch.rand(r, n) * 2 - 1) / n ** 0.5  # peft's kaiming-uniform lora_A
    b = torch.randn(n, r) * 1e-4
    exact = scale * (b.double() @ a.double())

    def delta_error(merged: torch.Tensor) -> float:
        d = merged.double() - w0.double()
        return float((d - exact).norm() / exact.norm())

    merged = merge_lora({"w": w0}, {"w": (a, b)}, scale)["w"]
    assert merged.dtype == torch.float32 and delta_error(merged) < 1e-3  # ~4e-5
    # a bfloat16 engine: one rounding of the float32 sum, the representation's own limit
    once = (w0.double() + exact).to(torch.bfloat16)
    assert torch.equal(merged.to(torch.bfloat16), once)
    assert torch.equal(merge_lora({"w": w0}, {"w": (a, b)}, scale, dtype=torch.bfloat16)["w"], once)
    assert delta_error(once) > 0.5
