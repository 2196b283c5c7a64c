"""The learner's engine data parallel on CPU: 2 ranks (torchrun, gloo), each training
on its shard of the micro-batches, give the loss, gradient norm and weights of 1 rank on
the same batch: ZeRO off, at stage 2 (optimizer state and gradients partitioned) and at
stage 3 (parameters too). A checkpoint written by 2 ranks resumes on 1, and one by 1
on 2, as if training had not stopped.

The reference is one rank at ZeRO 3 (with one rank, ZeRO partitions nothing: the same
numbers as stage 0). The runs that are compared also write the checkpoint between their
two steps, so each resume test starts no other save run."""

import pytest
import torch

from conftest import run_ranks


def _save(n: int, tiny_model, tmp_path_factory, zero_stage: int):
    """`n` ranks at `zero_stage`, two steps, the engine's state saved between them:
    (metrics, weights, checkpoint directory)."""
    out = tmp_path_factory.mktemp(f"ranks{n}-zero{zero_stage}")
    ckpt = str(out / "checkpoint")
    got, weights = run_ranks(n, tiny_model, out / "run", zero_stage, "cpu", "save", ckpt)
    return got, weights, ckpt


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, tiny_model):
    return _save(1, tiny_model, tmp_path_factory, 3)


@pytest.fixture(scope="module")
def two_ranks_zero2(tmp_path_factory, tiny_model):
    return _save(2, tiny_model, tmp_path_factory, 2)


def _same_steps_and_weights(one, w1, two, w2):
    for s1, s2 in zip(one["steps"], two["steps"], strict=True):
        assert s2["tokens"] == s1["tokens"] > 0
        for key in ("loss", "grad_norm", "entropy", "approx_kl"):
            assert s2[key] == pytest.approx(s1[key], rel=1e-4, abs=1e-6), (key, s1, s2)
    assert w1.keys() == w2.keys() and w1
    for name in w1:
        assert torch.allclose(w1[name], w2[name], atol=1e-6, rtol=1e-4), name


@pytest.mark.timeout(900)
@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_two_ranks_train_as_one_on_the_same_batch(request, tmp_path, tiny_model, one_rank, zero_stage):
    one, w1, _ = one_rank
    if zero_stage == 2:
        two, w2, _ = request.getfixturevalue("two_ranks_zero2")
    else:
        two, w2 = run_ranks(2, tiny_model, tmp_path / "two", zero_stage)
    assert one["world_size"] == 1 and two["world_size"] == 2
    assert one["micro_batches"] == [5] and two["micro_batches"] == [3]  # rank 0's share; rank 1's has a pad
    assert len(one["steps"]) == len(two["steps"]) == 2
    _same_steps_and_weights(one, w1, two, w2)
    assert one["steps"][1]["loss"] != one["steps"][0]["loss"]  # the first step moved the policy
    assert any(w.abs().sum() > 0 for n, w in w1.items() if "lora_B" in n)  # B left its zero init


@pytest.mark.timeout(900)
@pytest.mark.parametrize("saved_on,resumed_on", [(2, 1), (1, 2)])
def test_a_checkpoint_resumes_on_another_number_of_ranks(request, tmp_path, tiny_model, one_rank, saved_on,
                                                         resumed_on):
    """Step 1 on `saved_on` ranks, its checkpoint, step 2 on `resumed_on` ranks: the
    step and the weights of two uninterrupted steps on one rank (ZeRO 2-3 partitions are
    converted to a universal checkpoint first). 2 -> 1 at ZeRO 2, 1 -> 2 at ZeRO 3."""
    one, w1, _ = one_rank
    zero_stage, (_, _, ckpt) = (2, request.getfixturevalue("two_ranks_zero2")) if saved_on == 2 else (3, one_rank)
    got, w = run_ranks(resumed_on, tiny_model, tmp_path / "resume", zero_stage, "cpu", "resume", ckpt)
    assert got["world_size"] == resumed_on and len(got["steps"]) == 1
    _same_steps_and_weights({"steps": one["steps"][1:]}, w1, got, w)
