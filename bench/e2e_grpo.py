"""End-to-end GRPO benchmark: TRL's GRPOTrainer vs the OpenTinker stack, one after the
other in one run, same task, model, batch and step count.

    .venv/bin/python bench/e2e_grpo.py [--steps 40] [--out bench/results/e2e_grpo.json]

Both sides: SmolLM2-135M-Instruct (from the GGUF), LoRA r8 on q/v, lr 1e-3, 4 prompts x 8
samples per step, 32 new tokens, temperature 1.0, beta 0 (no KL), single-digit addition
from the `arith` environment with its own reward. TRL generates with transformers in
process; OpenTinker runs every service as its own process on NATS (rollout on vLLM).
Reported: steps/s over the training steps (startup excluded, reported separately), mean
reward of the first and last 5 steps. No target: an honest side-by-side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("OPENTINKER_HOME", str(ROOT / ".opentinker"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def spec(steps: int) -> dict:
    return {
        "name": "bench-arith", "model": "smollm2-135m-instruct", "env": "arith",
        "env_args": {"op": "add", "digits": 1}, "lora_rank": 8, "lora_alpha": 16,
        "lora_target_modules": ["q_proj", "v_proj"], "prompts_per_step": 4, "group_size": 8,
        "steps": steps, "lr": 1e-3, "kl_coef": 0.0, "clip_range": 0.2, "max_staleness": 0,
        "micro_batch_size": 16, "seed": 0, "checkpoint_every": 1000,
        "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 32, "max_turns": 1},
    }


def first_last(rewards: list[float], k: int = 5) -> tuple[float, float]:
    k = min(k, max(1, len(rewards) // 2))
    return sum(rewards[:k]) / k, sum(rewards[-k:]) / k


def run_trl(steps: int, model_path: str, game_cls) -> dict:
    """TRL GRPOTrainer on the same prompts and reward."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    s = spec(steps)
    rows = []
    for step in range(steps):
        for g in range(s["prompts_per_step"]):
            game = game_cls(**s["env_args"])
            state = game.generate_initial_state(seed=step * 1000 + g, split="train")
            obs = game.reset(**state)
            try:
                user = game.get_initial_user_message()
            except NotImplementedError:
                user = obs
            msgs = ([{"role": "system", "content": game.get_system_prompt()}] if game.get_system_prompt() else [])
            rows.append({"prompt": msgs + [{"role": "user", "content": user}], "state": json.dumps(state)})

    def reward(completions, state, **_):
        out = []
        for c, st in zip(completions, state):
            game = game_cls(**s["env_args"])
            game.reset(**json.loads(st))
            text = c[-1]["content"] if isinstance(c, list) else c
            out.append(float(game.step(text).reward))
        return out

    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            times.append(time.perf_counter())

        def on_train_end(self, args, state, control, **kw):
            times.append(time.perf_counter())

    n = s["prompts_per_step"] * s["group_size"]
    cfg = GRPOConfig(
        output_dir=str(ROOT / ".opentinker" / "bench" / "trl"), per_device_train_batch_size=n,
        num_generations=s["group_size"], max_completion_length=32, temperature=1.0, top_p=1.0,
        learning_rate=s["lr"], beta=0.0, epsilon=0.2, max_steps=steps, logging_steps=1,
        use_cpu=True, bf16=False, report_to=[], save_strategy="no", seed=0,
        gradient_accumulation_steps=1, shuffle_dataset=False, lr_scheduler_type="constant",
        warmup_steps=0,
    )
    t0 = time.perf_counter()
    trainer = GRPOTrainer(model=model_path, reward_funcs=reward, args=cfg,
                          train_dataset=Dataset.from_list(rows),
                          peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                 lora_dropout=0.0, task_type="CAUSAL_LM"))
    trainer.add_callback(Clock())
    t_ready = time.perf_counter()
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    train_s = times[-1] - times[0]
    f, l = first_last(rewards)
    return {"system": "trl-grpotrainer", "steps": len(rewards), "startup_s": t_ready - t0,
            "train_s": train_s, "steps_per_s": len(rewards) / train_s, "rewards": rewards,
            "reward_first5": f, "reward_last5": l}


async def _follow(stack_url: str, steps: int) -> dict:
    from opentinker.sdk import Client

    client = await Client.connect(stack_url)
    t0 = time.perf_counter()
    job = await client.submit(spec(steps))
    rewards, step_times, stamps = [], [], []
    async for m in job.metrics():
        if m.split != "train":
            continue
        rewards.append(m.values["reward_mean"])
        step_times.append(m.values.get("step_time_s", 0.0))
        stamps.append(time.perf_counter())
    rec = await job.wait()
    await client.close()
    # steps/s over the training steps: from the first step's end back by its own time
    train_s = stamps[-1] - (stamps[0] - step_times[0])
    f, l = first_last(rewards)
    return {"system": "opentinker", "job_id": rec.job_id, "steps": len(rewards),
            "first_step_latency_s": stamps[0] - t0, "train_s": train_s,
            "steps_per_s": len(rewards) / train_s, "rewards": rewards,
            "reward_first5": f, "reward_last5": l}


def run_opentinker(steps: int) -> dict:
    from opentinker.ops.stack import Stack

    t0 = time.perf_counter()
    with Stack(os.environ["OPENTINKER_HOME"]) as stack:
        res = asyncio.run(_follow(stack.nats_url, steps))
    res["wall_s_incl_startup"] = time.perf_counter() - t0
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "e2e_grpo.json"))
    p.add_argument("--only", choices=["trl", "opentinker"])
    args = p.parse_args()

    from opentinker.services.core.models import DEFAULT_MODEL, resolve_model
    from opentinker.services.envhost.registry import BUILTIN

    model_path = resolve_model(DEFAULT_MODEL, os.environ["OPENTINKER_HOME"])
    results = []
    if args.only in (None, "trl"):
        results.append(run_trl(args.steps, model_path, BUILTIN["arith"]))
    if args.only in (None, "opentinker"):
        results.append(run_opentinker(args.steps))
    out = {"machine": f"{platform.machine()} {os.cpu_count()} cores, no GPU",
           "date": time.strftime("%Y-%m-%d"), "spec": spec(args.steps), "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"{'system':<18}{'steps/s':>10}{'train s':>10}{'reward first5':>15}{'last5':>8}")
    for r in results:
        print(f"{r['system']:<18}{r['steps_per_s']:>10.3f}{r['train_s']:>10.1f}"
              f"{r['reward_first5']:>15.3f}{r['reward_last5']:>8.3f}")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
