"""How much can overlapping rollout with training (max_staleness >= 1) gain on this
machine? Generation (vLLM, the rollout engine) and one training step (DeepSpeed, the
learner engine) of the README's main job, each timed alone with 1 thread and with every
core, then both at once on disjoint cores, in one run.

    .venv/bin/python bench/overlap_bound.py [--reps 6] [--episodes 13] [--out bench/results/overlap_bound.json]

The work is the main job's (examples/arith_grpo.toml): 32 completions of up to 32 new
tokens for the `arith` env's prompts (4 groups x 8), and a LoRA training step on
`--episodes` episodes of the bench's mean lengths (13: the ~40% of 32 that carry signal
once zero-variance groups are skipped, bench/results/e2e_grpo_2026-11-25.json). Each measurement is
its own process (vLLM binds its OpenMP threads once, VLLM_CPU_OMP_THREADS_BIND), the
median of `--reps` after one warm-up call.

What the numbers bound. A synchronous step runs generation then training, each on every
core: sync = gen(all) + train(all). An asynchronous step overlaps them, so it can be no
shorter than either alone on every core, nor shorter than their total work spread over
the cores at the one-thread rate (the most efficient use of a core measured here):
async >= max(gen(all), train(all), (gen(1) + train(1)) / cores). The ratio
sync / that floor is the most that async can gain over sync for a rollout whose
generation keeps every core busy, as one engine call does. A job's rollout does not: its
agent loop, per-token scheduling of concurrent episodes, env calls and weight loads leave
cores idle that overlapped training fills, so bench/e2e_grpo.py's measured async/sync can
exceed this bound (2026-11-25: 1.39x against 1.12x here). On separate devices (a rollout
GPU and a learner GPU) the floor is max(gen, train) and the gain approaches
sync / max(gen, train).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "overlap_bound.json"
HOME = Path(os.environ.get("OPENTINKER_HOME", ROOT / ".opentinker"))


def child_env(threads: int, cores: str | None) -> dict[str, str]:
    env = dict(os.environ, OPENTINKER_HOME=str(HOME), DS_ACCELERATOR="cpu")
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(threads)
    env["VLLM_CPU_OMP_THREADS_BIND"] = cores or f"0-{threads - 1}"
    return env


def child_setup() -> None:
    """In a measuring process, before torch or vLLM load: caches in the home, and the
    one-process group's rank variables the learner engine reads."""
    from opentinker.services.core.config import setup_cache_dirs

    setup_cache_dirs(str(HOME))
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)


def episode(i: int, spec, prompt: list[int], tokens: list[int], logprobs: list[float]):
    """Episode `i` of a step (group i // group_size): a single-turn Trajectory of
    `prompt` then the sampled `tokens` with the sampler's `logprobs`; reward i % 2."""
    from opentinker.schemas import Trajectory, TurnRecord

    p, n = len(prompt), len(prompt) + len(tokens)
    return Trajectory(job_id="j", request_id="r", episode_id=f"e{i}", step=0, group_index=i // spec.group_size,
                      group_size=spec.group_size, token_ids=prompt + tokens, loss_mask=[0] * p + [1] * len(tokens),
                      logprobs=[0.0] * p + list(logprobs), prompt_len=p,
                      turns=[TurnRecord(gen_start=p, gen_end=n, obs_end=n)], reward=float(i % 2), policy_version=0)


def main_job():
    """The README main job's JobSpec (examples/arith_grpo.toml, schema defaults)."""
    from opentinker.cli.common import load_job_config
    from opentinker.schemas.job import spec_from_dict

    return spec_from_dict(load_job_config(str(ROOT / "examples" / "arith_grpo.toml"), []))


def main_prompts(spec, tokenizer, step: int = 0) -> list[list[int]]:
    """The token ids of step `step`'s prompts, each `group_size` times (the env's own
    system and user messages in the model's chat template)."""
    from opentinker.services.envhost.registry import BUILTIN
    from opentinker.services.envhost.service import initial_state, open_episode
    from opentinker.services.learner.job import group_seed

    cls = BUILTIN[spec.env]
    prompts = []
    for g in range(spec.prompts_per_step):
        state = initial_state(cls, spec.env_args, group_seed(spec.seed, step, g), "train")
        _, system, user, _ = open_episode(cls, spec.env_args, state)
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        prompts += [list(ids["input_ids"] if hasattr(ids, "keys") else ids)] * spec.group_size
    return prompts


