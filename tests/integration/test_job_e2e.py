"""The whole job path: every service as its own process on a real nats-server, a tiny
random-init model, a job submitted through the SDK, finished in a few steps, and its
episodes in the Parquet log."""


import pytest

from opentinker.schemas import JobState, WeightsPublished, decode
from opentinker.schemas import subjects as S
from opentinker.sdk import Client

from conftest import follow, log_rows, submit_when_ready


def _spec(model: str, env: str, engine: str, **kw) -> dict:
    turns = kw.pop("max_turns", 1)
    return {
        "name": f"e2e-{env}", "model": model, "env": env, "engine": engine, "lora_rank": 4,
        "prompts_per_step": 2, "group_size": 2, "steps": 2, "lr": 1e-3, "checkpoint_every": 1,
        "sampling": {"temperature": 1.0, "max_new_tokens": 8, "max_total_tokens": 512,
                     "max_turns": turns},
        **kw,
    }


async def _run_job(services, nats_url, tmp_path, spec, job_id, timeout_s=420):
    data_dir = tmp_path / "log"
    for name in ("scheduler", "envhost", "learner"):
        services.start(name)
    services.start("rollout", f"engine={spec['engine']}")
    services.start("recorder", f"data_dir={data_dir}", "recorder_flush_s=0.5")
    client = await Client.connect(nats_url)
    try:
        job = await submit_when_ready(client, spec, job_id)
        steps = [m.step for m in await follow(job, timeout_s, services)]
        rec = await job.wait(timeout_s=30, raise_on_failure=False)
        assert rec.state == JobState.COMPLETED, (rec, services.logs())
        return rec, steps, data_dir, client
    except BaseException:
        await client.close()
        raise


@pytest.mark.parametrize("engine", ["hf", "vllm"])
async def test_grpo_job_end_to_end(services, nats_url, tmp_path, tiny_model, job_id, engine, bus):
    spec = _spec(tiny_model, "arith", engine)
    rec, steps, data_dir, client = await _run_job(services, nats_url, tmp_path, spec, job_id)
    try:
        assert steps == [0, 1]
        # two new policy versions were published, with their bytes in the object store
        sub = await bus.js.subscribe(S.job(job_id, "weights"), ordered_consumer=True)
        versions = []
        for _ in range(2):
            w = decode((await sub.next_msg(timeout=5)).data, WeightsPublished)
            versions.append(w.policy_version)
        await sub.unsubscribe()
        assert versions == [1, 2]
        n = spec["steps"] * spec["prompts_per_step"] * spec["group_size"]
        rows = await log_rows(data_dir, f"SELECT count(DISTINCT episode_id) FROM trajectories WHERE job_id='{job_id}'", n)
        assert rows[0][0] == n
        rows = await log_rows(data_dir, f"SELECT count(*) FROM metrics WHERE job_id='{job_id}'", 1)
        assert rows[0][0] >= 1
    finally:
        await client.close()


async def test_multi_turn_episode_masks(services, nats_url, tmp_path, tiny_model, job_id):
    """Through the real services, a multi-turn episode's loss mask covers exactly the
    generated tokens of every turn and none of the observation tokens."""
    spec = _spec(tiny_model, "guess-number", "hf", max_turns=3, env_args={"n": 1000, "max_turns": 3})
    rec, steps, data_dir, client = await _run_job(services, nats_url, tmp_path, spec, job_id)
    await client.close()
    from opentinker.services.core.logdb import run_query

    n = spec["steps"] * spec["prompts_per_step"] * spec["group_size"]
    await log_rows(data_dir, f"SELECT count(DISTINCT episode_id) FROM trajectories WHERE job_id='{job_id}'", n)
    _, rows = run_query(f"SELECT token_ids, loss_mask, logprobs, turns, prompt_len FROM trajectories "
                        f"WHERE job_id='{job_id}' AND num_turns > 1", str(data_dir))
    assert rows, "expected multi-turn episodes"
    for token_ids, mask, logprobs, turns, prompt_len in rows:
        assert len(token_ids) == len(mask) == len(logprobs)
        assert not any(mask[:prompt_len])
        expect = [0] * len(token_ids)
        for t in turns:
            for i in range(t["gen_start"], t["gen_end"]):
                expect[i] = 1
            # the observation after a turn is masked out
            assert not any(mask[t["gen_end"]:t["obs_end"]])
        assert list(mask) == expect
        assert all(lp < 0 or m == 0 for lp, m in zip(logprobs, mask) if m)
        assert len(turns) > 1 and all(t["obs_end"] > t["gen_end"] for t in turns[:-1])
