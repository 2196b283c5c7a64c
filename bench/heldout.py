"""Held-out evaluation of a trained policy in this process, on the transformers engine,
for every system of bench/e2e_grpo.py alike (TRL's model and OpenTinker's final adapters).

Two measures on the env's `test` split:

- greedy: the learner's own evaluation requests (evaluation.Evaluator: its seeds, split
  and eval temperature), so TRL is measured exactly as OpenTinker measures itself;
- sampled pass@1: every distinct test problem the first `max_seeds` eval seeds draw, k
  samples each at the training temperature; pass@1 is the mean over problems of the
  fraction correct (the unbiased pass@k estimator at k = 1, Chen et al. 2021, arXiv
  2107.03374; DeepSeek-R1, arXiv 2501.12948, reports pass@1 this way because greedy
  decoding of a small set is too coarse to rank models: on single-digit addition one
  problem moves greedy accuracy by several points). Its standard error is in
  e2e_report.pass1_summary.
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
from pathlib import Path
from typing import Any


class InProcessEnv:
    """The agent loop's EnvClient on the env's own code, in this process (what envhost
    runs for each request, without NATS)."""

    def __init__(self, cls):
        self.cls = cls
        self.games: dict[str, Any] = {}

    async def init(self, req):
        from opentinker.schemas import EnvInitReply
        from opentinker.services.envhost.service import initial_state

        return EnvInitReply(state=initial_state(self.cls, req.env_args, req.seed, req.split))

    async def reset(self, req):
        from opentinker.schemas import EnvResetReply
        from opentinker.services.envhost.service import open_episode

        game, system, user, tools = open_episode(self.cls, req.env_args, req.state)
        self.games[req.episode_id] = game
        return EnvResetReply(host_id="in-process", system_prompt=system, user_message=user, tools=tools)

    async def step(self, host_id, req):
        from opentinker.services.envhost.service import take_step

        reply = take_step(self.games[req.episode_id], req.action)
        if reply.done:
            self.games.pop(req.episode_id, None)
        return reply

    async def close(self, host_id, req):
        self.games.pop(req.episode_id, None)


def run_requests(engine, spec, reqs, version: int) -> tuple[list[list], float]:
    """`reqs` run by the rollout's agent loop on `engine` against the env's own code in
    this process: (one group of trajectories per request, in order; wall seconds)."""
    from opentinker.services.envhost.registry import BUILTIN
    from opentinker.services.rollout.agent_loop import AgentLoop

    loop = AgentLoop(engine, InProcessEnv(BUILTIN[spec.env]), worker="bench")

    async def policy_version() -> int:
        return version

    t0 = time.perf_counter()
    groups = asyncio.run(loop.run(reqs, policy_version))
    return groups, time.perf_counter() - t0


def evaluate_in_process(engine, spec, version: int) -> dict[str, float]:
    """The learner's evaluation of policy `version` (evaluation.Evaluator's requests:
    same seeds, split and sampling), run by the rollout's agent loop on `engine`."""
    from opentinker.schemas.stats import episode_stats
    from opentinker.services.learner.evaluation import Evaluator

    reqs = Evaluator("bench-trl", spec).requests(version)
    groups, seconds = run_requests(engine, spec, reqs, version)
    stats = episode_stats([t for g in groups for t in g])
    stats["eval_time_s"] = seconds
    stats["problems"] = per_problem(spec, reqs, groups)
    return stats


def per_problem(spec, reqs, groups) -> dict[str, list[int]]:
    """The evaluation by distinct problem: its initial state (JSON) -> [correct, episodes].
    A small test split draws each problem several times among the eval seeds."""
    from opentinker.services.envhost.registry import BUILTIN
    from opentinker.services.envhost.service import initial_state

    out: dict[str, list[int]] = {}
    for req, group in zip(reqs, groups):
        key = json.dumps(initial_state(BUILTIN[spec.env], spec.env_args, req.group_seed, req.split), sort_keys=True)
        tally = out.setdefault(key, [0, 0])
        tally[0] += sum(1 for t in group if t.reward >= 1.0)
        tally[1] += len(group)
    return out


def evaluate_adapter(model_path: str, adapter_dir: Path, spec, version: int,
                     pass1_k: int = 0, device: str = "cpu") -> tuple[dict[str, Any], dict[str, Any] | None]:
    """An OpenTinker job's final LoRA adapter (the learner's `final` checkpoint, peft's
    format), merged into the base model and evaluated exactly as TRL's model is
    (evaluate_in_process on the transformers engine), so the held-out comparison uses
    one engine for every system. Returns (greedy, sampled pass@1 with `pass1_k` samples
    a problem, or None when pass1_k is 0)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from opentinker.services.rollout.engine_hf import HFEngine

    engine = HFEngine(model_path, seed=spec.seed, device=device)
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32),
                                       str(adapter_dir)).merge_and_unload()
    params = dict(engine.model.named_parameters())
    with torch.no_grad():
        engine.load_weights({k: v.detach().float() for k, v in merged.state_dict().items() if k in params})
    del merged
    greedy = evaluate_in_process(engine, spec, version)
    pass1 = sampled_pass1(engine, spec, version, pass1_k) if pass1_k else None
    del engine
    gc.collect()
    return greedy, pass1


def distinct_problems(spec, max_seeds: int = 256) -> dict[str, int]:
    """The distinct `spec.eval_split` problems among the first `max_seeds` eval seeds:
    initial state (JSON) -> the first eval seed that draws it."""
    from opentinker.services.envhost.registry import BUILTIN
    from opentinker.services.envhost.service import initial_state
    from opentinker.services.learner.evaluation import eval_seed

    out: dict[str, int] = {}
    for i in range(max_seeds):
        seed = eval_seed(spec.seed, i)
        out.setdefault(json.dumps(initial_state(BUILTIN[spec.env], spec.env_args, seed, spec.eval_split),
                                  sort_keys=True), seed)
    return out


def sampled_pass1(engine, spec, version: int, k: int, max_seeds: int = 256) -> dict[str, Any]:
    """Every distinct held-out problem (distinct_problems), `k` samples each at the
    training sampling (temperature, top_p), on `engine` through the rollout's agent loop.
    Returns {"problems": {state: [correct, k]}, "eval_time_s": seconds}; correct means
    reward >= 1 (arith: the answer is right)."""
    import msgspec

    from opentinker.services.learner.evaluation import Evaluator

    template = Evaluator("bench-pass1", spec).requests(version)[0]
    reqs = [msgspec.structs.replace(template, request_id=f"bench-pass1-{i}", group_index=i, group_seed=seed,
                                    group_size=k, sampling=spec.sampling)
            for i, seed in enumerate(distinct_problems(spec, max_seeds).values())]
    groups, seconds = run_requests(engine, spec, reqs, version)
    return {"problems": per_problem(spec, reqs, groups), "eval_time_s": seconds}
