"""Inference on a game against an OpenAI-compatible endpoint, at upstream OpenTinker's
import path: `run_inference` (github.com/open-tinker/OpenTinker,
opentinker/environment/inference_pipeline.py: same signature, defaults, JSONL records
and printed summary).

The episode loop runs here, in the caller's process: the game class (with its
`game_kwargs`) is constructed per sample, the model is asked through the endpoint's
`/chat/completions` (system prompt, first user message, then assistant turns and the
game's observations as user turns), and each result is appended to `output_path` as one
JSON line as soon as it ends. The endpoint is normally an inference job of this service
(InferenceSchedulerClient.submit_inference_job: its bearer token is found here by job
id), or any OpenAI-compatible server (`api_key=` for its token).

What differs from upstream: there is no env server (`env_endpoint` is not used: the
game runs here) and no local tokenizer: token budgets use the endpoint's `usage`
counts, and `prompt_text` renders the opening messages in ChatML (the template of
SmolLM2 and Qwen), not with the model's own chat template. Offline mode (a local vLLM,
`model_path` without `vllm_server_url`) is refused: submit an inference job instead.
"""

from __future__ import annotations

import inspect
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import uuid4

from rich.progress import track

from opentinker.environment.base_game import AbstractGame, StepResult, opening
from opentinker.environment.game_stats_client import record_episode
from opentinker.environment.static_data_generator import StaticDatasetGenerator

# job id -> (base URL, bearer token, model) of the inference endpoints this process
# submitted (client/utils/http_training_client.py registers them)
_ENDPOINTS: dict[str, tuple[str, str, str]] = {}
INFER_SPLIT = "test"  # the split a seeded generate_initial_state(seed, split) gets here


def register_endpoint(job_id: str, url: str, token: str, model: str) -> None:
    """Remember an inference job's endpoint so `run_inference(job_id=...)` finds its
    URL and token."""
    _ENDPOINTS[job_id] = (url, token, model)


def forget_endpoint(job_id: str) -> None:
    _ENDPOINTS.pop(job_id, None)


@dataclass
class InferenceResult:
    """One sample's trajectory (upstream's record). `reward` sums the step rewards;
    `num_turns` counts assistant and env turns; `info` = {"env_info": [step info, ...]}.
    `final_reward` (the last step's reward) and `env_steps` are kept for the game
    statistics (game_stats_client.py), not written to the JSONL."""

    sample_id: str
    messages: list[dict[str, Any]]
    prompt_text: str
    response_text: str
    reward: float
    done: bool
    num_turns: int
    ground_truth: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    final_reward: float = 0.0
    env_steps: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The JSONL record, in upstream's key order."""
        return {"sample_id": self.sample_id, "prompt_text": self.prompt_text, "response_text": self.response_text,
                "reward": self.reward, "done": self.done, "num_turns": self.num_turns,
                "ground_truth": self.ground_truth, "info": self.info, "messages": self.messages}


def game_initial_state(game: AbstractGame, seed: int, split: str = INFER_SPLIT) -> dict[str, Any]:
    """The state for `reset`: `generate_initial_state(seed=, split=)` when it takes a
    seed, else Python's `random` seeded with `seed` and the argument-free call (as the
    envhost does for training)."""
    make = game.generate_initial_state
    params = inspect.signature(make).parameters
    if "seed" in params:
        state = make(seed=seed, split=split) if "split" in params else make(seed=seed)
    else:
        random.seed(seed)
        state = make()
    if not isinstance(state, dict):
        raise TypeError(f"generate_initial_state must return a dict, got {type(state).__name__}")
    return state


def game_opening(game: AbstractGame, state: dict[str, Any]) -> tuple[str, str]:
    """Reset `game` to `state`; returns (system prompt, first user message) as the
    envhost builds them for training (services/envhost/service.py `open_episode`): the
    class's own `get_user_message_with_state` (asked before `reset`), else the initial
    user message and the first observation."""
    return opening(game, state)


def generate_samples(game_class: type[AbstractGame], num_samples: int, seed: int = 42,
                     **game_kwargs: Any) -> list[dict[str, Any]]:
    """`num_samples` samples of a game without data: sample i from seed `seed + i`
    (upstream's GameDataGenerator), as {"prompt", "env_kwargs", "data_source"}."""
    out = []
    for i in range(num_samples):
        game = game_class(**game_kwargs)
        state = game_initial_state(game, seed + i)
        system, user = game_opening(game, state)
        prompt = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        out.append({"prompt": prompt, "env_kwargs": state, "data_source": game.get_interaction_name()})
    return out


