"""Which task can the main job learn: the base model's held-out accuracy and the size of
the held-out set of candidate `arith` tasks, and the curve of a training job run on one.

    .venv/bin/python bench/task_probe.py [--problems 100] [--out bench/results/task_probe.json]
        [--job JOB_ID ...]   # also record finished jobs' curves from the trajectory log

Per candidate (env_args of the `arith` env):

- held_out: the number of distinct unordered test problems, counted over the whole
  operand space by the env's own split rule (not sampled);
- greedy: the base model's accuracy on `--problems` distinct test problems at
  temperature 0, the learner's evaluation (the README's "held-out accuracy");
- sampled: its accuracy at the training temperature 1 on the same problems, 4 samples
  each, and `anywhere`, the fraction of those replies that hold the right answer as any
  number (the env rewards only the first number: a model that knows the sum but writes
  "19 + 2 = 21" scores 0 until it learns the format, so `anywhere` bounds what learning
  the format alone can reach).

All on the transformers engine in this process, SmolLM2-135M-Instruct (the embedded
default), through the rollout's agent loop and the env's own code (bench/heldout.py).
`--job` adds, per finished job in <home>/data, its train reward per step and its
evaluations (step, greedy correct, episodes).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "task_probe.json"
sys.path.insert(0, str(Path(__file__).resolve().parent))

CANDIDATES = [
    {"op": "add", "digits": 1},
    {"op": "add", "digits": 2, "digits_b": 1},
    {"op": "add", "digits": 2},
    {"op": "max", "digits": 2},
]


def held_out_size(env_args: dict) -> int:
    """Distinct unordered test problems of the whole operand space."""
    from opentinker.services.envhost.envs.arith import _range, split_of

    da = env_args.get("digits", 1)
    ra, rb = _range(da), _range(env_args.get("digits_b", da))
    pairs = {tuple(sorted((a, b))) for a in range(ra[0], ra[1] + 1) for b in range(rb[0], rb[1] + 1)}
    return sum(split_of(env_args["op"], a, b) == "test" for a, b in pairs)


def probe(engine, env_args: dict, problems: int, samples: int) -> dict:
    import msgspec

    from heldout import distinct_problems, run_requests
    from opentinker.schemas import JobSpec, SamplingParams
    from opentinker.services.learner.evaluation import Evaluator

    spec = JobSpec(model="smollm2-135m-instruct", env="arith", env_args=env_args, eval_every=1,
                   eval_episodes=1, eval_split="test", eval_temperature=0.0,
                   sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=32, max_turns=1))
    seeds = list(distinct_problems(spec, problems * 20).values())[:problems]
    template = Evaluator("probe", spec).requests(0)[0]

    def reqs(sampling, k):
        return [msgspec.structs.replace(template, request_id=f"probe-{i}", group_index=i, group_seed=s,
                                        group_size=k, sampling=sampling) for i, s in enumerate(seeds)]

    greedy, t_greedy = run_requests(engine, spec, reqs(template.sampling, 1), 0)
    sampled, t_sampled = run_requests(engine, spec, reqs(spec.sampling, samples), 0)
    tok = engine.tokenizer

    def anywhere(t) -> bool:
        text = tok.decode([x for x, m in zip(t.token_ids, t.loss_mask) if m], skip_special_tokens=True)
        return t.env_info["answer"] in [int(x) for x in re.findall(r"-?\d+", text)]

    flat = [t for g in sampled for t in g]
    return {"env_args": env_args, "held_out": held_out_size(env_args), "problems": len(seeds),
            "greedy": sum(g[0].reward >= 1 for g in greedy) / len(seeds),
            "sampled": sum(t.reward >= 1 for t in flat) / len(flat),
            "anywhere": sum(anywhere(t) for t in flat) / len(flat), "samples_per_problem": samples,
            "seconds": round(t_greedy + t_sampled, 1)}


def job_curve(job_id: str, data_dir: Path) -> dict:
    from opentinker.services.core.logdb import run_query

    def rows(sql: str):
        return run_query(sql, data_dir)[1]

    job = job_id.replace("'", "''")
    train = rows(f"SELECT step, avg(reward) FROM trajectories WHERE job_id = '{job}' AND split = 'train' "
                 "GROUP BY step ORDER BY step")
    evals = rows(f"SELECT step, avg(CASE WHEN reward >= 1 THEN 1.0 ELSE 0.0 END), count(*) FROM trajectories "
                 f"WHERE job_id = '{job}' AND split = 'test' GROUP BY step ORDER BY step")
    return {"job_id": job_id, "train_reward": [[s, round(r, 4)] for s, r in train],
            "eval_correct": [[s, round(c, 4), n] for s, c, n in evals]}


def main() -> None:
    from provenance import provenance

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--problems", type=int, default=100)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--job", action="append", default=[], help="a finished job whose curve to record")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    from opentinker.services.core.config import Settings
    from opentinker.services.core.models import resolve_model
    from opentinker.services.rollout.engine_hf import HFEngine

    settings = Settings()
    engine = HFEngine(resolve_model("smollm2-135m-instruct", settings.home), seed=0)
    results = []
    for env_args in CANDIDATES:
        results.append(probe(engine, env_args, args.problems, args.samples))
        print(json.dumps(results[-1]), flush=True)
    out = {**provenance(),
           "model": "SmolLM2-135M-Instruct",
           "candidates": results, "jobs": [job_curve(j, settings.log_dir) for j in args.job]}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
