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
`topk_prompt_logprobs`, the k most likely tokens at each position; with
`topk_sample_logprobs`, those at each sampled position, from one more pass over
prompt + completion, sample_topk). The answer,
or the reason there is none, goes to `ot.job.<sampler>.results.<seq_id>` (OT_TINKER),
where the tinker service reads it; then the request is acked. The requests of one
fetched batch for the same sampling session and weights (batch_key) share one engine
call, each prompt with its own parameters (samples_blocking): a loop that sends many
`sample` calls at once, as an RL loop does, has them decoded together.

Admission as for rollout requests: a job not placed on this worker, or not an
inference job, is dead-lettered; a finished job's request is acked and dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

import msgspec
import nats.errors
import numpy as np
from nats.aio.msg import Msg

from opentinker.schemas import JobRecord, SamplingParams
from opentinker.schemas import subjects as S
from opentinker.schemas.tinker import TOPK_MASK_LOGPROB, SampledSequence, TinkerSample, TinkerSamples
from opentinker.schemas.stats import derived_seed
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


def sample_params(engine: Any, req: TinkerSample) -> SamplingParams:
    """The engine's sampling parameters for `req`. Raises ValueError for a prompt token
    outside the vocabulary, or a prompt that leaves no room under max_model_len (with
    topk_sample_logprobs, one token less: the scoring pass over prompt + completion
    must fit a vLLM engine, which needs room for a token after it)."""
    why = out_of_vocab(req.tokens, engine.tokenizer)
    if why:
        raise ValueError(f"prompt: {why}")
    room = engine.max_model_len - len(req.tokens) - (1 if req.topk_sample_logprobs else 0)
    if not req.tokens or room < 1:
        raise ValueError(f"prompt: {len(req.tokens)} tokens (1 to {engine.max_model_len - 1} on this worker)")
    n = min(req.max_tokens, room)
    return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, max_new_tokens=n,
                          max_total_tokens=len(req.tokens) + n)


def prompt_scores(engine: Any, req: TinkerSample) -> tuple[list[float], dict[str, Any]]:
    """(When asked) `req`'s prompt logprobs and top-k prompt logprobs (TinkerSamples'
    topk_* fields; [] and {} when not asked) on `engine`."""
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
    return prompt, topk


