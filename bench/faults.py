"""Fault injection: one training job while the learner, rollout, envhost, recorder,
scheduler and nats-server are SIGKILLed in turn (each restarted as a supervisor would),
then an audit of the trajectory log in DuckDB, beside the same job undisturbed.

    .venv/bin/python bench/faults.py [--config examples/arith_grpo.toml] [--steps N]
                                     [--out bench/results/faults.json] [--no-baseline]

Each run gets a fresh stack (`opentinker up`'s Stack: an authenticating nats-server and
every service as its own process) in its own home under bench/results/tmp/. A kill lands
when the job has reported the step in `--kill-at` (spread over the run by default),
always between checkpoints. The audit (one row per claim, written to the results file):

- the job completed;
- every step has one train metrics record in the log's `metrics` view (the stream may
  hold two for a step a lost learner run had already reported);
- every trajectory the stream holds for the job is in the log (`trajectories` view):
  lost = on the stream - in the log, which must be 0;
- each step was trained on exactly prompts_per_step x group_size episodes (the log's
  `steps` view names the groups each step trained on), and no episode was trained in
  two steps (trained twice = 0);
- wall time against the undisturbed run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sys
import threading
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAIN_HOME = Path(os.environ.get("OPENTINKER_HOME", ROOT / ".opentinker"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
ORDER = ("learner", "rollout", "envhost", "recorder", "scheduler", "nats-server")


def fresh_home(name: str) -> Path:
    """A new home whose model and compiled-op caches are the main home's (no second
    conversion or DeepSpeed build)."""
    home = ROOT / "bench" / "results" / "tmp" / name
    if home.exists():
        shutil.rmtree(home)
    (home / "cache").mkdir(parents=True)
    for shared in ("models", "wheels", "gguf"):
        if (MAIN_HOME / shared).exists():
            (home / shared).symlink_to(MAIN_HOME / shared)
    for cache in ("torch_extensions", "hf", "inductor", "vllm", "triton", "xdg"):
        (MAIN_HOME / "cache" / cache).mkdir(parents=True, exist_ok=True)
        (home / "cache" / cache).symlink_to(MAIN_HOME / "cache" / cache)
    return home


class Supervisor:
    """Restart any service of `stack` that exits (what `opentinker up` does), and kill
    one on request; nats-server is killed and restarted on the same port and store."""

    def __init__(self, stack):
        self.stack = stack
        self.kills: list[dict] = []
        self.restarts = 0
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def start(self) -> Supervisor:
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            if self._paused.is_set():
                continue
            for name, p in list(self.stack.procs.items()):
                if p.poll() is not None:
                    time.sleep(1.0)
                    self.stack.spawn(name)
                    self.restarts += 1

    def kill(self, name: str, at_step: int) -> None:
        t = time.time()
        if name == "nats-server":
            self._paused.set()
            proc = self.stack.server.proc
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            time.sleep(3.0)  # an outage, not just a blip
            self.stack.server.start()
            self._paused.clear()
        else:
            p = self.stack.procs[name]
            p.send_signal(signal.SIGKILL)
            p.wait()
        self.kills.append({"service": name, "after_step": at_step, "time_s": round(t, 3)})

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


async def run_job(home: Path, spec: dict, kill_at: dict[int, str] | None) -> dict:
    """Start a stack in `home`, run the job (killing services at `kill_at` steps), audit
    the log; returns the numbers."""
    os.environ["OPENTINKER_HOME"] = str(home)
    from opentinker.schemas import JobState, Metrics
    from opentinker.schemas import subjects as S
    from opentinker.sdk import Client
    from opentinker.ops.stack import Stack

    stack = Stack(home, overrides={"recorder": ["recorder_flush_s=1.0"]}).start()
    sup = Supervisor(stack).start()
    client = None
    try:
        client = await Client.connect(stack.nats_url)
        for _ in range(100):
            try:
                job = await client.submit(spec)
                break
            except Exception:  # the scheduler is still starting
                await asyncio.sleep(0.5)
        t0 = time.monotonic()
        pending = dict(kill_at or {})
        done_steps: set[int] = set()
        async for m in job.metrics():
            if m.split != "train":
                continue
            done_steps.add(m.step)
            for step in sorted(s for s in pending if s <= m.step):
                name = pending.pop(step)
                print(f"step {m.step}: SIGKILL {name}", flush=True)
                await asyncio.to_thread(sup.kill, name, m.step)
        rec = await job.wait(timeout_s=3600, raise_on_failure=False)
        wall_s = time.monotonic() - t0
        stream_trajs = len(await client.bus.read_raw(S.job(job.id, "traj")))
        stream_metrics = [m for m in await client.bus.read_subject(S.job(job.id, "metrics"), Metrics)
                          if m.split == "train"]
        await asyncio.sleep(5)  # the recorder's last flush
    finally:
        sup.stop()
        if client is not None:
            await client.close()
        stack.stop()
    audit = audit_log(home / "data", job.id, spec)
    return {"job_id": job.id, "state": rec.state.value, "reason": rec.reason, "wall_s": round(wall_s, 1),
            "attempts": rec.attempt, "kills": sup.kills, "restarts": sup.restarts,
            "trajectories_on_stream": stream_trajs,
            "metrics_on_stream_per_step_max": max((sum(x.step == s for x in stream_metrics)
                                                   for s in range(spec["steps"])), default=0),
            **audit, "completed": rec.state == JobState.COMPLETED}


def audit_log(data_dir: Path, job_id: str, spec: dict) -> dict:
    from opentinker.services.core.logdb import run_query

    def one(sql: str):
        return run_query(sql, data_dir)[1]

    per_group = spec["prompts_per_step"] * spec["group_size"]
    metric_steps = one(f"SELECT step, count(*) FROM metrics WHERE job_id = '{job_id}' AND split = 'train' "
                       "AND key = 'reward_mean' GROUP BY step ORDER BY step")
    in_log = one(f"SELECT count(DISTINCT episode_id) FROM trajectories WHERE job_id = '{job_id}'")[0][0]
    trained = one(
        "SELECT s.step, count(*), count(DISTINCT t.episode_id) FROM steps s JOIN trajectories t "
        f"ON t.job_id = s.job_id AND t.request_id = s.request_id WHERE s.job_id = '{job_id}' "
        "GROUP BY s.step ORDER BY s.step")
    twice = one(
        "SELECT count(*) FROM (SELECT t.episode_id FROM steps s JOIN trajectories t "
        f"ON t.job_id = s.job_id AND t.request_id = s.request_id WHERE s.job_id = '{job_id}' "
        "GROUP BY t.episode_id HAVING count(DISTINCT s.step) > 1)")[0][0]
    rewards = one(f"SELECT step, value FROM metrics WHERE job_id = '{job_id}' AND split = 'train' "
                  "AND key = 'reward_mean' ORDER BY step")
    return {
        "steps_with_metrics": len(metric_steps),
        "metrics_per_step_in_log_max": max((n for _, n in metric_steps), default=0),
        "trajectories_in_log": in_log,
        "steps_trained_on_exactly_p_x_g": sum(1 for _, n, d in trained if n == d == per_group),
        "steps_in_steps_table": len(trained),
        "episodes_trained_twice": twice,
        "reward_per_step": [round(v, 4) for _, v in rewards],
    }


def load_spec(config: str, steps: int | None) -> dict:
    with open(config, "rb") as f:
        data = tomllib.load(f)
    spec = data.get("job", data)
    if steps:
        spec["steps"] = steps
    return spec


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "examples" / "arith_grpo.toml"))
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--kill-at", default="", help="comma-separated steps, one per service in the order "
                                                  + ", ".join(ORDER) + " (default: spread over the run)")
    p.add_argument("--no-baseline", action="store_true", help="skip the undisturbed run")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "faults.json"))
    args = p.parse_args()
    spec = load_spec(args.config, args.steps or None)
    steps = spec["steps"]
    every = spec.get("checkpoint_every", 10)
    if args.kill_at:
        at = [int(x) for x in args.kill_at.split(",")]
    else:  # the learner two steps past its first checkpoint, the others spread after it
        first = min(steps - len(ORDER) - 1, every + 1)
        gap = max(1.0, (steps - 3 - first) / (len(ORDER) - 1))
        at = [first + round(i * gap) for i in range(len(ORDER))]
    if len(set(at)) != len(ORDER):
        p.error(f"--kill-at needs {len(ORDER)} distinct steps, got {at}")
    kill_at = dict(zip(at, ORDER))
    from provenance import provenance

    out: dict = {**provenance(), "config": os.path.relpath(args.config, ROOT), "spec": spec, "kill_at_step": kill_at}
    if not args.no_baseline:
        out["undisturbed"] = asyncio.run(run_job(fresh_home("faults-undisturbed"), spec, None))
        print(json.dumps({k: v for k, v in out["undisturbed"].items() if k != "reward_per_step"}), flush=True)
    out["faults"] = asyncio.run(run_job(fresh_home("faults-killed"), spec, kill_at))
    f = out["faults"]
    f["lost"] = f["trajectories_on_stream"] - f["trajectories_in_log"]
    if "undisturbed" in out:
        f["time_vs_undisturbed"] = round(f["wall_s"] / max(out["undisturbed"]["wall_s"], 1e-9), 2)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in f.items() if k != "reward_per_step"}, indent=2))
    ok = (f["completed"] and f["lost"] == 0 and f["episodes_trained_twice"] == 0
          and f["steps_trained_on_exactly_p_x_g"] == steps and f["metrics_per_step_in_log_max"] == 1
          and f["steps_with_metrics"] == steps)
    print("audit:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
