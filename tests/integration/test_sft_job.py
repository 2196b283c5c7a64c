"""SFT jobs through the real services (scheduler and learner as processes on a real
nats-server), submitted with the SDK: from a JSONL dataset, and replayed from a
DuckDB-filtered slice of the trajectory log. A bad sft_query fails only its job."""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import time

import pytest

from opentinker.schemas import JobState, Trajectory, TurnRecord, WeightsPublished, decode
from opentinker.schemas import subjects as S
from opentinker.schemas.job import spec_from_dict
from opentinker.sdk import Client
from opentinker.services.learner import checkpoint
from opentinker.services.learner.sft import load_examples, step_indices

from conftest import submit_when_ready

TIMEOUT_S = 300
STEPS = 4


def _spec(model: str, **kw) -> dict:
    return {"name": "sft", "algorithm": "sft", "model": model, "steps": STEPS, "sft_batch_size": 4,
            "micro_batch_size": 2, "checkpoint_every": 2, "lr": 1e-2, "seed": 3, **kw}


async def _start(services, nats_url, data_dir) -> Client:
    services.start("scheduler")
    services.start("learner", f"data_dir={data_dir}")
    return await Client.connect(nats_url)


async def _run(client, services, spec, job_id):
    """Submit, collect every metric until the job ends; (record, metrics)."""
    job = await submit_when_ready(client, spec, job_id)

    async def collect():
        return [m async for m in job.metrics()]

    try:
        metrics = await asyncio.wait_for(collect(), TIMEOUT_S)
    except TimeoutError:
        pytest.fail(f"job did not finish in {TIMEOUT_S}s\n{services.logs()}")
    rec = await job.wait(timeout_s=30, raise_on_failure=False)
    return rec, metrics


def _expected_tokens(spec: dict, tiny_model: str, home, log_dir) -> list[float]:
    """The loss tokens each step must train on, from the data and the seeded order."""
    from transformers import AutoTokenizer

    s = spec_from_dict(spec)
    exs = load_examples(s, home, AutoTokenizer.from_pretrained(tiny_model), log_dir=log_dir)
    return [float(sum(sum(exs[i].loss_mask[1:]) for i in step_indices(len(exs), s.sft_batch_size, k, s.seed)))
            for k in range(s.steps)]


async def _check_trained(bus, home, job_id, rec, metrics, services, final_file):
    assert rec.state == JobState.COMPLETED, (rec, services.logs())
    assert [m.step for m in metrics] == list(range(STEPS))
    assert all(m.values["loss"] > 0 and m.values["examples"] == 4 and m.values["tokens"] > 0 for m in metrics)
    assert [m.policy_version for m in metrics] == list(range(1, STEPS + 1))
    # the loss on the whole SFT slice went down
    before, after = metrics[0].values["loss_full_before"], metrics[-1].values["loss_full_after"]
    assert after < before - 0.1, (before, after)
    assert metrics[-1].values["loss"] < metrics[0].values["loss"]
    # a new policy after every step, its bytes in the object store
    sub = await bus.js.subscribe(S.job(job_id, "weights"), ordered_consumer=True)
    events = [decode((await sub.next_msg(timeout=5)).data, WeightsPublished) for _ in range(STEPS)]
    await sub.unsubscribe()
    assert [w.policy_version for w in events] == list(range(1, STEPS + 1))
    data = await bus.get_object(S.OBJ_WEIGHTS, f"{job_id}/v{STEPS}")
    assert hashlib.sha256(data).hexdigest() == events[-1].sha256
    assert (checkpoint.job_dir(home, job_id) / "final" / final_file).is_file()


