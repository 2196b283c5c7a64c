"""Two LoRA jobs sharing one vLLM rollout engine: vLLM multi-LoRA (adapters applied per
request) against merging each job's adapter into the weights at every job switch (the
path for engines without multi-LoRA), side by side in one run on the same model, the
same adapters and the same prompts. As in training, every job switch brings a new
policy version. Also the cost of enabling LoRA for a request with no adapter
(full-weight jobs on such an engine).

    .venv/bin/python bench/multi_lora.py [--model smollm2-135m-instruct] [--rounds 6]

Each mode runs in its own process (one vLLM engine per process); the results go to
bench/results/multi_lora.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "multi_lora.json"


def adapters(model_dir: str, out: Path) -> list[dict]:
    """Two peft LoRAs (r 8, alpha 16, q/v, random lora_B) as a learner publishes them."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    made = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        peft = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
        with torch.no_grad():
            for n, p in peft.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05)
        path = out / f"job{seed}.safetensors"
        save_file({k: v.contiguous() for k, v in get_peft_model_state_dict(peft).items()}, str(path))
        made.append({"path": str(path), "rank": 8, "alpha": 16})
    return made


def run_mode(mode: str, model_dir: str, jobs: list[dict], rounds: int, out: Path) -> dict:
    """One engine: `mode` "native" (vLLM multi-LoRA) or "merge"."""
    from safetensors.torch import load_file

    from opentinker.schemas import SamplingParams
    from opentinker.services.rollout.engine_vllm import VLLMEngine
    from opentinker.services.rollout.weights import (
        BaseWeights, HeldWeights, lora_pairs, lora_scale, merge_lora, write_peft_adapter,
    )

    t0 = time.perf_counter()
    engine = VLLMEngine(model_dir, dtype="float32", max_loras=4 if mode == "native" else 0, max_lora_rank=8)
    start_s = time.perf_counter() - t0
    base = BaseWeights(model_dir)
    held = HeldWeights(base, engine.packed_modules)
    tok = engine.tokenizer
    prompts = [tok(f"What is {a} + {b}? Answer:")["input_ids"] for a, b in zip(range(16), range(3, 19))]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=32)
    engine.generate(prompts[:2], sampling)  # warm up

    def gen() -> tuple[int, float]:
        t = time.perf_counter()
        outs = engine.generate(prompts, sampling)
        return sum(len(o.token_ids) for o in outs), time.perf_counter() - t

    tokens, secs = gen()
    base_tps = tokens / secs
    pairs = [lora_pairs(load_file(j["path"])) for j in jobs]
    switch_s, gen_s, gen_tokens = 0.0, 0.0, 0
    previous: dict[int, str] = {}
    for r in range(rounds):
        # as in training: every round is a new policy version of job i (lora_B moved)
        i = r % len(jobs)
        version = {k: (a, b * (1.0 + 0.01 * r)) for k, (a, b) in pairs[i].items()}
        t = time.perf_counter()
        if mode == "native":
            folder = out / f"{mode}-job{i}-v{r}"
            write_peft_adapter(base, version, jobs[i]["alpha"], jobs[i]["rank"], folder)
            engine.use_lora(str(folder), drop=previous.get(i))
            previous[i] = str(folder)
        else:
            new = merge_lora(base, version, lora_scale(jobs[i]["alpha"], jobs[i]["rank"], version))
            engine.load_weights(held.plan(new))
            held.commit(new)
        switch_s += time.perf_counter() - t
        n, s = gen()
        gen_s += s
        gen_tokens += n
    return {"mode": mode, "engine_start_s": round(start_s, 1), "base_tokens_per_s": round(base_tps, 1),
            "job_switches": rounds, "switch_s_mean": round(switch_s / rounds, 4),
            "lora_tokens_per_s": round(gen_tokens / gen_s, 1),
            "end_to_end_tokens_per_s": round(gen_tokens / (gen_s + switch_s), 1)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--mode", choices=["native", "merge"], help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    args = p.parse_args()
    from opentinker.services.core.config import default_home, setup_cache_dirs
    from opentinker.services.core.models import resolve_model

    setup_cache_dirs(default_home())
    model_dir = resolve_model(args.model, default_home())
    if args.mode:  # a child: one engine
        work = Path(args.work)
        jobs = json.loads((work / "jobs.json").read_text())
        print(json.dumps(run_mode(args.mode, model_dir, jobs, args.rounds, work)))
        return
    with tempfile.TemporaryDirectory(dir=Path(default_home()) / "cache") as tmp:
        work = Path(tmp)
        (work / "jobs.json").write_text(json.dumps(adapters(model_dir, work)))
        rows = []
        for mode in ("native", "merge"):
            out = subprocess.run([sys.executable, __file__, "--model", args.model, "--rounds", str(args.rounds),
                                  "--mode", mode, "--work", str(work)], capture_output=True, text=True,
                                 env=dict(os.environ, VLLM_LOGGING_LEVEL="ERROR"), check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    native, merge = rows
    result = {"model": args.model, "batch": 16, "new_tokens": 32, "rows": rows,
              "native_over_merge_end_to_end": round(native["end_to_end_tokens_per_s"]
                                                    / merge["end_to_end_tokens_per_s"], 3),
              "lora_enabled_base_speed_ratio": round(native["base_tokens_per_s"] / merge["base_tokens_per_s"], 3),
              "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
