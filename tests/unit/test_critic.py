"""The critic on a tiny model (real DeepSpeed, CPU): its values are the value head's
outputs at the positions before policy tokens; its updates move the values toward the
returns; the policy and the critic train in one step and their state saves and loads
together; a resume without a critic's state is refused, a start from another job's
policy keeps a fresh critic."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from opentinker.schemas import JobSpec, Trajectory, TurnRecord
from opentinker.services.learner.step import plan_step


@pytest.fixture
def rank_env(monkeypatch):
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(key, os.environ.get(key, value))


def _traj(i: int, prompt: int, gen: int, reward: float) -> Trajectory:
    ids = [(7 * i + 3 * k) % 500 + 10 for k in range(prompt + gen)]
    return Trajectory(job_id="j", request_id="r", episode_id=f"e{i}", step=0, group_index=i, group_size=1,
                      token_ids=ids, loss_mask=[0] * prompt + [1] * gen, logprobs=[0.0] * prompt + [-2.0] * gen,
                      prompt_len=prompt, turns=[TurnRecord(gen_start=prompt, gen_end=prompt + gen,
                                                           obs_end=prompt + gen, reward=reward)],
                      reward=reward, policy_version=0)


SPEC = dict(advantage_estimator="gae", group_size=1, prompts_per_step=4, micro_batch_size=2, lr=1e-3,
            critic_lr=1e-3, value_clip=0.0)
TRAJS = [_traj(0, 5, 3, 1.0), _traj(1, 9, 4, 0.0), _traj(2, 3, 6, 1.0), _traj(3, 4, 2, 0.0)]


def _pair(tiny_model, **kw):
    from opentinker.services.learner.critic import ActorCritic, CriticEngine
    from opentinker.services.learner.engine_deepspeed import TrainEngine

    spec = JobSpec(**{**SPEC, **kw})
    return ActorCritic(TrainEngine(spec, tiny_model, device="cpu"), CriticEngine(spec, tiny_model, device="cpu"))


def test_values_are_the_heads_outputs_before_each_policy_token(tiny_model, rank_env):
    from opentinker.services.learner.batching import build_batch

    pair = _pair(tiny_model, lora_rank=4)
    try:
        b = build_batch(TRAJS[:3], [0.0] * 3, pair.pad_id)
        [v] = pair.values([b])
        assert v.shape == b.input_ids.shape and v.dtype == torch.float32
        assert torch.all(v == 0)  # the head starts at 0
        plan = plan_step(TRAJS, pair.spec, 0, pair.pad_id, values=pair.values)
        pair.train_step(plan.micro_batches, plan.updates, plan.totals, plan.lrs)
        [v] = pair.values([b])
        critic = pair.critic.module
        with torch.no_grad():
            full = critic(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[..., 0]
        keep = b.loss_mask > 0
        assert torch.allclose(v[keep], full[keep].float()) and torch.all(v[~keep] == 0)
        assert torch.all(v[keep] != 0)
        # LoRA on the policy's modules, the head in full: the head and the adapters train
        trainable = [n for n, p in critic.named_parameters() if p.requires_grad]
        assert any("score" in n for n in trainable) and any("lora_A" in n for n in trainable)
        assert not any("embed_tokens" in n for n in trainable)
    finally:
        pair.close()


def test_a_step_trains_both_and_the_values_approach_the_returns(tiny_model, rank_env, tmp_path):
    torch.manual_seed(0)  # the value head's random init
    pair = _pair(tiny_model, lora_rank=0)
    try:
        policy_before = [p.detach().clone() for p in pair.module.parameters()]
        errors = []
        for step in range(6):
            plan = plan_step(TRAJS, pair.spec, step, pair.pad_id, values=pair.values)
            out = pair.train_step(plan.micro_batches, plan.updates, plan.totals, plan.lrs)
            errors.append(out["value_error"])
            assert {"loss", "entropy", "value_loss", "value_mean", "return_mean", "critic_grad_norm"} <= set(out)
        assert out["critic_grad_norm"] > 0 and out["grad_norm"] > 0
        assert errors[-1] < 0.2 * errors[0], errors
        assert any(not torch.equal(a, b) for a, b in zip(policy_before, pair.module.parameters()))
        # the state holds both; loaded into a fresh pair, the values are the same
        plan = plan_step(TRAJS, pair.spec, 9, pair.pad_id, values=pair.values)
        values = pair.values(plan.micro_batches)
        pair.save_state(tmp_path / "state")
        assert (tmp_path / "state" / "critic" / "state").is_dir()
    finally:
        pair.close()
    again = _pair(tiny_model, lora_rank=0)
    try:
        fresh = again.values(plan.micro_batches)
        assert not all(torch.allclose(a, b) for a, b in zip(fresh, values))
        again.load_state(tmp_path / "state")
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(again.values(plan.micro_batches), values))
        # a policy's state without a critic's: a resume needs it, a start from it (no
        # optimizer, init_from) keeps this critic as it is
        shutil.rmtree(tmp_path / "state" / "critic")
        with pytest.raises(RuntimeError, match="no critic state under"):
            again.load_state(tmp_path / "state")
        again.load_state(tmp_path / "state", optimizer=False)
    finally:
        again.close()


def test_a_critic_warmup_step_trains_the_critic_and_leaves_the_policy(tiny_model, rank_env):
    from opentinker.services.learner.step import token_stats

    torch.manual_seed(0)
    pair = _pair(tiny_model, lora_rank=0, critic_warmup=2, steps=4)
    try:
        assert [plan_step(TRAJS, pair.spec, s, pair.pad_id, values=pair.values).critic_only
                for s in range(4)] == [True, True, False, False]
        policy_before = [p.detach().clone() for p in pair.module.parameters()]
        critic_before = [p.detach().clone() for p in pair.critic.module.parameters()]
        plan = plan_step(TRAJS, pair.spec, 0, pair.pad_id, values=pair.values)
        out = pair.train_critic(plan.micro_batches, plan.updates, plan.totals, plan.lrs)
        assert all(torch.equal(a, b) for a, b in zip(policy_before, pair.module.parameters()))
        assert any(not torch.equal(a, b) for a, b in zip(critic_before, pair.critic.module.parameters()))
        assert out["updates"] == 0 and out["loss"] == 0 and out["tokens"] == 0 and out["critic_grad_norm"] > 0
        # the metrics a warmup step reports: the critic's, none of the policy's per-token ones
        stats = token_stats(out)
        assert {"value_loss", "value_mean", "return_mean", "critic_grad_norm"} <= set(stats)
        assert not {"entropy", "kl", "approx_kl", "clip_frac"} & set(stats)
        plan = plan_step(TRAJS, pair.spec, 2, pair.pad_id, values=pair.values)
        out = pair.train_step(plan.micro_batches, plan.updates, plan.totals, plan.lrs)
        assert any(not torch.equal(a, b) for a, b in zip(policy_before, pair.module.parameters()))
        assert {"entropy", "value_loss"} <= set(token_stats(out))
    finally:
        pair.close()


def test_a_vision_language_critic_is_refused(tiny_vlm, rank_env):
    from opentinker.services.learner.critic import CriticEngine

    with pytest.raises(ValueError, match="'gae' needs a value head on a text model"):
        CriticEngine(JobSpec(**SPEC, model="tiny-vlm"), tiny_vlm, device="cpu")
