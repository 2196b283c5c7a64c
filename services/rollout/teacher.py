"""On-policy distillation on the rollout worker: the teacher scores the policy's tokens.

After an episode of a request that names a teacher (RolloutRequest.teacher, from the
job spec's `teacher`), the worker puts the teacher's weights in the engine and asks the
engine for the prompt logprobs of the episode's tokens (no generation): each policy
token's logprob under the teacher, temperature 1, becomes Trajectory.teacher_logprobs;
the learner turns log pi_sampler - log pi_teacher into the token's advantage
(batching.distill_advantages). This is the cookbook's on-policy distillation
(tinker-cookbook, tinker_cookbook/distillation/train_on_policy.py: the teacher's
`compute_logprobs` on the student's samples), served by the worker that sampled them.

The teacher reads the policy's first prompt, or its own (`teacher_prompt`: with the
env's privileged context after the user message, on-policy self-distillation, OPSD
arXiv 2601.18734), then every token after it as the policy produced and read them.

A teacher of another model (`teacher = "model"`, e.g. a larger one of the student's
family, as the cookbook's recipe distils Qwen3-8B into a smaller Qwen3) scores on an
engine of its own (`score_by_model`, the rollout service's), after
`check_teacher_vocab`: it reads the student's token ids, so the two must share one
vocabulary.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor
from typing import Any

from opentinker.schemas import EnvResetReply
from opentinker.schemas.rollout import TEACHER_MISMATCH
from opentinker.services.core import tracing

# teacher = "model": (teacher model, sequences, **vision) -> each sequence's prompt logprobs
ScoreByModel = Callable[..., Awaitable[list[list[float]]]]


def check_teacher_vocab(student: Any, teacher: Any, teacher_model: str) -> None:
    """Raise ValueError (starting with TEACHER_MISMATCH) unless the tokenizers `student`
    and `teacher` (transformers tokenizers) map every token to the same id: the teacher
    scores the student's token ids, so a different vocabulary would score other text."""
    a, b = student.get_vocab(), teacher.get_vocab()
    if a != b:
        differ = sorted(set(a.items()) ^ set(b.items()))[:3]
        raise ValueError(f"{TEACHER_MISMATCH}{teacher_model[:200]!r} has another vocabulary than the student's "
                         f"model ({len(b)} tokens against {len(a)}; e.g. {differ}): a teacher scores the "
                         "student's token ids, so it needs the student's tokenizer")


def teacher_prompt(renderer: Any, env: str, reply: EnvResetReply) -> list[int]:
    """The teacher's first prompt with privileged context: the policy's [system,] user
    messages, the user message followed by a blank line and `reply.privileged_context`,
    rendered by `renderer` (agent_loop.ChatRenderer) with the generation prompt.
    Raises ValueError when the env gave no context, or images the model cannot take."""
    if not reply.privileged_context:
        raise ValueError(f"teacher_context = 'privileged', but env {env!r} gave no privileged context "
                         "(its get_privileged_context() returned \"\")")
    messages = renderer.opening(reply.system_prompt, f"{reply.user_message}\n\n{reply.privileged_context}",
                                len(reply.images))
    return renderer.prompt_ids(messages, reply.tools, reply.images)


async def score_by_teachers(engine: Any, executor: Executor | None, episodes: Sequence[Any],
                            policy_version: Callable[..., Awaitable[int]],
                            engine_lock: asyncio.Lock | None = None,
                            score_by_model: ScoreByModel | None = None) -> None:
    """Fill `teacher_logprobs` ([len(token_ids)]: the teacher's logprob of each policy
    token, 0.0 elsewhere) of the ended `episodes` (agent_loop._Episode) whose request names
    a teacher; one engine call (`engine.prompt_logprobs`, in `executor`) per teacher,
    under `engine_lock` (None: the caller holds the engine). The teacher's weights:
    `policy_version(teacher_job)` (another job's newest), `policy_version(base=True)`
    (the model's own) or `policy_version()` (the job's current policy); a teacher of
    another model (`teacher_model`) scores through `score_by_model(teacher_model, seqs)`
    instead. Episodes that ended on an error, or hold no policy token, are not scored;
    one whose teacher sequence does not fit the engine (max_model_len), or whose teacher
    model cannot score (no `score_by_model`; another vocabulary: check_teacher_vocab's
    ValueError), ends with an error naming it. Engine and weight errors raise."""
    by_teacher: dict[tuple[str, str, str], list[Any]] = {}
    for e in episodes:
        if e.req.teacher != "none" and not e.error and any(e.loss_mask):
            by_teacher.setdefault((e.req.teacher, e.req.teacher_job, e.req.teacher_model), []).append(e)
    for (teacher, job, model), group in sorted(by_teacher.items()):
        seqs = []
        for e in list(group):
            prompt = e.teacher_prompt if e.teacher_prompt is not None else e.token_ids[:e.prompt_len]
            seq = prompt + e.token_ids[e.prompt_len:]
            if len(seq) >= engine.max_model_len:
                e.error = (f"teacher: the teacher's sequence has {len(seq)} tokens, at or over the engine's "
                           f"max_model_len {engine.max_model_len}")
                group.remove(e)
            else:
                seqs.append(seq)
        if not group:
            continue
        vision = {"images": [e.images for e in group]} if any(e.images for e in group) else {}
        if teacher == "model":
            try:
                if score_by_model is None:
                    raise ValueError(f"{TEACHER_MISMATCH}this rollout cannot load a teacher model")
                with tracing.span("rollout.teacher_score", attrs={"ot.prompts": len(seqs), "ot.teacher": teacher},
                                  links=[tracing.link(e.span) for e in group]):
                    scored = await score_by_model(model, seqs, **vision)
            except ValueError as err:  # the spec's teacher cannot score these tokens
                for e in group:
                    e.error = str(err)
                continue
        else:
            async with engine_lock or contextlib.nullcontext():
                version = await (policy_version(job) if teacher == "job" else
                                 policy_version(base=True) if teacher == "base" else policy_version())
                with tracing.span("rollout.teacher_score", attrs={"ot.prompts": len(seqs), "ot.teacher": teacher,
                                                                  "ot.policy_version": version},
                                  links=[tracing.link(e.span) for e in group]):
                    scored = await asyncio.get_running_loop().run_in_executor(
                        executor, functools.partial(engine.prompt_logprobs, **vision), seqs)
        for e, seq, lps in zip(group, seqs, scored):
            shift = len(seq) - len(e.token_ids)  # the teacher's first prompt's length minus the policy's
            e.teacher_logprobs = [float(lps[j + shift]) if m else 0.0 for j, m in enumerate(e.loss_mask)]