def sample_topk(engine: Any, prompt: list[int], completion: list[int], k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k most likely tokens of the raw distribution (temperature 1, no top-p or
    top-k, as topk_prompt_logprobs) at each of `completion`'s n positions after
    `prompt`, and their logprobs, most likely first: (ids [n, k] int32, logprobs [n, k]
    float32), from one teacher-forced pass over prompt + completion
    (engine.prompt_logprobs_topk, whose row t is p(. | tokens[:t])). Raises ValueError
    as that does."""
    _, ids, lps = engine.prompt_logprobs_topk(list(prompt) + list(completion), k)
    return ids[len(prompt):], lps[len(prompt):]


def with_topk(seq: SampledSequence, topk: tuple[np.ndarray, np.ndarray] | None) -> SampledSequence:
    """`seq` with the rows of `topk` (sample_topk of its uncut completion) for the
    tokens it kept after cut_at_stop; `seq` itself when no top-k was asked."""
    if topk is None:
        return seq
    n = len(seq.tokens)
    return msgspec.structs.replace(seq, topk_k=topk[0].shape[1], topk_ids=topk[0][:n].astype("<i4").tobytes(),
                                   topk_logprobs=topk[1][:n].astype("<f4").tobytes())


def sample_seeds(req: TinkerSample) -> list[int | None]:
    """The sampling seed of each of `req`'s completions: derived_seed("tinker", seed, i)
    for completion i of a seeded request (TinkerSample.seed), None for an unseeded one."""
    if req.seed is None:
        return [None] * req.num_samples
    return [derived_seed("tinker", req.seed, i) for i in range(req.num_samples)]


# per request: completions, prompt logprobs, top-k prompt logprobs, per completion its top-k
Sampled = tuple[list[Any], list[float], dict[str, Any], list[tuple[np.ndarray, np.ndarray] | None]]


def samples_blocking(engine: Any, reqs: list[TinkerSample]) -> list[Sampled | ValueError]:
    """Per request of `reqs`, in order: its completions (agent_loop.GenOut, not yet cut
    at the stops), prompt logprobs and top-k prompt logprobs (prompt_scores) and each
    completion's top-k sample logprobs (sample_topk; None when not asked), or the
    ValueError that refuses it (sample_params) and no other. Every request's
    `num_samples` completions come from one engine.generate call, each prompt with its
    own request's parameters: one batch, where one call per request ran its decoding
    steps again for each. Raises what the engine raises for the batch as a whole."""
    got: list[Sampled | ValueError | None] = [None] * len(reqs)
    prompts: list[list[int]] = []
    params: list[SamplingParams] = []
    seeds: list[int | None] = []
    served: list[int] = []
    for i, req in enumerate(reqs):
        try:
            sp = sample_params(engine, req)
        except ValueError as e:
            got[i] = e
            continue
        prompts += [list(req.tokens)] * req.num_samples
        params += [sp] * req.num_samples
        seeds += sample_seeds(req)
        served.append(i)
    outs = engine.generate(prompts, params, seeds=seeds) if prompts else []
    at = 0
    for i in served:
        mine, at = outs[at:at + reqs[i].num_samples], at + reqs[i].num_samples
        try:
            k = reqs[i].topk_sample_logprobs
            topk = [sample_topk(engine, reqs[i].tokens, o.token_ids, k) if k else None for o in mine]
            got[i] = (mine, *prompt_scores(engine, reqs[i]), topk)
        except ValueError as e:
            got[i] = e
    return got  # type: ignore[return-value]


def batch_key(req: TinkerSample) -> tuple[str, str, tuple[int, str] | None]:
    """Requests served by one engine call: one job's, one sampling session's (one
    user's), on the same weights."""
    return req.job_id, req.sampler, (req.weights.policy_version, req.weights.sha256) if req.weights else None


async def admit_sample(worker: RolloutWorker, m: Msg) -> tuple[TinkerSample, JobRecord] | None:
    """The TinkerSample in `m` and its job's record, when this worker serves it; else
    None, with `m` dead-lettered (malformed, refused) or acked (its job has ended)."""
    bus = worker.bus
    req = await bus.decode_or_dead_letter(m, TinkerSample)
    if req is None:
        return None
    try:
        S.tinker_result(req.sampler, 0)  # a sampler id is a job-id-shaped subject token
    except ValueError as e:
        why = f"`sampler`: {e}"
    else:
        why = "" if S.job_id_of(m.subject) == req.job_id else f"job {req.job_id!r} arrived on {m.subject}"
    if why:
        await bus.dead_letter(m, f"TinkerSample: {why}")
        await m.term()
        return None
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
        return None
    if rec is not None:
        why = ("" if rec.kind == "inference" and rec.placement is not None and worker.worker in rec.placement.rollout
               and rec.attempt == req.attempt
               else f"job {req.job_id} is not an inference job placed on {worker.worker} at attempt {req.attempt}")
    if why or rec is None:
        await bus.dead_letter(m, f"TinkerSample refused: {why}")
        await m.term()
        return None
    return req, rec


async def serve_samples(worker: RolloutWorker, rec: JobRecord, items: list[tuple[TinkerSample, Msg]]) -> None:
    """Answer admitted TinkerSamples of one batch_key (module docstring), job `rec`'s, in
    one engine call; each message ends acked, except on shutdown (redelivered). A
    request the engine refuses fails alone; a failure of the call fails each request."""
    bus = worker.bus
    reqs = [r for r, _ in items]

    def answer(req: TinkerSample, **kw: Any) -> TinkerSamples:
        return TinkerSamples(sampler=req.sampler, seq_id=req.seq_id, record_key=req.record_key, **kw)

    beats = [asyncio.create_task(_in_progress(m)) for _, m in items]
    try:
        slot = await worker.engine_for_model(rec.spec.model, rec.spec.engine, rec.spec.sampler_dtype,
                                             rec.spec.dtype)
        async with slot.lock:
            version = await worker.policies.ensure_weights(slot, reqs[0].sampler, reqs[0].weights)
            t0 = time.perf_counter()
            got = await asyncio.get_running_loop().run_in_executor(slot.executor, samples_blocking, slot.engine, reqs)
        if len(reqs) > 1:
            log.info("sampler %s: %d sample calls, %d sequences in one engine call (%.2f s)", reqs[0].sampler,
                     len(reqs), sum(r.num_samples for r in reqs), time.perf_counter() - t0)
        results = []
        for req, g in zip(reqs, got):
            if isinstance(g, ValueError):
                results.append(answer(req, error=str(g), category="user"))
                continue
            outs, prompt, topk, seq_topk = g
            try:
                # the stops are matched after the engine's lock is released (the engine
                # slot is shared by every job of this base model)
                seqs = await asyncio.to_thread(lambda: [
                    with_topk(cut_at_stop(o, req, slot.engine.tokenizer), t)
                    for o, t in zip(outs, seq_topk)])
            except Exception as e:  # what this request's stops set off fails it alone
                log.exception("sample %s of job %s failed", req.seq_id, req.job_id)
                results.append(answer(req, error=f"{type(e).__name__}: {e}", category="user"))
                continue
            results.append(answer(req, sequences=seqs, prompt_logprobs=prompt, policy_version=version, **topk))
    except ValueError as e:
        results = [answer(req, error=str(e), category="user") for req in reqs]
    except (OSError, RuntimeError, ImportError, WeightsError) as e:  # the model, the engine or the weights failed
        log.exception("samples %s of job %s failed", [r.seq_id for r in reqs], rec.job_id)
        results = [answer(req, error=f"{type(e).__name__}: {e}", category="server") for req in reqs]
    except Exception as e:  # anything else the requests' content set off fails them, not the worker
        log.exception("samples %s of job %s failed", [r.seq_id for r in reqs], rec.job_id)
        results = [answer(req, error=f"{type(e).__name__}: {e}", category="user") for req in reqs]
    finally:
        for b in beats:
            b.cancel()
    for (req, m), result in zip(items, results):
        await bus.publish(S.tinker_result(req.sampler, req.seq_id), result,
                          msg_id=f"{req.sampler}:result{req.seq_id}")
        await m.ack()


async def _in_progress(m: Msg) -> None:
    while True:
        await asyncio.sleep(IN_PROGRESS_EVERY_S)
        with contextlib.suppress(nats.errors.Error):
            await m.in_progress()