async def test_bad_query_fails_its_job_then_a_dataset_job_trains(services, nats_url, tmp_path, tiny_model,
                                                                 home, job_id, bus):
    client = await _start(services, nats_url, tmp_path / "log")
    try:
        rec, metrics = await _run(client, services, _spec(tiny_model, sft_query="SELECT * FROM nowhere"),
                                  f"{job_id}-bad")
        assert rec.state == JobState.FAILED and "sft_query" in rec.reason and "nowhere" in rec.reason, rec
        assert metrics == []
        assert all(p.poll() is None for _, p in services.procs), services.logs()

        # the same learner takes the next job: LoRA SFT on a chat dataset
        rows = [{"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                              {"role": "assistant", "content": f"The answer is {a + b}." + " Yes." * a}]}
                for a, b in [(1, 2), (3, 4), (5, 1), (2, 2), (6, 3), (4, 1), (7, 2), (3, 3)]]
        data = tmp_path / "chats.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        spec = _spec(tiny_model, sft_data=str(data), lora_rank=8)
        rec, metrics = await _run(client, services, spec, job_id)
        await _check_trained(bus, home, job_id, rec, metrics, services, "adapter_config.json")
        assert max(m.values["epoch"] for m in metrics) == STEPS * 4 / len(rows)
        # each step trained on the assistant tokens of the examples the seeded order picks
        assert [m.values["tokens"] for m in metrics] == _expected_tokens(spec, tiny_model, home, None)
    finally:
        await client.close()


def _episode(tok, source: str, k: int, reward: float) -> Trajectory:
    text = tok.apply_chat_template([{"role": "user", "content": f"Say the number {k}."}], tokenize=False,
                                   add_generation_prompt=True)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    answer = tok(f"{k}{k}{k}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    n = len(prompt)
    return Trajectory(
        job_id=source, request_id=f"{source}-s0-g{k}", episode_id=f"{source}-e{k}", step=0, group_index=k,
        group_size=2, token_ids=prompt + answer, loss_mask=[0] * n + [1] * len(answer),
        logprobs=[0.0] * n + [-1.0] * len(answer), prompt_len=n,
        turns=[TurnRecord(gen_start=n, gen_end=n + len(answer), obs_end=n + len(answer), reward=reward)],
        reward=reward, policy_version=0, env="arith", created_s=time.time())


async def test_sft_from_a_filtered_slice_of_the_log(services, nats_url, tmp_path, tiny_model, home, job_id, bus):
    """Replay: the episodes of an earlier job with reward 1, as the recorder logged them."""
    from opentinker.services.recorder.store import trajectory_rows, write_part
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    log_dir = tmp_path / "log"
    source = f"{job_id}-src"
    episodes = [_episode(tok, source, k, reward=float(k % 2)) for k in range(8)]
    write_part(log_dir, "trajectories", source,
               [row for seq, t in enumerate(episodes, 1) for row in trajectory_rows(t, seq)])
    winners = [t for t in episodes if t.reward == 1]

    client = await _start(services, nats_url, log_dir)
    try:
        sql = f"SELECT * FROM trajectories WHERE job_id = '{source}' AND reward = 1"
        # full fine-tuning (every parameter; large checkpoints go to files)
        rec, metrics = await _run(client, services, _spec(tiny_model, sft_query=sql, lora_rank=0, lr=3e-3), job_id)
        await _check_trained(bus, home, job_id, rec, metrics, services, "config.json")
        # every step trained on exactly the 4 rewarded episodes' policy tokens
        assert all(m.values["tokens"] == sum(sum(t.loss_mask) for t in winners) for m in metrics)
        # its weights serve through inference, on the env it names
        services.start("envhost")
        services.start("rollout", "engine=hf")
        res = await client.infer(env="arith", job=job_id, episodes=2, timeout_s=180,
                                 out_dir=tmp_path / "infer")
        assert res.summary["episodes"] == 2 and res.summary["policy_version"] == 1
        assert all(t.turns[0].policy_version == 1 for t in res.trajectories), services.logs()
        assert (tmp_path / "infer" / "summary.json").exists()
    finally:
        await client.close()


async def test_a_restarted_learner_resumes_the_sft_job_in_the_same_order(services, nats_url, tmp_path,
                                                                           tiny_model, home, job_id, bus):
    steps = 40
    rows = [{"prompt": f"Count to {k}.", "completion": " ".join(str(i) for i in range(1, k + 2))}
            for k in range(10)]
    data = tmp_path / "count.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = _spec(tiny_model, sft_data=str(data), lora_rank=8, steps=steps, checkpoint_every=5)
    client = await _start(services, nats_url, tmp_path / "log")
    try:
        job = await submit_when_ready(client, spec, job_id)
        first = services.procs[-1][1]

        async def collect():
            metrics, restarted = [], False
            async for m in job.metrics():
                metrics.append(m)
                if not restarted and m.step >= 6:  # past the checkpoint of step 4
                    first.send_signal(signal.SIGTERM)
                    await asyncio.to_thread(first.wait, 30)
                    services.start("learner", f"data_dir={tmp_path / 'log'}")
                    restarted = True
            return metrics

        try:
            metrics = await asyncio.wait_for(collect(), TIMEOUT_S)
        except TimeoutError:
            pytest.fail(f"job did not finish in {TIMEOUT_S}s\n{services.logs()}")
        rec = await job.wait(timeout_s=30, raise_on_failure=False)
    finally:
        await client.close()
    assert rec.state == JobState.COMPLETED, (rec, services.logs())
    learner_logs = "".join(f.read_text() for f in services.log_dir.glob("learner-*.log"))
    assert "resumed from step" in learner_logs, services.logs()
    by_step = {m.step: m for m in metrics}
    assert sorted(by_step) == list(range(steps))
    # the resumed learner went on with the same seeded order of examples
    assert [by_step[k].values["tokens"] for k in range(steps)] == _expected_tokens(spec, tiny_model, home, None)
    sub = await bus.js.subscribe(S.job(job_id, "weights"), ordered_consumer=True)
    last = None
    while True:
        try:
            last = decode((await sub.next_msg(timeout=2)).data, WeightsPublished)
        except TimeoutError:
            break
    await sub.unsubscribe()
    assert last is not None and last.policy_version == steps
    assert (checkpoint.job_dir(home, job_id) / "final" / "adapter_config.json").is_file()


async def test_an_sft_then_grpo_pipeline_starts_rl_from_the_sft_policy(services, nats_url, tmp_path, tiny_model,
                                                                       bus):
    """`opentinker train sft.toml grpo.toml` (upstream OpenTinker #18): the GRPO stage is
    submitted once the SFT stage completed, with `init_from` the SFT job, and samples its
    first steps with the SFT job's policy: its version-0 weights are the SFT job's last."""
    import subprocess
    import sys
    from pathlib import Path

    from opentinker.schemas import JobRecord

    fixtures = Path(__file__).resolve().parents[1] / "fixtures"
    services.start("scheduler")
    services.start("learner")
    services.start("envhost", args=["--env", f"{fixtures / 'user_env.py'}:LengthGame"])
    services.start("rollout", "engine=hf")
    rows = [{"messages": [{"role": "user", "content": f"Say {k} words."}, {"role": "assistant", "content": "yes " * k}]}
            for k in range(1, 9)]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lora = f'model = "{tiny_model}"\nlora_rank = 4\nseed = 3\n'
    (tmp_path / "sft.toml").write_text(f'name = "sft"\nalgorithm = "sft"\n{lora}steps = 2\nsft_batch_size = 4\n'
                                       f'micro_batch_size = 2\nlr = 1e-2\nsft_data = "{data}"\n')
    (tmp_path / "grpo.toml").write_text(f'name = "rl"\nenv = "user-length"\nengine = "hf"\n{lora}steps = 2\n'
                                        'prompts_per_step = 2\ngroup_size = 3\nlr = 1e-3\n'
                                        '[sampling]\nmax_new_tokens = 8\nmax_total_tokens = 256\n')
    cli = [sys.executable, "-m", "opentinker.cli", "--nats-url", nats_url, "train",
           str(tmp_path / "sft.toml"), str(tmp_path / "grpo.toml")]
    got = await asyncio.to_thread(subprocess.run, cli, capture_output=True, text=True, timeout=TIMEOUT_S)
    out = got.stdout + got.stderr
    assert got.returncode == 0, out + services.logs()
    ids = [line.split()[1] for line in out.splitlines() if line.startswith("job ") and " submitted to " in line]
    sft_id, rl_id = ids
    assert "stage 1/2" in out and f"stage 2/2: {tmp_path / 'grpo.toml'} (from job {sft_id})" in out, out
    assert f"job {sft_id} completed at step 2" in out and f"job {rl_id} completed at step 2" in out, out
    assert "loss" in out and "reward" in out  # both stages' steps printed
    rec, _ = await bus.job_record(rl_id)
    assert isinstance(rec, JobRecord) and rec.spec.init_from == sft_id
    sft_events = await bus.read_subject(S.job(sft_id, "weights"), WeightsPublished)
    rl_events = await bus.read_subject(S.job(rl_id, "weights"), WeightsPublished)
    assert [w.policy_version for w in sft_events] == [1, 2]
    assert rl_events[0].policy_version == 0 and rl_events[0].sha256 == sft_events[-1].sha256
    assert [w.policy_version for w in rl_events] == [0, 1, 2]
    # one history for the pipeline: the SFT stage's steps, then the RL stage's
    from opentinker.sdk import Client

    client = await Client.connect(nats_url)
    try:
        assert await client.job(rl_id).stages() == [sft_id, rl_id]
        steps = [(m.job_id, m.step) for m in await client.job(rl_id).pipeline_metrics() if m.split == "train"]
    finally:
        await client.close()
    assert steps == [(sft_id, 0), (sft_id, 1), (rl_id, 0), (rl_id, 1)], steps
