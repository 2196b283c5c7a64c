"""The whole job path: every service as its own process on a real nats-server, a tiny
random-init model, a job submitted through the SDK, finished in a few steps, and its
episodes in the Parquet log."""

import asyncio
import json
import re
import struct
import tempfile
import zlib
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path

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


async def _run_job(services, nats_url, tmp_path, spec, job_id, timeout_s=420, wandb_dir=None):
    data_dir = tmp_path / "log"
    for name in ("scheduler", "envhost", "learner"):
        services.start(name)
    services.start("rollout", f"engine={spec['engine']}")
    services.start("recorder", f"data_dir={data_dir}", "recorder_flush_s=0.5")
    client = await Client.connect(nats_url)
    try:
        job = await submit_when_ready(client, spec, job_id)
        bridge = None
        if wandb_dir is not None:  # the wandb bridge follows the job beside the test
            from opentinker.sdk.wandb_bridge import WandbBridge

            bridge = asyncio.ensure_future(WandbBridge(client, job.id, dir=wandb_dir, mode="offline").follow())
        steps = [m.step for m in await follow(job, timeout_s, services)]
        rec = await job.wait(timeout_s=30, raise_on_failure=False)
        assert rec.state == JobState.COMPLETED, (rec, services.logs())
        # no service, nor what it started (the learner's process group, the rollout's
        # engine), listens beyond loopback: torch's TCP store would, on every interface
        assert services.open_listeners() == []
        if bridge is not None:
            assert (await asyncio.wait_for(bridge, 60)).state == JobState.COMPLETED
        return rec, steps, data_dir, client
    except BaseException:
        await client.close()
        raise


def wandb_history(wandb_dir, run_id: str) -> tuple[list[dict], bool]:
    """The history rows of the offline wandb run `run_id` under `wandb_dir`, read back
    from its run file, and whether the run's exit record is in it. The file is W&B's
    record log (the LevelDB log format: a 7-byte file header, 32 KiB blocks of chunks,
    each with a 7-byte header of crc32 (IEEE, over the type byte and the payload),
    length and type) of protobuf Records. wandb's service may still be writing it after
    `run.finish()` returns: reading stops at the first chunk that is cut short or fails
    its checksum, as the LevelDB reader does at the tail of a live log."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = wandb_dir.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")
    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7])[:2] == (b":W&B", 0xBEE1)
    rows, exited, pos, buf, block = [], False, 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block  # a block's tail too short for a header is padding
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        payload = data[pos + 7:pos + 7 + length]
        if len(payload) < length or zlib.crc32(bytes([kind]) + payload) != crc:
            break  # the tail being written
        buf += payload
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            kind_of = rec.WhichOneof("record_type")
            exited = exited or kind_of == "exit"
            if kind_of == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    return rows, exited


def engine_times(log_dir) -> tuple[datetime, datetime]:
    """(when the rollout worker began building its engine, when the learner's engine was
    ready), from the services' logs."""
    def stamp(line: str) -> datetime:
        return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")

    (rollout,) = [m for f in log_dir.glob("rollout-*.log")
                  for m in re.finditer(r"^(\S+ \S+) rollout INFO .* engine for .* ready in ([0-9.]+) s",
                                       f.read_text(), re.M)]
    (learner,) = [line for f in log_dir.glob("learner-*.log") for line in f.read_text().splitlines()
                  if " INFO opentinker.learner.engine: engine ready" in line]
    return stamp(rollout.group(1)) - timedelta(seconds=float(rollout.group(2))), stamp(learner)


