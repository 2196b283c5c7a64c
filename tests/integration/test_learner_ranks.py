"""The learner's engine data parallel on CPU: 2 ranks (torchrun, gloo), each training
on its shard of the micro-batches, give the loss, gradient norm and weights of 1 rank on
the same batch: ZeRO off, at stage 2 (optimizer state and gradients partitioned) and at
stage 3 (parameters too). A checkpoint written by 2 ranks resumes on 1, and one by 1
on 2, as if training had not stopped."""

import pytest
import torch

from conftest import run_ranks


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, tiny_model):
    return run_ranks(1, tiny_model, tmp_path_factory.mktemp("one-rank"), 0)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_two_ranks_train_as_one_on_the_same_batch(tmp_path, tiny_model, one_rank, zero_stage):
    one, w1 = one_rank
    two, w2 = run_ranks(2, tiny_model, tmp_path / "two", zero_stage)
    assert one["world_size"] == 1 and two["world_size"] == 2
    assert one["micro_batches"] == [5] and two["micro_batches"] == [3]  # rank 0's share; rank 1's has a pad
    for s1, s2 in zip(one["steps"], two["steps"]):
        assert s2["tokens"] == s1["tokens"] > 0
        for key in ("loss", "grad_norm", "entropy", "approx_kl"):
            assert s2[key] == pytest.approx(s1[key], rel=1e-4, abs=1e-6), (key, s1, s2)
    assert one["steps"][1]["loss"] != one["steps"][0]["loss"]  # the first step moved the policy
    assert w1.keys() == w2.keys() and w1
    for name in w1:
        assert torch.allclose(w1[name], w2[name], atol=1e-6, rtol=1e-4), name
    assert any(w.abs().sum() > 0 for n, w in w1.items() if "lora_B" in n)  # B left its zero init


@pytest.mark.timeout(900)
@pytest.mark.parametrize("zero_stage,saved_on,resumed_on", [(2, 2, 1), (3, 1, 2)])
def test_a_checkpoint_resumes_on_another_number_of_ranks(tmp_path, tiny_model, one_rank, zero_stage, saved_on,
                                                         resumed_on):
    """Step 1 on `saved_on` ranks, its checkpoint, step 2 on `resumed_on` ranks: the
    step and the weights of two uninterrupted steps on one rank (ZeRO 1-3 partitions are
    converted to a universal checkpoint first)."""
    one, w1 = one_rank
    ckpt = str(tmp_path / "checkpoint")
    run_ranks(saved_on, tiny_model, tmp_path / "save", zero_stage, "cpu", "save", ckpt)
    got, w = run_ranks(resumed_on, tiny_model, tmp_path / "resume", zero_stage, "cpu", "resume", ckpt)
    assert got["world_size"] == resumed_on and len(got["steps"]) == 1
    for key in ("loss", "grad_norm", "entropy", "approx_kl"):
        assert got["steps"][0][key] == pytest.approx(one["steps"][1][key], rel=1e-4, abs=1e-6), key
    assert w.keys() == w1.keys()
    for name in w1:
        assert torch.allclose(w1[name], w[name], atol=1e-6, rtol=1e-4), name
