"""The sampler/learner gap of a bfloat16 learner against a float32 one, on the README main
job's episodes: what the behaviour correction (rollout_is) has to absorb, and what a
learner step costs in each dtype.

    .venv/bin/python bench/bf16_gap.py [--steps 2] [--out bench/results/bf16_gap.json]

vLLM (float32, the rollout engine) samples the main job's first `--steps` steps (4
`arith` prompts x 8, temperature 1, up to 32 new tokens) with its logprobs: the
behaviour policy. A learner engine (DeepSpeed, LoRA as in examples/arith_grpo.toml) in
float32 and then in bfloat16 scores the same tokens (`TrainEngine.sequence_logprobs`,
the logprobs the loss uses) before any update, so sampler and learner hold the same
weights and every difference is numerics. Reported per dtype, over the policy tokens:
mismatch_kl (k3 estimate of KL(sampler || learner), the learner's `mismatch_kl` metric),
the mean and max |logp_learner - logp_sampler| (nats), the token-level truncated
importance weights the learner would apply (mean, and fraction capped at C = the
spec's rollout_is_threshold), and the seconds of `--reps` learner steps (forward,
backward, optimizer) on those episodes, the first included (a bfloat16 step on a CPU
without native bf16 arithmetic is slow enough that a warm-up would double the run;
`--reps 0` measures the gap alone, which other load on the machine does not change).
Each engine runs in its own process.
The reward of a bfloat16 run beside a float32 one is a separate measurement: e2e_grpo.py
--only async,async-bf16 --out bench/results/e2e_grpo_bf16.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overlap_bound import HOME, ROOT, child_env, child_setup, episode, main_job, main_prompts  # noqa: E402

OUT = ROOT / "bench" / "results" / "bf16_gap.json"


def sample(steps: int, path: Path) -> None:
    """vLLM float32 samples of the main job's first `steps` steps, written to `path`."""
    from opentinker.services.core.models import resolve_model
    from opentinker.services.rollout.engine_vllm import VLLMEngine

    spec = main_job()
    eng = VLLMEngine(resolve_model(spec.model, str(HOME)))
    episodes = []
    for step in range(steps):
        prompts = main_prompts(spec, eng.tokenizer, step)
        for p, out in zip(prompts, eng.generate(prompts, spec.sampling)):
            episodes.append({"prompt": p, "tokens": out.token_ids, "logprobs": out.logprobs})
    path.write_text(json.dumps(episodes))


def score(dtype: str, path: Path, reps: int) -> dict:
    """The learner's view of the sampled episodes in `dtype` (see the module docstring)."""
    import msgspec
    import torch

    from opentinker.services.core.models import resolve_model
    from opentinker.services.learner.batching import micro_batches
    from opentinker.services.learner.engine_deepspeed import TrainEngine
    from opentinker.services.learner.loss import AggTotals, k3_kl, rollout_is_weights

    spec = msgspec.structs.replace(main_job(), dtype=dtype)
    trajs = [episode(i, spec, e["prompt"], e["tokens"], e["logprobs"])
             for i, e in enumerate(json.loads(path.read_text()))]
    eng = TrainEngine(spec, resolve_model(spec.model, str(HOME)), device="cpu")
    try:
        mbs = micro_batches(trajs, [1.0 if i % 2 else -1.0 for i in range(len(trajs))], spec.micro_batch_size,
                            eng.pad_id)
        learner = eng.sequence_logprobs(mbs, reference=False)
        kls, diffs, ws, caps = [], [], [], []
        for mb, lp in zip(mbs, learner):
            keep = mb.loss_mask > 0
            # micro_batches shifts the sampler's logprobs onto the target positions, as the loss sees them
            behav = mb.logprobs
            kls.append(k3_kl(behav, lp)[keep])  # as loss.policy_loss's mismatch_kl
            diffs.append((lp - behav).abs()[keep])
            w, capped = rollout_is_weights(lp, behav, mb.loss_mask, "token", "truncate", spec.rollout_is_threshold)
            ws.append(w[keep])
            caps.append(capped[keep])
        kl, diff, w, cap = (torch.cat(x).float() for x in (kls, diffs, ws, caps))
        tot = AggTotals(tokens=float(sum(b.num_tokens for b in mbs)), seqs=float(len(trajs)),
                        max_len=float(spec.sampling.max_new_tokens))
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            eng.train_step(mbs, [list(range(len(mbs)))], [tot], [spec.lr])
            times.append(time.perf_counter() - t0)
    finally:
        eng.close()
    return {"tokens": int(kl.numel()), "mismatch_kl": float(kl.mean()), "abs_logp_diff_mean": float(diff.mean()),
            "abs_logp_diff_max": float(diff.max()), "is_weight_mean": float(w.mean()),
            "is_capped_frac": float(cap.mean()), "train_step_s": statistics.median(times) if times else None,
            "train_step_times_s": times}


def run(args: list[str]) -> str:
    cmd = [sys.executable, __file__, *args]
    r = subprocess.run(cmd, env=child_env(os.cpu_count() or 1, None), capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(args)} exited {r.returncode}: {r.stderr[-2000:]}")
    return r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--child", choices=["sample", "float32", "bfloat16"])
    ap.add_argument("--episodes-file", default="")
    args = ap.parse_args()
    if args.child:
        child_setup()
    if args.child == "sample":
        sample(args.steps, Path(args.episodes_file))
        return
    if args.child:
        print(json.dumps(score(args.child, Path(args.episodes_file), args.reps)))
        return
    with tempfile.TemporaryDirectory(dir=ROOT / "bench" / "results") as tmp:
        eps = Path(tmp) / "episodes.json"
        run(["--child", "sample", "--steps", str(args.steps), "--episodes-file", str(eps)])
        res = {d: json.loads(run(["--child", d, "--episodes-file", str(eps), "--reps", str(args.reps)]))
               for d in ("float32", "bfloat16")}
    from provenance import provenance

    out = {**provenance(), "sampler": "vLLM float32", "steps_sampled": args.steps, "learner": res}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    for d, r in res.items():
        print(f"{d:>9}: mismatch_kl {r['mismatch_kl']:.2e}, |dlogp| mean {r['abs_logp_diff_mean']:.4f} "
              f"max {r['abs_logp_diff_max']:.3f} nats, IS weight mean {r['is_weight_mean']:.4f}, "
              f"capped {r['is_capped_frac']:.4f}, train step {r['train_step_s'] or 0:.2f} s ({r['tokens']} tokens)")


if __name__ == "__main__":
    main()