@pytest.mark.parametrize("engine", ["hf", "vllm"])
async def test_grpo_job_end_to_end(services, nats_url, tmp_path, tiny_model, job_id, engine, bus):
    spec = _spec(tiny_model, "arith", engine)
    # `opentinker tail` on the running job (with the hf engine): decoded messages as JSON
    tail = subprocess.Popen([sys.executable, "-m", "opentinker.cli", "--nats-url", nats_url, "tail",
                             f"ot.job.{job_id}.>", "--short"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True) if engine == "hf" else None
    wandb_dir = tmp_path / "wb" if engine == "hf" else None
    rec, steps, data_dir, client = await _run_job(services, nats_url, tmp_path, spec, job_id, wandb_dir=wandb_dir)
    if wandb_dir is not None:
        # the offline run, named after the job, holds every step's learner metrics
        for _ in range(120):  # wandb's service closes the file after finish() returns
            history, exited = wandb_history(wandb_dir, job_id)
            if exited:
                break
            await asyncio.sleep(0.5)
        assert exited, f"the wandb run of {job_id} has no exit record after 60 s"
        train = {int(h["_step"]): h for h in history if "train/reward_mean" in h}
        assert sorted(train) == [0, 1]
        assert all({"train/loss", "train/policy_lag_mean", "train/tokens_per_s"} <= h.keys()
                   for h in train.values())
        # per-token statistics only for a step that forwarded a token (not 0 for one that did
        # not); no KL to the reference at kl_coef 0 (nothing computes it)
        assert all(("train/entropy" in h) == (h["train/skipped_frac"] < 1) for h in train.values()), train
        assert not any("train/kl" in h for h in train.values()), train
        assert all("rollout/env_ms_per_turn" in h and "rollout/gen_tokens_per_s" in h for h in train.values())
    if tail is not None:
        # `opentinker watch` on the finished job: the whole run, then its end
        out = subprocess.run([sys.executable, "-m", "opentinker.cli", "--nats-url", nats_url, "watch", job_id],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and f"{job_id} completed" in out.stdout and "2/2" in out.stdout, out.stdout
        tail.terminate()
        lines = [json.loads(line) for line in tail.communicate(timeout=30)[0].splitlines()]
        schemas = {r["schema"] for r in lines}
        assert {"Trajectory", "Metrics", "JobStateChanged", "WeightsPublished"} <= schemas, schemas
        metrics = [r["data"] for r in lines if r["schema"] == "Metrics" and r["data"]["split"] == "train"]
        assert sorted(m["step"] for m in metrics) == [0, 1] and "reward_mean" in metrics[0]["values"]
        traj = next(r for r in lines if r["schema"] == "Trajectory")
        assert traj["subject"] == f"ot.job.{job_id}.traj" and traj["data"]["job_id"] == job_id
        ids = traj["data"]["token_ids"]  # --short: 8 ids, then how many more
        assert len(ids) == 9 and all(isinstance(t, int) for t in ids[:8]) and ids[8].startswith("... ")
    try:
        assert steps == [0, 1]
        # the job asked for its first steps before its learner's engine was built: the
        # rollout worker built its own engine meanwhile, not after
        rollout_began, learner_ready = engine_times(tmp_path)
        assert rollout_began < learner_ready, (rollout_began, learner_ready)
        # two new policy versions were published, with their bytes in the object store
        sub = await bus.js.subscribe(S.job(job_id, "weights"), ordered_consumer=True)
        versions = []
        for _ in range(2):
            w = decode((await sub.next_msg(timeout=5)).data, WeightsPublished)
            versions.append(w.policy_version)
        await sub.unsubscribe()
        assert versions == [1, 2]
        n = spec["steps"] * spec["prompts_per_step"] * spec["group_size"]
        rows = await log_rows(data_dir,
                              f"SELECT count(DISTINCT episode_id) FROM trajectories WHERE job_id='{job_id}'", n)
        assert rows[0][0] == n
        rows = await log_rows(data_dir, f"SELECT count(*) FROM metrics WHERE job_id='{job_id}'", 1)
        assert rows[0][0] >= 1
        if engine == "vllm":
            # vLLM's run-time files (its rendezvous file, IPC sockets) are in the rollout
            # process's own temporary folder, which goes when the service stops
            # (core/tmpdir.py), not left in /tmp
            (pid,) = [p.pid for name, p in services.procs if name == "rollout"]
            (scratch,) = Path(tempfile.gettempdir()).glob(f"ot-rollout-{pid}-*")
            assert any(f.name.startswith("vllm_dist_") for f in scratch.iterdir()), list(scratch.iterdir())
            services.stop_all()
            assert not scratch.exists()
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