def measure_generation(reps: int) -> list[float]:
    """Seconds per call: 32 completions (4 arith problems x 8) of up to 32 new tokens."""
    from opentinker.services.core.models import resolve_model
    from opentinker.services.rollout.engine_vllm import VLLMEngine

    spec = main_job()
    eng = VLLMEngine(resolve_model(spec.model, str(HOME)))
    prompts = main_prompts(spec, eng.tokenizer)
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        eng.generate(prompts, spec.sampling)
        times.append(time.perf_counter() - t0)
    return times[1:]


def measure_training(reps: int, episodes: int, prompt_len: int, gen_len: int) -> list[float]:
    """Seconds per learner step (forward, backward, optimizer) on `episodes` episodes."""
    import torch

    from opentinker.services.core.models import resolve_model
    from opentinker.services.learner.batching import micro_batches
    from opentinker.services.learner.engine_deepspeed import TrainEngine
    from opentinker.services.learner.loss import AggTotals

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    spec = main_job()
    eng = TrainEngine(spec, resolve_model(spec.model, str(HOME)), device="cpu")
    ids = [[(7 * i + 3 * k) % 5000 + 10 for k in range(prompt_len + gen_len)] for i in range(episodes)]
    trajs = [episode(i, spec, x[:prompt_len], x[prompt_len:], [-1.0] * gen_len) for i, x in enumerate(ids)]
    mbs = micro_batches(trajs, [1.0 if i % 2 else -1.0 for i in range(episodes)], spec.micro_batch_size, eng.pad_id)
    tot = AggTotals(tokens=float(sum(b.num_tokens for b in mbs)), seqs=float(episodes), max_len=float(gen_len))
    times = []
    try:
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            eng.train_step(mbs, [list(range(len(mbs)))], [tot], [spec.lr])
            times.append(time.perf_counter() - t0)
    finally:
        eng.close()
    return times[1:]


def run_child(what: str, threads: int, cores: str | None, args) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--child", what, "--reps", str(args.reps), "--episodes", str(args.episodes),
           "--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len)]
    pre = ["taskset", "-c", cores] if cores else []
    return subprocess.Popen(pre + cmd, env=child_env(threads, cores), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)


def result(p: subprocess.Popen) -> float:
    out, _ = p.communicate()
    if p.returncode != 0:
        raise SystemExit(f"a measurement exited {p.returncode}: {p.args}")
    times = json.loads(out.strip().splitlines()[-1])["times"]
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--episodes", type=int, default=13)
    ap.add_argument("--prompt-len", type=int, default=45)
    ap.add_argument("--gen-len", type=int, default=23)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--child", choices=["gen", "train"])
    args = ap.parse_args()
    if args.child:
        child_setup()
    if args.child == "gen":
        print(json.dumps({"times": measure_generation(args.reps)}))
        return
    if args.child == "train":
        print(json.dumps({"times": measure_training(args.reps, args.episodes, args.prompt_len, args.gen_len)}))
        return
    cores = os.cpu_count() or 1
    m: dict[str, float] = {}
    for what in ("gen", "train"):
        for threads in sorted({1, cores}):
            m[f"{what}_{threads}t"] = result(run_child(what, threads, None, args))
            print(f"{what} alone, {threads} thread(s): {m[f'{what}_{threads}t']:.2f} s", flush=True)
    if cores >= 2:  # both at once, generation on core 0, training on the others
        g = run_child("gen", 1, "0", args)
        t = run_child("train", cores - 1, f"1-{cores - 1}", args)
        m["gen_concurrent_core0"], m["train_concurrent_rest"] = result(g), result(t)
    sync = m[f"gen_{cores}t"] + m[f"train_{cores}t"]
    floor = max(m[f"gen_{cores}t"], m[f"train_{cores}t"], (m["gen_1t"] + m["train_1t"]) / cores)
    split = max(m.get("gen_concurrent_core0", 0.0), m.get("train_concurrent_rest", 0.0)) or None
    from provenance import provenance

    res = {
        **provenance(),
        "seconds": m,
        "sync_step_s": sync,
        "async_floor_s": floor,
        "async_split_cores_s": split,
        "max_async_over_sync": sync / floor,
        "split_cores_async_over_sync": sync / split if split else None,
        "separate_devices_async_over_sync": sync / max(m[f"gen_{cores}t"], m[f"train_{cores}t"]),
        "note": "sync = gen(all cores) + train(all cores); floor = max(gen(all), train(all), "
                "(gen(1) + train(1)) / cores). Medians of --reps calls after a warm-up, each in its own process.",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(f"sync step {sync:.2f} s; async floor {floor:.2f} s: at most x{sync / floor:.2f} over sync on this machine"
          + (f"; generation and training on disjoint cores: {split:.2f} s (x{sync / split:.2f})" if split else ""))


if __name__ == "__main__":
    main()
