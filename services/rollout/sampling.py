"""A rollout worker's Tinker sampling: the TinkerSamples of a Tinker API sampling session.

A sampling session is an inference job placed on this worker; the tinker service sends
its `sample` calls as TinkerSample messages on the job's rollout subject (beside
RolloutRequests; the Ot-Schema header tells them apart). Each is served like the
OpenAI endpoint's completions (openai_api.py): the sampling session's weights (named
in the request; the base model without) on this worker's engine for the job's model,
prompt token ids checked against the model's vocabulary first,
under the engine slot's lock; `num_samples` completions
of the raw prompt tokens, cut at the first stop token or stop string (inclusive) once
the lock is released (cut_at_stop); with
`prompt_logprobs`, the prompt's token logprobs under the same policy (and with
`topk_prompt_logprobs`, the k most likely tokens at each position). The answer,
or the reason there is none, goes to `ot.job.<sampler>.results.<seq_id>` (OT_TINKER),
where the tinker service reads it; then the request is acked.

Admission as for rollout requests: a job not placed on this worker, or not an
inference job, is dead-lettered; a finished job's request is acked and dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

import msgspec
import nats.errors
from nats.aio.msg import Msg

from opentinker.schemas import SamplingParams
from opentinker.schemas import subjects as S
from opentinker.schemas.tinker import TOPK_MASK_LOGPROB, SampledSequence, TinkerSample, TinkerSamples
from opentinker.services.rollout.weights import WeightsError

if TYPE_CHECKING:
    from opentinker.services.rollout.service import RolloutWorker

log = logging.getLogger("opentinker.rollout.sampling")

IN_PROGRESS_EVERY_S = 15.0


def is_sample(m: Msg) -> bool:
    return (m.headers or {}).get(S.H_SCHEMA) == "TinkerSample"


def cut_at_stop(out: Any, req: TinkerSample, tokenizer: Any) -> SampledSequence:
    """One engine completion (agent_loop.GenOut) ended at the first of `req`'s stop
    tokens or stop strings (that token included), else as the engine ended it.

    A stop string ends the completion at the first token whose text, decoded with all
    before it, holds the string. The completion is decoded once; only when that text
    holds a stop string is that first token found, by bisection over prefixes (a
    prefix's text holding a string implies every longer one does): at most
    1 + log2(len) decodes per completion, whatever the number of stop strings
    (a per-token re-decode of the whole prefix per string was quadratic in the
    completion's length times the strings)."""
    ids = out.token_ids
    stops = set(req.stop_tokens)
    end = next((i + 1 for i, t in enumerate(ids) if t in stops), None)
    if req.stop_strings:
        upto = ids[:end] if end is not None else ids

        def holds(n: int) -> bool:
            text = tokenizer.decode(upto[:n])
            return any(s in text for s in req.stop_strings)

        if upto and holds(len(upto)):
            lo, hi = 1, len(upto)  # the answer is in [lo, hi]
            while lo < hi:
                mid = (lo + hi) // 2
                if holds(mid):
                    hi = mid
                else:
                    lo = mid + 1
            end = lo
    if end is not None:
        return SampledSequence(tokens=ids[:end], logprobs=out.logprobs[:end], stop_reason="stop")
    return SampledSequence(tokens=ids, logprobs=out.logprobs,
                           stop_reason="stop" if out.finish_reason == "stop" else "length")


def out_of_vocab(ids: list[int], tokenizer: Any) -> str:
    """Why token ids `ids` may not reach the engine (the first one outside the model's
    vocabulary, [0, len(tokenizer))), or "". An engine given such an id raises deep
    inside (an IndexError in an embedding, vLLM's validation error)."""
    vocab = len(tokenizer)
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    return "" if bad is None else f"token id {bad} is out of the model's vocabulary (0 to {vocab - 1})"


def sample_blocking(engine: Any, req: TinkerSample) -> tuple[list[Any], list[float], dict[str, Any]]:
    """The engine's completions (agent_loop.GenOut, not yet cut at the stops), (when
    asked) prompt logprobs and top-k prompt logprobs (TinkerSamples' topk_* fields, {}
    when not asked) of `req` on `engine`. Raises ValueError for a prompt that leaves no
    room under the engine's max_model_len."""
    why = out_of_vocab(req.tokens, engine.tokenizer)
    if why:
        raise ValueError(f"prompt: {why}")
    room = engine.max_model_len - len(req.tokens)
    if not req.tokens or room < 1:
        raise ValueError(f"prompt: {len(req.tokens)} tokens (1 to {engine.max_model_len - 1} on this worker)")
    n = min(req.max_tokens, room)
    sp = SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, max_new_tokens=n,
                        max_total_tokens=len(req.tokens) + n)
    outs = engine.generate([list(req.tokens)] * req.num_samples, sp)
    prompt: list[float] = []
    topk: dict[str, Any] = {}
    cut = len(req.tokens) - req.prompt_logprobs_last_n if req.prompt_logprobs_last_n else 0
    if req.topk_prompt_logprobs:
        scores, ids, lps = engine.prompt_logprobs_topk(list(req.tokens), req.topk_prompt_logprobs)
        ids[:cut], lps[:cut] = 0, TOPK_MASK_LOGPROB  # Tinker's prompt_logprobs_last_n applies to them too
        topk = {"topk_k": req.topk_prompt_logprobs, "topk_ids": ids.astype("<i4").tobytes(),
                "topk_logprobs": lps.astype("<f4").tobytes()}
    elif req.prompt_logprobs:
        scores = engine.prompt_logprobs([list(req.tokens)])[0]
    if req.prompt_logprobs:
        prompt = [float("nan") if x is None else x for x in scores]
        if cut:  # Tinker's prompt_logprobs_last_n: the suffix only
            prompt = [float("nan")] * cut + prompt[cut:]
    return outs, prompt, topk


async def serve_sample(worker: RolloutWorker, m: Msg) -> None:
    """Answer one TinkerSample message (module docstring); it always ends acked or
    dead-lettered, except on shutdown (redelivered)."""
    bus = worker.bus
    req = await bus.decode_or_dead_letter(m, TinkerSample)
    if req is None:
        return
    try:
        S.tinker_result(req.sampler, 0)  # a sampler id is a job-id-shaped subject token
    except ValueError as e:
        why = f"`sampler`: {e}"
    else:
        why = "" if S.job_id_of(m.subject) == req.job_id else f"job {req.job_id!r} arrived on {m.subject}"
    if why:
        await bus.dead_letter(m, f"TinkerSample: {why}")
        await m.term()
        return
    try:
        got = await bus.job_record(req.job_id)
    except msgspec.MsgspecError as e:
        got, why = None, f"unreadable JobRecord ({e})"
    else:
        why = f"no job {req.job_id!r}"
    rec = got[0] if got else None
    if rec is not None and rec.state.terminal:
        log.info("sample %s of job %s: the job is %s; dropped", req.seq_id, req.job_id, rec.state.value)
        await m.ack()
        return
    if rec is not None:
        why = ("" if rec.kind == "inference" and rec.placement is not None and worker.worker in rec.placement.rollout
               and rec.attempt == req.attempt
               else f"job {req.job_id} is not an inference job placed on {worker.worker} at attempt {req.attempt}")
    if why:
        await bus.dead_letter(m, f"TinkerSample refused: {why}")
        await m.term()
        return
    answer = {"sampler": req.sampler, "seq_id": req.seq_id, "record_key": req.record_key}
    beat = asyncio.create_task(_in_progress(m))
    try:
        slot = await worker.engine_for_model(rec.spec.model, rec.spec.engine, rec.spec.sampler_dtype,
                                             rec.spec.dtype)
        async with slot.lock:
            version = await worker.policies.ensure_weights(slot, req.sampler, req.weights)
            outs, prompt, topk = await asyncio.get_running_loop().run_in_executor(
                slot.executor, sample_blocking, slot.engine, req)
        # the stops are matched after the engine's lock is released (the engine slot is
        # shared by every job of this base model)
        seqs = await asyncio.to_thread(lambda: [cut_at_stop(o, req, slot.engine.tokenizer) for o in outs])
        result = TinkerSamples(**answer, sequences=seqs, prompt_logprobs=prompt, policy_version=version, **topk)
    except ValueError as e:
        result = TinkerSamples(**answer, error=str(e), category="user")
    except (OSError, RuntimeError, ImportError, WeightsError) as e:  # the model, the engine or the weights failed
        log.exception("sample %s of job %s failed", req.seq_id, req.job_id)
        result = TinkerSamples(**answer, error=f"{type(e).__name__}: {e}", category="server")
    except Exception as e:  # anything else the request's content set off fails that request, not the worker
        log.exception("sample %s of job %s failed", req.seq_id, req.job_id)
        result = TinkerSamples(**answer, error=f"{type(e).__name__}: {e}", category="user")
    finally:
        beat.cancel()
    await bus.publish(S.tinker_result(req.sampler, req.seq_id), result, msg_id=f"{req.sampler}:result{req.seq_id}")
    await m.ack()


async def _in_progress(m: Msg) -> None:
    while True:
        await asyncio.sleep(IN_PROGRESS_EVERY_S)
        with contextlib.suppress(nats.errors.Error):
            await m.in_progress()
