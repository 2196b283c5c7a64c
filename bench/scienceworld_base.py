"""Base SmolLM2-135M-Instruct on a fixed set of ScienceWorld test variations, through the
real inference path (`Client.infer` against a local stack: scheduler, envhost serving
the `scienceworld` env, rollout worker), plus the env's own reset and step latencies.

    .venv/bin/python bench/scienceworld_base.py [--episodes 10] [--seed 0] [--max-turns 10]
        [--task find-living-thing --task ...] [--engine hf] [--out bench/results/scienceworld_base.json]

The episodes: `--episodes` groups of one, group seeds from `--seed` (sdk.infer's
episode_seed), each a task of `--task` (default: the env's four "find" tasks) and one
of ScienceWorld's own test variations of it (the env's seeded state), "easy"
simplifications as in the ScienceWorld paper's baselines (Wang et al. 2022, arXiv
2203.07540); greedy decoding, up to `--max-turns` commands of at most 32 tokens, within
`--max-total-tokens` an episode (the transformers engine's context is 2048).
Reported: the mean ScienceWorld score (0..100; a failed task counts 0, see the env's
docstring), the fraction completed and failed, invalid actions per turn, and per
episode the task, variation, score, turns and commands. Needs `scienceworld` and Java.
No targets, no stored numbers.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
# beside this file: imports once the path above is in (hence noqa: E402)
from faults import MAIN_HOME, fresh_home  # a scratch home sharing the main home's models  # noqa: E402

ENV_SPEC = "opentinker.services.envhost.envs.scienceworld:ScienceWorldGame"
OUT = ROOT / "bench" / "results" / "scienceworld_base.json"
MODEL = MAIN_HOME / "models" / "SmolLM2-135M-Instruct"


def env_latency(tasks: list[str], n: int = 5) -> dict:
    """Seconds: the first simulator's start (JVM), reset (load a variation) and step
    (one command; ScienceWorld's gold actions), medians over `n` test variations."""
    from opentinker.services.envhost.envs import scienceworld as sw

    t0 = time.perf_counter()
    with sw.pool().lease():
        pass
    start_s = time.perf_counter() - t0
    resets, steps = [], []
    for i in range(n):
        task = tasks[i % len(tasks)]
        variation = sw.variations(task)["test"][i]
        with sw.pool().lease() as sim:
            sim.owner = None
            sim.env.load(task, variation, "easy", generateGoldPath=True)
            gold = sim.env.get_gold_action_sequence()
        g = sw.ScienceWorldGame(task=task)
        t0 = time.perf_counter()
        g.reset(task=task, variation=variation)
        resets.append(time.perf_counter() - t0)
        for a in gold:
            t0 = time.perf_counter()
            r = g.step(a)
            steps.append(time.perf_counter() - t0)
            if r.done:
                break
    sw.pool().close()
    return {"jvm_start_s": round(start_s, 3), "reset_median_s": round(statistics.median(resets), 4),
            "step_median_s": round(statistics.median(steps), 4), "step_max_s": round(max(steps), 4),
            "resets": len(resets), "steps": len(steps)}


async def run(url: str, args) -> dict:
    from opentinker.schemas import SamplingParams
    from opentinker.sdk import Client

    env_args = {"max_turns": args.max_turns, **({"task": args.task} if args.task else {})}
    sampling = SamplingParams(temperature=0.0, max_new_tokens=32, max_total_tokens=args.max_total_tokens,
                              max_turns=args.max_turns)
    async with await Client.connect(url) as client:
        res = await client.infer(env="scienceworld", env_args=env_args, model=str(MODEL), episodes=args.episodes,
                                 seed=args.seed, split="test", sampling=sampling, engine=args.engine,
                                 timeout_s=args.timeout, on_episode=lambda t: print(
                                     f"episode {t.env_info.get('task')} v{t.env_info.get('variation')}: score "
                                     f"{t.env_info.get('score')} in {len(t.turns)} turns", flush=True))
    rows = []
    for t in res.trajectories:
        info = t.env_info
        rows.append({"task": info.get("task"), "variation": info.get("variation"), "score": info.get("score"),
                     "raw_score": info.get("raw_score"), "won": info.get("won"), "failed": info.get("failed"),
                     "turns": len(t.turns), "reward": t.reward, "error": t.error,
                     "invalid_turns": sum(1 for turn in t.turns if "No known action matches" in turn.observation),
                     "actions": [turn.action for turn in t.turns]})
    scores = [r["score"] or 0 for r in rows]
    turns = sum(r["turns"] for r in rows)
    return {"episodes": len(rows), "mean_score": round(statistics.fmean(scores), 2),
            "completed_frac": sum(bool(r["won"]) for r in rows) / len(rows),
            "failed_frac": sum(bool(r["failed"]) for r in rows) / len(rows),
            "invalid_per_turn": round(sum(r["invalid_turns"] for r in rows) / max(turns, 1), 3),
            "mean_turns": round(turns / len(rows), 2), "errors": sum(1 for r in rows if r["error"]),
            "infer_wall_s": res.summary.get("wall_s"), "per_episode": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--episodes", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-turns", type=int, default=10)
    p.add_argument("--max-total-tokens", type=int, default=2048)
    p.add_argument("--task", action="append", default=[], help="a ScienceWorld task (repeatable)")
    p.add_argument("--engine", default="hf", choices=("hf", "vllm", "auto"))
    p.add_argument("--timeout", type=float, default=3000.0)
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

    from opentinker.ops.stack import Stack
    from opentinker.services.envhost.envs.scienceworld import DEFAULT_TASKS

    latency = env_latency(args.task or list(DEFAULT_TASKS))
    print("env latency:", latency, flush=True)
    # one simulator per episode in the envhost: no episode waits for another's replay
    os.environ.setdefault("OPENTINKER_SCIENCEWORLD_JVMS", str(args.episodes))
    home = fresh_home("scienceworld-base")
    os.environ["OPENTINKER_HOME"] = str(home)
    t0 = time.perf_counter()
    stack = Stack(home, services=("scheduler", "envhost", "rollout"),
                  overrides={"envhost": ["--env", ENV_SPEC], "rollout": [f"engine={args.engine}"]}).start()
    print(f"stack up in {time.perf_counter() - t0:.1f} s (logs in {stack.log_dir})", flush=True)
    try:
        result = asyncio.run(run(stack.nats_url, args))
    finally:
        stack.stop()
    out = {"model": MODEL.name, "env": "scienceworld", "split": "test", "seed": args.seed,
           "tasks": args.task or list(DEFAULT_TASKS), "simplification": "easy", "max_turns": args.max_turns,
           "decoding": "greedy, 32 new tokens a turn", "engine": args.engine, "env_latency": latency, **result}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "per_episode"}, indent=2))


if __name__ == "__main__":
    main()
