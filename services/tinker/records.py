"""What sampling clients with `record_stability_info` recorded, for the loss
`stable_reinforce` (KV `ot_tinker_seqs`; the ids and checks: provenance.py).

A recorded sample is a RecordedPrompt (`<record key>.p`), written when the tinker
service sends the sample to its rollout worker, and one RecordedSequence per sampled
sequence (`<record key>.<i>`), written when the service first reads the sample's result
back (the SDK retrieves every sample before it can name its sequences). An entry
expires a day (TINKER_RECORD_TTL_S) after its last write; a training request that uses
it rewrites it, at most every TOUCH_EVERY_S, which restarts its day (Tinker: "each
training request that uses a sequence restarts that day"). A finished session's records
are deleted with it.

Bounds, per session (Settings): `tinker_recorded_bytes_per_session` bytes and
`tinker_recorded_sequences_per_session` sequences, counted by this tinker service
process; past either, the session's oldest recorded samples are deleted first (a later
request naming them is refused, saying so). A restarted service counts afresh: what it
no longer counts still expires after its day, or with its session.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from opentinker.schemas import decode, encode
from opentinker.schemas import subjects as S
from opentinker.schemas.tinker import (RECORD_KEY_RE, RecordedPrompt, RecordedSequence, TinkerDatum, TinkerSampler,
                                       TinkerSamples)
from opentinker.services.core.bus import Bus
from opentinker.services.core.config import Settings
from opentinker.services.tinker import provenance, wire
from opentinker.services.tinker.provenance import Recorded, new_record_key

TOUCH_EVERY_S = 3600.0
READS_AT_ONCE = 64


class Records:
    """The recorded samples of every session, and this process's count of them."""

    def __init__(self, bus: Bus, limits: Settings):
        self.bus = bus
        self.limits = limits
        self._held: dict[str, OrderedDict[str, list[int]]] = {}  # session -> record key -> [bytes, sequences]
        self._totals: dict[str, list[int]] = {}  # session -> [bytes, sequences]
        self._keys: dict[str, str] = {}  # a sample's request id -> its record key, until its result is read

    async def start(self, rid: str, sampler: TinkerSampler, tokens: list[int]) -> str:
        """Record the prompt of sample `rid` of `sampler` and the weights it samples with.
        Returns the sample's record key: a new one, or the one `rid` got before (a resent
        sample, which the bus delivers once)."""
        if rid in self._keys:
            return self._keys[rid]
        session_id = sampler.session_id
        key = self._keys[rid] = new_record_key(session_id)
        now = time.time()
        raw = encode(RecordedPrompt(session_id=session_id, sampler=sampler.sampler_id, tokens=list(tokens),
                                    model_path=sampler.model_path,
                                    weights_sha256=sampler.weights.sha256 if sampler.weights else "",
                                    created_s=now, used_s=now))
        await (await self.bus.kv(S.KV_TINKER_SEQS)).put(f"{key}.p", raw)
        await self._count(session_id, key, len(raw), 0)
        return key

    async def finish(self, samples: TinkerSamples, session_id: str) -> None:
        """Record the sequences of `samples` (a result of session `session_id`'s sampling)
        when its sample was recorded (its echoed record key, checked to be the session's),
        once (a second retrieval of the result writes nothing)."""
        self._keys.pop(f"{samples.sampler}.{samples.seq_id}", None)
        record_key = samples.record_key
        if samples.error or not RECORD_KEY_RE.match(record_key) or record_key.partition(".")[0] != session_id:
            return
        kv = await self.bus.kv(S.KV_TINKER_SEQS)
        now = time.time()
        size = count = 0
        for i, s in enumerate(samples.sequences):
            raw = encode(RecordedSequence(tokens=s.tokens, logprobs=s.logprobs, policy_version=samples.policy_version,
                                          created_s=now, used_s=now))
            try:
                await kv.create(f"{record_key}.{i}", raw)
            except KeyWrongLastSequenceError:
                continue
            size, count = size + len(raw), count + 1
        if count:
            await self._count(record_key.partition(".")[0], record_key, size, count)

    async def load(self, named: Mapping[str, tuple[str, int]]) -> tuple[dict[str, Recorded | None], list]:
        """The records of the sequences `named` (sequence id -> (record key, index)):
        (sequence id -> Recorded, or None when it or its prompt is not recorded; the
        entries due a touch, for `touch` once the request is accepted)."""
        kv = await self.bus.kv(S.KV_TINKER_SEQS)
        gate = asyncio.Semaphore(READS_AT_ONCE)

        async def get(name: str, kind: type):
            async with gate:
                try:
                    entry = await kv.get(name)
                except KeyNotFoundError:
                    return None
            try:
                return decode(entry.value, kind) if entry.value else None
            except msgspec.MsgspecError:
                return None

        keys = sorted({key for key, _ in named.values()})
        sids = list(named)
        got = await asyncio.gather(*(get(f"{k}.p", RecordedPrompt) for k in keys),
                                   *(get(f"{named[s][0]}.{named[s][1]}", RecordedSequence) for s in sids))
        prompts = dict(zip(keys, got[:len(keys)]))
        seqs = dict(zip(sids, got[len(keys):]))
        out: dict[str, Recorded | None] = {}
        due = []
        cutoff = time.time() - TOUCH_EVERY_S
        for sid in sids:
            key, index = named[sid]
            p, s = prompts[key], seqs[sid]
            out[sid] = None if p is None or s is None else Recorded(p.tokens, s.tokens, s.logprobs)
            if s is not None and s.used_s < cutoff:
                due.append((f"{key}.{index}", s))
        due += [(f"{k}.p", p) for k, p in prompts.items() if p is not None and p.used_s < cutoff]
        return out, due

    async def touch(self, due: Iterable) -> None:
        """Rewrite the entries `load` found due (restarting their day)."""
        kv = await self.bus.kv(S.KV_TINKER_SEQS)
        now = time.time()
        for name, value in due:
            await kv.put(name, encode(msgspec.structs.replace(value, used_s=now)))

    async def with_provenance(self, job_id: str, data: list[TinkerDatum],
                              prov: list[wire.Provenance | None]) -> tuple[list[TinkerDatum], str]:
        """(`data` of a stable_reinforce op of model job `job_id` with the loss's recorded
        inputs attached, "") when its provenance checks out against what its session
        recorded (provenance.py; the records it used restart their day), else ([], why,
        naming the datum and run): the API then sends the op with that error, so that it
        still takes its place in the model's seq_id order and fails its own future."""
        try:
            named = provenance.named(prov, wire.session_of_job(job_id))
            recorded, due = await self.load(named)
            provenance.check(data, prov, recorded)
        except wire.WireError as e:
            return [], str(e)
        await self.touch(due)
        return provenance.attach(data, prov, recorded), ""

    async def drop_session(self, session_id: str) -> None:
        """Delete every record of the session (it finished)."""
        await self.bus.purge_subject(f"KV_{S.KV_TINKER_SEQS}", f"$KV.{S.KV_TINKER_SEQS}.{session_id}.>")
        for rid in [r for r in self._keys if r.startswith(f"{session_id}-")]:
            del self._keys[rid]
        self._held.pop(session_id, None)
        self._totals.pop(session_id, None)

    async def _count(self, session_id: str, key: str, size: int, sequences: int) -> None:
        """Count `size` bytes and `sequences` more under `key`, then delete the session's
        oldest recorded samples while it is over its bounds (module docstring)."""
        held = self._held.setdefault(session_id, OrderedDict())
        totals = self._totals.setdefault(session_id, [0, 0])
        entry = held.setdefault(key, [0, 0])
        entry[0] += size
        entry[1] += sequences
        totals[0] += size
        totals[1] += sequences
        lim = self.limits
        while held and (totals[0] > lim.tinker_recorded_bytes_per_session
                        or totals[1] > lim.tinker_recorded_sequences_per_session):
            old, (b, n) = held.popitem(last=False)
            totals[0] -= b
            totals[1] -= n
            await self.bus.purge_subject(f"KV_{S.KV_TINKER_SEQS}", f"$KV.{S.KV_TINKER_SEQS}.{old}.>")
