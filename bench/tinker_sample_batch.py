"""A Tinker API sampling session's `sample` calls on a rollout worker: one engine call for
a fetched batch of them (services/rollout/sampling.py, samples_blocking) against one
engine call per `sample` call (what the worker did before), side by side in one run on
the same engine, model and calls. The calls are an RL loop's: FETCH_BATCH (16) prompts
at once, each with `num_samples` completions, as tinker-cookbook's RL recipes send them.

    .venv/bin/python bench/tinker_sample_batch.py [--model smollm2-135m-instruct] [--reps 3]

Both engines in float32, a Tinker sampling session's default precision.

Writes bench/results/<date>_<commit>_tinker_sample_batch.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from provenance import provenance  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def report(res: dict) -> str:
    """One line of a results file: the engine, the calls and both medians."""
    med = res["median_s"]
    return (f"{res['engine']}, {res['model']}: {res['calls']} calls x {res['num_samples']} samples x "
            f"<= {res['max_tokens']} tokens, median of {res['reps']}: one engine call per `sample` call "
            f"{med['per_call']:.2f} s, one for the batch {med['batched']:.2f} s ({res['batched_speedup']:.2f}x; "
            f"commit {res['commit'][:7]}{' (uncommitted changes)' if res.get('dirty') else ''})\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--engine", choices=("vllm", "hf"), default="vllm")
    p.add_argument("--calls", type=int, default=16, help="sample calls in one fetched batch (FETCH_BATCH)")
    p.add_argument("--num-samples", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default="")
    args = p.parse_args()
    from opentinker.schemas.tinker import TinkerSample
    from opentinker.services.core.config import default_home, setup_cache_dirs
    from opentinker.services.core.models import resolve_model
    from opentinker.services.rollout.sampling import samples_blocking
    from opentinker.services.rollout.service import MAX_MODEL_LEN

    setup_cache_dirs(default_home())
    model_dir = resolve_model(args.model, default_home())
    if args.engine == "vllm":
        from opentinker.services.rollout.engine_vllm import VLLMEngine

        engine = VLLMEngine(model_dir, device="cpu", dtype="float32", seed=0, max_model_len=MAX_MODEL_LEN)
    else:
        from opentinker.services.rollout.engine_hf import HFEngine

        engine = HFEngine(model_dir, device="cpu", dtype="float32", seed=0, max_model_len=MAX_MODEL_LEN)
    tok = engine.tokenizer

    def prompt(i: int) -> list[int]:
        chat = [{"role": "user", "content": f"What is {i % 10} + {i // 3}?"}]
        return tok(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))["input_ids"]

    calls = [TinkerSample(job_id="bench", sampler="ts-0123456789-s0", seq_id=i, tokens=prompt(i),
                          num_samples=args.num_samples, max_tokens=args.max_tokens, temperature=1.0)
             for i in range(args.calls)]
    samples_blocking(engine, calls[:2])  # warm up

    def timed(batches: list[list[TinkerSample]]) -> tuple[float, int]:
        t = time.perf_counter()
        tokens = sum(len(o.token_ids) for b in batches for g in samples_blocking(engine, b) for o in g[0])
        return time.perf_counter() - t, tokens

    runs: dict[str, list[dict]] = {"per_call": [], "batched": []}
    for _ in range(args.reps):  # alternated, so drift in the machine's speed falls on both
        for mode, batches in (("per_call", [[c] for c in calls]), ("batched", [calls])):
            secs, tokens = timed(batches)
            runs[mode].append({"s": round(secs, 3), "tokens": tokens, "tokens_per_s": round(tokens / secs, 1)})
    med = {m: statistics.median(r["s"] for r in rs) for m, rs in runs.items()}
    res = {**provenance(), "engine": args.engine, "model": args.model, "calls": args.calls,
           "num_samples": args.num_samples, "max_tokens": args.max_tokens, "reps": args.reps, "runs": runs,
           "median_s": med, "batched_speedup": round(med["per_call"] / med["batched"], 2)}
    name = f"{time.strftime('%Y-%m-%d')}_{res['commit'][:7]}_tinker_sample_batch.json"
    out = Path(args.out) if args.out else RESULTS / name
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({k: res[k] for k in ("median_s", "batched_speedup")}), "->", out)


if __name__ == "__main__":
    main()