def load_samples(data_path: str | None, game_class: type[AbstractGame], max_samples: int | None = None,
                 **game_kwargs: Any) -> list[dict[str, Any]]:
    """The first `max_samples` rows of `data_path` in file order (static_data_generator's
    rules), or `max_samples` generated samples when `data_path` is None. Raises
    ValueError when neither is given."""
    if data_path is None:
        if not max_samples:
            raise ValueError("max_samples is required when data_path is None (samples are generated)")
        return generate_samples(game_class, max_samples, **game_kwargs)
    game = game_class(**game_kwargs)
    gen = StaticDatasetGenerator([data_path], interaction_name=game.get_interaction_name(), shuffle=False,
                                 system_prompt=game.get_system_prompt())
    n = len(gen) if max_samples is None else min(max_samples, len(gen))
    print(f"Loaded {n} samples from {data_path}")
    return [gen.generate_sample(i) for i in range(n)]


def chatml(messages: list[dict[str, Any]]) -> str:
    """Messages in ChatML with the assistant's turn opened (prompt_text's rendering)."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"


class ChatEndpoint:
    """An OpenAI-compatible `/chat/completions` (base URL with or without `/v1`)."""

    def __init__(self, url: str, token: str = "", model: str = "", timeout_s: float = 600.0):
        import httpx

        base = url.rstrip("/")
        self.base = base if base.endswith("/v1") else base + "/v1"
        self.model = model
        self.http = httpx.Client(timeout=timeout_s, transport=httpx.HTTPTransport(retries=3),
                                 headers={"Authorization": f"Bearer {token}"} if token else {})

    def complete(self, messages: list[dict[str, Any]], temperature: float, top_p: float,
                 max_tokens: int) -> tuple[str, dict[str, int]]:
        """The reply's text and `usage`. Raises RuntimeError with the endpoint's error."""
        r = self.http.post(f"{self.base}/chat/completions", json={
            "model": self.model, "messages": messages, "temperature": temperature, "top_p": top_p,
            "max_tokens": max_tokens})
        if r.status_code == 401:
            raise RuntimeError(f"{self.base} refused the bearer token (401): pass api_key=, or submit the job "
                               "with InferenceSchedulerClient in this process and pass its job_id")
        if r.status_code != 200:
            raise RuntimeError(f"{self.base}/chat/completions answered {r.status_code}: {r.text[:500]}")
        body = r.json()
        text = body["choices"][0]["message"].get("content") or ""
        return text, dict(body.get("usage") or {})

    def close(self) -> None:
        self.http.close()


def run_episode(endpoint: ChatEndpoint, game: AbstractGame, messages: list[dict[str, Any]],
                env_kwargs: dict[str, Any], sample_id: str, temperature: float = 0.0, top_p: float = 1.0,
                max_tokens: int = 4096, max_tokens_per_turn: int | None = None, max_user_turns: int = 0,
                max_assistant_turns: int = 1, max_context_length: int = 30000) -> InferenceResult:
    """One sample's episode (upstream's `run_single_inference`): `game.reset(**env_kwargs)`,
    then generate -> step until done, `max_assistant_turns`, the total response budget
    `max_tokens`, the context limit, or `max_user_turns` env turns (0: no limit on them)."""
    conversation = list(messages)
    game.reset(**env_kwargs)
    user_turns = assistant_turns = used = 0
    reward, last, done, infos = 0.0, 0.0, False, []
    while not done:
        if max_assistant_turns and assistant_turns >= max_assistant_turns:
            break
        if used >= max_tokens:
            print(f"⚠ Total response tokens ({used}) reached limit ({max_tokens}), ending")
            break
        remaining = max_tokens - used
        text, usage = endpoint.complete(conversation, temperature, top_p,
                                        min(max_tokens_per_turn or remaining, remaining))
        used += int(usage.get("completion_tokens") or len(text.split()))
        assistant_turns += 1
        conversation.append({"role": "assistant", "content": text})
        if max_user_turns and user_turns >= max_user_turns:
            break
        r = game.step(text)
        if not isinstance(r, StepResult):
            raise TypeError(f"step must return StepResult, got {type(r).__name__}")
        reward += float(r.reward)
        last = float(r.reward)
        done = bool(r.done)
        infos.append(dict(r.info or {}))
        user_turns += 1
        if done:
            break
        if r.observation and str(r.observation).strip():
            conversation.append({"role": "user", "content": str(r.observation)})
        context = int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)
        if context > max_context_length:
            print(f"⚠ Context length ({context}) exceeds limit ({max_context_length}), ending game")
            break
    return InferenceResult(
        sample_id=sample_id, messages=conversation, prompt_text=chatml(messages),
        response_text="\n".join(m["content"] for m in conversation if m["role"] == "assistant"),
        reward=reward, done=done, num_turns=user_turns + assistant_turns,
        ground_truth=env_kwargs.get("ground_truth"), info={"env_info": infos}, final_reward=last,
        env_steps=len(infos))


def run_inference(model_path: str | None = None, data_path: str | None = None,
                  game_class: type[AbstractGame] | None = None, env_endpoint: str = "http://localhost:8088",
                  job_id: str = "default", vllm_server_url: str | None = None, tokenizer_path: str | None = None,
                  output_path: str | None = None, temperature: float = 0.0, top_p: float = 1.0,
                  max_tokens: int = 4096, max_tokens_per_turn: int | None = None, max_samples: int | None = None,
                  max_user_turns: int = 0, max_assistant_turns: int = 1, max_context_length: int = 30000,
                  tensor_parallel_size: int = 1, api_key: str | None = None,
                  **game_kwargs: Any) -> list[InferenceResult]:
    """Run `game_class` on the samples of `data_path` (or `max_samples` generated ones)
    against an OpenAI-compatible endpoint; upstream OpenTinker's `run_inference`.

    The endpoint: `vllm_server_url`, else the one registered for `job_id` (or for
    `model_path` when it names one) by InferenceSchedulerClient in this process; the
    bearer token: `api_key`, else the registered one. `env_endpoint` and
    `tensor_parallel_size` are accepted and unused (the game runs here); each episode is
    recorded under `job_id` for GameStatsClient. Writes one JSON
    line per sample to `output_path` (truncated first), prints upstream's summary.

    Returns the InferenceResults in sample order. Raises ValueError without a game class
    or an endpoint, RuntimeError when the endpoint refuses a request.
    """
    if game_class is None:
        raise ValueError("game_class is required")
    url, token, model = _ENDPOINTS.get(job_id) or _ENDPOINTS.get(model_path or "") or ("", "", "")
    url = vllm_server_url or url
    if not url:
        raise ValueError("no endpoint: pass vllm_server_url (an OpenAI-compatible base URL), or submit an "
                         "inference job with InferenceSchedulerClient.submit_inference_job in this process and "
                         "pass its job_id; offline mode (a local vLLM from model_path) is not supported here")
    samples = load_samples(data_path, game_class, max_samples, **game_kwargs)
    endpoint = ChatEndpoint(url, api_key if api_key is not None else token, model or tokenizer_path or model_path or "")
    if output_path:
        Path(output_path).parent.mkdir(parents=True, exist_ok=True)
        open(output_path, "w").close()
    start = time.time()
    results: list[InferenceResult] = []
    try:
        for sample in track(samples, description="Inference", disable=not sys.stdout.isatty()):
            result = run_episode(endpoint, game_class(**game_kwargs), sample["prompt"], sample.get("env_kwargs", {}),
                                 uuid4().hex, temperature, top_p, max_tokens, max_tokens_per_turn, max_user_turns,
                                 max_assistant_turns, max_context_length)
            results.append(result)
            record_episode(job_id, result.final_reward, result.reward, result.env_steps, result.done)
            if output_path:
                with open(output_path, "a") as f:
                    f.write(json.dumps(result.to_dict(), ensure_ascii=False, default=str) + "\n")
    finally:
        endpoint.close()
    elapsed = time.time() - start
    rewards = [r.reward for r in results]
    n = max(1, len(results))
    correct = sum(1 for r in rewards if r > 0.5)
    print(f"\n{'=' * 50}")
    print(f"Inference Complete: {len(results)} samples in {elapsed:.1f}s")
    print(f"Mean reward: {sum(rewards) / n:.4f}")
    print(f"Accuracy: {correct}/{len(results)} ({100 * correct / n:.1f}%)")
    return results
