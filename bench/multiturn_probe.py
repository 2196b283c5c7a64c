"""What the base model does on the multi-turn tasks of issue 31 (tool use, a game against
a fixed opponent): its held-out score and how its episodes end, before any training.

    .venv/bin/python bench/multiturn_probe.py [--only NAME ...] [--problems 12] [--samples 4]
        [--out bench/results/multiturn_probe.json]

Per candidate task (CANDIDATES: env, env_args, sampling), on `--problems` evaluation
requests of split "test" (the learner's Evaluator makes them: problems training never
shows), run by the rollout's agent loop on the transformers engine in this process
against the env's own code (bench/heldout.py), SmolLM2-135M-Instruct (the default):

- greedy: mean reward and win rate (game_results) at temperature 0, one episode each;
- sampled: the same at the training temperature, `--samples` episodes each, and how the
  sampled episodes went: turns, `tool_calls` and how they `ended` (env_info), so a task
  whose base model never earns a reward (no learning signal for GRPO: every group's
  advantages are 0) shows why.

A task learns by RL only where the sampled rewards of a group differ; `groups_with_spread`
counts the groups that do.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "multiturn_probe.json"
sys.path.insert(0, str(Path(__file__).resolve().parent))

CANDIDATES = {
    # tool use: 3-digit x 2-digit products with the sandboxed python tool (issue 31's example)
    "tool-mul-3x2": ("code-math", {"source": "arith", "digits": 3, "digits_b": 2, "max_tool_calls": 3},
                     {"max_new_tokens": 96, "max_turns": 4, "max_total_tokens": 1024}),
    "tool-mul-3x2-example": ("code-math", {"source": "arith", "digits": 3, "digits_b": 2, "max_tool_calls": 3,
                                           "example": True},
                             {"max_new_tokens": 96, "max_turns": 4, "max_total_tokens": 1024}),
    # a game against a fixed opponent: the hidden number, "higher"/"lower" each turn
    "guess-number-16": ("guess-number", {"n": 16, "max_turns": 6},
                        {"max_new_tokens": 16, "max_turns": 6, "max_total_tokens": 768}),
    "gomoku-5x5-random": ("gomoku", {"size": 5, "win_length": 3, "opponent": "random", "illegal": "loss",
                                     "legal_reward": 0.1},
                          {"max_new_tokens": 16, "max_turns": 8, "max_total_tokens": 1536}),
}


def probe(engine, name: str, problems: int, samples: int) -> dict:
    import msgspec

    from heldout import run_requests
    from opentinker.schemas import JobSpec, SamplingParams
    from opentinker.schemas.stats import game_results
    from opentinker.services.learner.evaluation import Evaluator

    env, env_args, sampling = CANDIDATES[name]
    spec = JobSpec(model="smollm2-135m-instruct", env=env, env_args=env_args, eval_every=1,
                   eval_episodes=problems, eval_split="test", eval_temperature=0.0,
                   sampling=SamplingParams(temperature=1.0, top_p=1.0, **sampling))
    greedy_reqs = Evaluator("probe", spec).requests(0)
    sampled_reqs = [msgspec.structs.replace(r, sampling=spec.sampling, group_size=samples,
                                            request_id=r.request_id + "-s") for r in greedy_reqs]
    greedy, t_greedy = run_requests(engine, spec, greedy_reqs, 0)
    sampled, t_sampled = run_requests(engine, spec, sampled_reqs, 0)
    g_flat, s_flat = [t for g in greedy for t in g], [t for g in sampled for t in g]

    def counts(key: str) -> dict:
        return dict(collections.Counter(str(t.env_info.get(key)) for t in s_flat))

    return {"name": name, "env": env, "env_args": env_args, "sampling": sampling, "problems": len(greedy_reqs),
            "greedy": {"reward_mean": statistics.fmean(t.reward for t in g_flat), **game_results(g_flat)},
            "sampled": {"reward_mean": statistics.fmean(t.reward for t in s_flat), **game_results(s_flat),
                        "episodes": len(s_flat),
                        "groups_with_spread": sum(len({t.reward for t in g}) > 1 for g in sampled),
                        "turns": dict(collections.Counter(len(t.turns) for t in s_flat)),
                        "tool_calls": counts("tool_calls"), "ended": counts("ended"),
                        "errors": sum(bool(t.error) for t in s_flat)},
            "seconds": round(t_greedy + t_sampled, 1)}


def main() -> None:
    from provenance import provenance

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", choices=sorted(CANDIDATES), default=list(CANDIDATES))
    ap.add_argument("--problems", type=int, default=12)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    from opentinker.services.core.config import Settings
    from opentinker.services.core.models import resolve_model
    from opentinker.services.rollout.engine_hf import HFEngine

    engine = HFEngine(resolve_model("smollm2-135m-instruct", Settings().home), seed=0)
    results = []
    for name in args.only:
        results.append(probe(engine, name, args.problems, args.samples))
        print(json.dumps(results[-1]), flush=True)
    out = {**provenance(),
           "model": "SmolLM2-135M-Instruct", "engine": "transformers, float32", "candidates": results}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
