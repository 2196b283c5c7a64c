"""Upstream OpenTinker's "Training Workflow" and "Inference Workflow" (the project page,
open-tinker.github.io/opentinker-page, "Client Design"), run on this service unchanged
but for the URL and key, with a one-digit addition game defined here.

    opentinker up                                   # the local stack, in another shell
    python examples/seed_workflow.py                # URL and key of the local stack
    OPENTINKER_API_URL=http://host:8470 OPENTINKER_API_KEY=otk-... python examples/seed_workflow.py

What a run shows: 3 training steps of GRPO with LoRA on SmolLM2-135M-Instruct (reward
per step; this short a run is a smoke test, not enough to learn), then the trained
policy served as an OpenAI-compatible endpoint and 8 addition problems answered through
it, the results written as JSONL and upstream's summary printed.
"""

import os
import random
import re
import tempfile
from types import SimpleNamespace

from opentinker.client.utils.http_training_client import InferenceSchedulerClient, SchedulerClient, ServiceClient
from opentinker.environment.base_game import AbstractGame, StepResult
from opentinker.environment.base_game_environment import GameEnvironment
from opentinker.environment.inference_pipeline import run_inference


class AdditionGame(AbstractGame):
    """One-digit addition: reward 1.0 when the reply's first number is the sum."""

    def __init__(self, max_digit: int = 9):
        self.max_digit = max_digit
        self.answer = 0

    def generate_initial_state(self):
        # upstream's argument-free form: Python's random, seeded per group by the service
        return {"a": random.randint(0, self.max_digit), "b": random.randint(0, self.max_digit)}

    def reset(self, a: int = 0, b: int = 0, **kwargs) -> str:
        self.answer = a + b
        return f"What is {a} + {b}?"

    def step(self, action: str) -> StepResult:
        m = re.search(r"-?\d+", action)
        correct = m is not None and int(m.group()) == self.answer
        return StepResult(observation="", reward=1.0 if correct else 0.0, done=True, info={"correct": correct})

    def get_system_prompt(self) -> str:
        return "You are a calculator. Reply with only the number."

    def get_initial_user_message(self) -> str:
        return "Add the two numbers."


# upstream's client config keys (client_config/*.yaml), as a namespace instead of Hydra's DictConfig
args = SimpleNamespace(
    project_name="opentinker", experiment_name="seed_workflow", logger_backends=["console"],
    tokenizer_path="smollm2-135m-instruct",
    batch_size=4, rollout_n=4, num_epochs=1, num_steps=3, save_freq=100, test_freq=3, val_batch_size=8,
    temperature=1.0, top_p=1.0, max_new_tokens=16, max_prompt_tokens=256,
    algorithm="agent_loop", adv_estimator="grpo",
    lora=SimpleNamespace(lora_rank=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lr=1e-3),
    interaction=SimpleNamespace(name="addition", config=SimpleNamespace(max_steps=1)),
    multi_turn=SimpleNamespace(max_user_turns=0, max_assistant_turns=1, max_tokens_per_turn=16),
    num_gpus=8,
    model_path=None, data_path=None, max_samples=8,
    output_path=os.path.join(tempfile.gettempdir(), "opentinker_seed_workflow", "results.jsonl"),
)
GomokuGame = MathGame = AdditionGame  # the page's snippets name upstream's games; ours is addition

# the URL: $OPENTINKER_API_URL, else (None) the local `opentinker up` stack's; the key:
# $OPENTINKER_API_KEY, else the local stack's admin key (the clients' default)
server_url = scheduler_url = os.environ.get("OPENTINKER_API_URL")


def main() -> None:
    global server_url
    # ---- Training Workflow (verbatim from the project page) ----
    # 1. Submit Job via Scheduler
    scheduler = SchedulerClient(url=server_url)
    job_result = scheduler.submit_job(config=args, num_gpus=8)
    job_id, server_url = job_result["job_id"], job_result["server_url"]

    # 2. Initialize Environment
    env = GameEnvironment(
        game_class=GomokuGame,
        config=args,
        job_id=job_id
    )

    # 3. Connect & Train
    client = ServiceClient(server_url=server_url)
    client.set_config(args, env)
    client.fit(env=env, num_epochs=args.num_epochs)

    # ---- Inference Workflow (verbatim, plus max_samples: without data_path the samples
    # are generated, and upstream's run_inference then needs it too) ----
    args.model_path = job_id  # the trained job's policy
    # 1. Submit Inference Job
    scheduler = InferenceSchedulerClient(url=scheduler_url)
    job_result = scheduler.submit_inference_job(
        model_path=args.model_path,
        num_gpus=args.num_gpus
    )
    job_id, vllm_server_url = job_result["job_id"], job_result["vllm_server_url"]

    # 2. Run Inference via Pipeline
    run_inference(
        vllm_server_url=vllm_server_url,
        data_path=args.data_path,
        game_class=MathGame,
        job_id=job_id,
        output_path=args.output_path,
        max_samples=args.max_samples,
    )
    scheduler.complete_job(job_id)  # stop serving (also done at exit)
    print(f"results: {args.output_path}")


if __name__ == "__main__":
    main()
