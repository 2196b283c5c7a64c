"""Scaling on this machine: the README's main job with 1 vs 2 learner ranks and 1 vs 2
rollout workers, one after the other on one stack, and where each one's step time goes.

    .venv/bin/python bench/scale_out.py [--steps 10] [--out bench/results/scale_out.json]
        [--set KEY=VALUE ...]

One stack (`opentinker up`'s Stack: nats-server and every service as its own process,
vLLM rollout, DeepSpeed learner) with two rollout workers and a learner offering 2 ranks
(`learner_max_ranks = 2`), in a fresh home under bench/results/tmp/. After a 1-step
warm-up job (not reported), the job of examples/arith_grpo.toml (steps from --steps, no
evaluation) runs as:

- base:        learner_ranks 1, rollout_workers 1
- ranks2:      learner_ranks 2, rollout_workers 1 (2 data-parallel ranks, gloo)
- rollout2:    learner_ranks 1, rollout_workers 2 (groups sent to both workers in turn)

Reported per run (from the learner's per-step metrics, the steps after the first):
steps/s, mean step time and its parts: waiting for rollouts (wait_time_s), training
(train_time_s; of it forward/backward fwd_bwd_s and optimizer optimizer_s), publishing
the weights (weights_s), the learner-rank start (the first step's extra time), and the
reward of the first and last steps. No targets, no stored numbers: a 2-core machine
runs every rank and worker on the same two cores, so the table shows what the
machinery costs here, not what more hardware buys.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_grpo import follow_job  # noqa: E402  submit a spec, collect its metrics
from faults import fresh_home  # noqa: E402  a scratch home sharing the main home's models and caches

CONFIG = ROOT / "examples" / "arith_grpo.toml"
OUT = ROOT / "bench" / "results" / "scale_out.json"
RUNS = {"base": (1, 1), "ranks2": (2, 1), "rollout2": (1, 2)}  # (learner_ranks, rollout_workers)
PARTS = ("wait_time_s", "train_time_s", "fwd_bwd_s", "optimizer_s", "weights_s")


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    ms = raw["train"]
    steady = ms[1:] or ms
    span = steady[-1].time_s - ms[0].time_s
    rewards = [m.values["reward_mean"] for m in ms]
    return {
        "job_id": raw["job_id"], "state": raw["state"], "steps": len(ms),
        "steps_per_s": len(steady) / span if span > 0 else None,
        "step_time_s": statistics.fmean(m.values["step_time_s"] for m in steady),
        "first_step_time_s": ms[0].values["step_time_s"],
        "startup_s": ms[0].time_s - raw["submit_time"] - ms[0].values["step_time_s"],
        **{p: statistics.fmean(m.values.get(p, 0.0) for m in steady) for p in PARTS},
        "learner_ranks": ms[-1].values.get("learner_ranks"),
        "rollout_workers_seen": None,
        "reward_first3": statistics.fmean(rewards[:3]), "reward_last3": statistics.fmean(rewards[-3:]),
    }


async def drive(url: str, specs: dict[str, dict], warmup: dict, timeout_s: float) -> dict[str, dict]:
    from opentinker.schemas import Trajectory
    from opentinker.schemas import subjects as S
    from opentinker.sdk import Client

    client = await Client.connect(url)
    out = {}
    try:
        await follow_job(client, warmup, "warm-up", timeout_s)
        for key, spec in specs.items():
            raw = await follow_job(client, spec, key, timeout_s)
            out[key] = summarize(raw)
            trajs = await client.bus.read_subject(S.job(raw["job_id"], "traj"), Trajectory, limit=100_000)
            out[key]["rollout_workers_seen"] = sorted({t.worker for t in trajs})
    finally:
        await client.close()
    return out


def table(runs: dict[str, dict]) -> str:
    head = (f"{'run':<9} {'ranks':>5} {'workers':>7} {'steps/s':>8} {'step s':>7} {'wait s':>7} "
            f"{'train s':>7} {'fwd/bwd':>7} {'optim':>6} {'weights':>7} {'start s':>7}")
    lines = [head]
    for k, r in runs.items():
        lines.append(f"{k:<9} {RUNS[k][0]:>5} {RUNS[k][1]:>7} {r['steps_per_s'] or 0:>8.4f} {r['step_time_s']:>7.2f} "
                     f"{r['wait_time_s']:>7.2f} {r['train_time_s']:>7.2f} {r['fwd_bwd_s']:>7.2f} "
                     f"{r['optimizer_s']:>6.2f} {r['weights_s']:>7.2f} {r['startup_s']:>7.1f}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(CONFIG))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--only", default=",".join(RUNS), help="runs, comma-separated: " + ", ".join(RUNS))
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OPENTINKER_HOME", str(ROOT / ".opentinker"))

    from opentinker.cli.common import load_job_config
    from opentinker.ops.stack import Stack

    base = load_job_config(args.config, args.set)
    base.update(steps=args.steps, eval_every=0, checkpoint_every=max(args.steps, 1))
    keys = [k.strip() for k in args.only.split(",") if k.strip()]
    specs = {k: {**base, "name": f"scale-{k}", "learner_ranks": RUNS[k][0], "rollout_workers": RUNS[k][1]}
             for k in keys}
    warmup = {**base, "name": "scale-warmup", "steps": 1, "rollout_workers": 2}
    home = fresh_home("scale-out")
    os.environ["OPENTINKER_HOME"] = str(home)
    t0 = time.perf_counter()
    stack = Stack(home, rollout_workers=2, overrides={"learner": ["learner_max_ranks=2"]}).start()
    print(f"stack up in {time.perf_counter() - t0:.1f} s (logs in {stack.log_dir})", flush=True)
    try:
        runs = asyncio.run(drive(stack.nats_url, specs, warmup, args.timeout))
    finally:
        stack.stop()
    from provenance import provenance

    out = {**provenance(), "config": os.path.relpath(args.config, ROOT), "sets": args.set, "steps": args.steps,
           "runs": runs, "table": table(runs)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(out["table"])
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
