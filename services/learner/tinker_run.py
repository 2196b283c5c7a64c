"""A tinker training session on a learner (`algorithm = "tinker"`): the model of one
Tinker API `create_lora_training_client`, driven operation by operation.

The job's assignment builds the engine (LoRA on the spec's model, one rank, ZeRO 0),
loads the save it starts from (`tinker_init`, a create_training_client_from_state; a
save that does not load fails the job with the reason), announces readiness
(TinkerResult seq 0), then executes the session's TinkerOps from `ot.job.<id>.ops.*`
strictly in `seq_id` order (an op that arrives early waits for the ones before it),
publishing each TinkerResult on `ot.job.<id>.results.<seq>` before acking the op:

- forward / forward_backward: per datum the policy's logprob of each target token
  and the loss (tinker_losses.py); forward_backward adds the gradient to the
  accumulated one, which stays until the next optim_step, as in Tinker.
- optim_step: AdamW with the op's hyperparameters; the policy version counts them.
- save_state / load_state: weights and optimizer state under a name, in the object
  store `ot_checkpoints` (`<job>/named/<name>`); a load may name another job's save
  (the API service lets a user name only their own).
- save_sampler: the weights (a peft adapter) under a name in `ot_weights`.
  Both saves are refused (a failed op naming `store_bytes_per_user`) once the objects of
  the user's jobs hold that many bytes; they are deleted with their job's record.
  A written save's ttl_seconds and user_metadata (the op's ttl_s, user_metadata) are
  kept in KV `ot_tinker` (TinkerCheckpointMeta), for the API's listing and expiry.
- close (on `ot.job.<id>.ops.close`, outside the order): after the ops held in order,
  export the policy (`<home>/checkpoints/<job>/final`) and complete; the job's ops are
  then purged from OT_TINKER.

A bad op (an unknown loss, a missing input, a checkpoint that does not exist) fails
that op with category "user"; the session goes on. A session's state lives in its
learner's memory between saves: a learner that stops (a crash, a requeue) cannot
resume the session, and its redelivered assignment, or the job's next placement once
it had said ready, fails the job saying so.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time

import numpy as np
import torch
from nats.aio.msg import Msg
from nats.js.errors import KeyNotFoundError, NotFoundError

from opentinker.schemas import encode
from opentinker.schemas import subjects as S
from opentinker.schemas.tinker import (CHECKPOINT_NAME_RE, TinkerCheckpointMeta, TinkerDatum, TinkerOp,
                                       TinkerResult, TinkerTensor, checkpoint_key, overwrite_refused,
                                       sampler_object)
from opentinker.services.core import access
from opentinker.services.learner import checkpoint
from opentinker.services.learner.lifecycle import RunLifecycle
from opentinker.services.learner.tinker_losses import LossInputError, check_inputs

log = logging.getLogger("opentinker.learner.tinker")

OPS_FETCH = 16
OPS_ACK_WAIT_S = 600.0  # one forward_backward on a large chunk may take minutes
NUMPY = {"float32": np.float32, "int64": np.int64}


class OpError(ValueError):
    """An op the session cannot execute, for a reason the user can fix."""


def to_numpy(t: TinkerTensor, name: str) -> np.ndarray:
    """The array of a TinkerTensor. Raises OpError naming `name` when the bytes do not
    fill the shape."""
    dt = NUMPY[t.dtype]
    size = np.dtype(dt).itemsize
    if len(t.data) % size:
        raise OpError(f"{name}: {len(t.data)} bytes is not a whole number of {t.dtype} elements")
    a = np.frombuffer(t.data, dtype=dt)
    if t.shape:
        if int(np.prod(t.shape)) != a.size:
            raise OpError(f"{name}: shape {list(t.shape)} does not hold {a.size} elements")
        a = a.reshape(t.shape)
    return a


def to_tensor(x: torch.Tensor) -> TinkerTensor:
    a = x.detach().cpu().numpy().astype(np.float32)
    return TinkerTensor(dtype="float32", shape=list(a.shape), data=a.tobytes())


def datum_arrays(d: TinkerDatum, i: int, op: TinkerOp, vocab_size: int, max_len: int = 0
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(tokens [N], inputs) of datum `i` of `op`, checked for its loss
    (tinker_losses.check_inputs: every input [N]; 2-D targets, Tinker's top-K
    distillation, are not served), its token ids against the vocabulary and N against
    the model's context `max_len` (0: unchecked). Raises OpError or LossInputError
    naming the datum."""
    if not d.tokens:
        raise OpError(f"data[{i}].model_input: empty")
    arrays = {k: to_numpy(v, f"data[{i}].loss_fn_inputs[{k!r}]") for k, v in d.inputs.items()}
    try:
        check_inputs(op.loss_fn, arrays, len(d.tokens), dict(op.loss_fn_config))
    except LossInputError as e:
        raise LossInputError(f"data[{i}]: {e}") from None
    if max_len and len(d.tokens) > max_len:
        raise OpError(f"data[{i}].model_input: {len(d.tokens)} tokens, over the model's context ({max_len})")
    for name, ids in (("model_input", d.tokens), ("loss_fn_inputs['target_tokens']", arrays["target_tokens"])):
        if len(ids) and int(np.max(ids)) >= vocab_size:
            raise OpError(f"data[{i}].{name}: token id {int(np.max(ids))} is outside the vocabulary ({vocab_size})")
    return torch.tensor(d.tokens, dtype=torch.long), {k: torch.from_numpy(a.copy()) for k, a in arrays.items()}


def check_name(name: str) -> str:
    """`name` if it may name a save (schemas.tinker.CHECKPOINT_NAME_RE); raises OpError."""
    if not CHECKPOINT_NAME_RE.match(name):
        raise OpError(f"name: {name!r} must match {CHECKPOINT_NAME_RE.pattern}")
    return name


class TinkerRun(RunLifecycle):
    """A tinker session's model: executes its ops in order (module docstring)."""

    async def run(self) -> None:
        # a session whose learner stopped, or left the pool and had the job requeued (a
        # new placement: delivery 1, attempt 2), cannot go on: its ops before were acked
        # and its state is gone, so a fresh start would wait for them forever
        if self.incarnation > 1 or (self.attempt > 1 and await self.bus.last_message(
                S.tinker_result(self.job_id, 0)) is not None):
            raise RuntimeError("the learner holding this tinker training session stopped, and a session's "
                               "unsaved state does not survive that: create a training client from your "
                               "last save_state")
        await self.start()
        if self.spec.tinker_init:  # create_training_client_from_state: the save first
            await self.load_named(self.spec.tinker_init, self.spec.tinker_init_optimizer)
        d = S.tinker_ops_durable(self.job_id)
        sub = await self.bus.durable(d, ack_wait_s=OPS_ACK_WAIT_S)
        await self.respond(TinkerResult(job_id=self.job_id, seq_id=0, op="ready"))
        log.info("job %s: tinker session ready", self.job_id)
        pending: dict[int, tuple[TinkerOp, Msg]] = {}
        done = 0  # the last seq_id executed
        close: Msg | None = None
        while True:
            self.check_live()
            for m in await self.bus.fetch(sub, OPS_FETCH, 1.0):
                op = await self.bus.decode_or_dead_letter(m, TinkerOp)
                if op is None:
                    continue
                where = S.tinker_close(self.job_id) if op.op == "close" else S.tinker_op(self.job_id, op.seq_id)
                if op.job_id != self.job_id or m.subject != where:
                    await self.bus.dead_letter(m, f"TinkerOp: a {op.op!r} op of job {op.job_id!r}, "
                                                  f"seq {op.seq_id}, came on {m.subject}")
                    await m.term()
                elif op.op == "close":
                    close = m
                elif op.seq_id < 1:
                    await self.bus.dead_letter(m, f"TinkerOp: seq_id {op.seq_id} (ops count from 1; 0 is the "
                                                  "session's readiness)")
                    await m.term()
                elif op.seq_id <= done:
                    await m.ack()  # a redelivery of an op already answered
                else:
                    pending[op.seq_id] = (op, m)
            while done + 1 in pending:
                op, m = pending.pop(done + 1)
                await self.respond(await self.execute(op))
                await m.ack()
                done = op.seq_id
            if close is not None:
                if pending:
                    log.warning("job %s: session closed with ops %s still waiting for op %d; not executed",
                                self.job_id, sorted(pending), done + 1)
                await self.finish()
                await close.ack()
                return

    async def respond(self, r: TinkerResult) -> None:
        await self.bus.publish(S.tinker_result(self.job_id, r.seq_id), r,
                               msg_id=f"{self.job_id}:result{r.seq_id}")

    async def execute(self, op: TinkerOp) -> TinkerResult:
        """Run one op; its failure becomes the result's error (a user error, or a
        server error for anything unexpected), never the session's."""
        t0 = time.monotonic()
        failed = {"job_id": self.job_id, "seq_id": op.seq_id, "op": op.op}
        try:
            if op.error:
                raise OpError(op.error)
            out = await self._execute(op)
        except (OpError, LossInputError) as e:
            return TinkerResult(**failed, error=str(e), category="user")
        except Exception as e:  # the engine failed on this op: say so, keep the session
            log.exception("job %s: tinker op %d (%s) failed", self.job_id, op.seq_id, op.op)
            return TinkerResult(**failed, error=f"{type(e).__name__}: {e}", category="server")
        log.info("job %s: op %d %s in %.2f s", self.job_id, op.seq_id, op.op, time.monotonic() - t0)
        return out

    async def _execute(self, op: TinkerOp) -> TinkerResult:
        r = {"job_id": self.job_id, "seq_id": op.seq_id, "op": op.op}
        if op.op in ("forward", "forward_backward"):
            data = [datum_arrays(d, i, op, self.engine.vocab_size, self.engine.max_len) for i, d in enumerate(op.data)]
            lps, sums = await self.in_engine(self.engine.tinker_pass, data, op.loss_fn, dict(op.loss_fn_config),
                                             op.op == "forward_backward")
            metrics = {f"{k}:sum": v for k, v in sums.items()}
            return TinkerResult(**r, logprobs=[to_tensor(x) for x in lps], metrics=metrics)
        if op.op == "optim_step":
            if op.adam is None:
                raise OpError("optim_step: adam_params is required")
            a = op.adam
            out = await self.in_engine(self.engine.tinker_optim_step, a.learning_rate, a.beta1, a.beta2, a.eps,
                                       a.weight_decay, a.grad_clip_norm)
            self.version += 1
            self.step += 1
            return TinkerResult(**r, metrics={f"{k}:mean": v for k, v in out.items()}, policy_version=self.version)
        if op.op == "save_state":
            await self.save_named(op.name, op.overwrite)
            await self.note_save(op, "weights")
            return TinkerResult(**r, path=f"{self.job_id}/{op.name}", policy_version=self.version)
        if op.op == "save_sampler":
            check_name(op.name)
            await self.check_store_quota("save_weights_for_sampler")
            data = await self.in_engine(self.engine.weights_bytes)
            await self.bus.put_object(S.OBJ_WEIGHTS, sampler_object(self.job_id, op.name), data)
            await self.note_save(op, "sampler_weights")
            return TinkerResult(**r, path=f"{self.job_id}/{op.name}", policy_version=self.version,
                                sampling_session_seq_id=op.sampling_session_seq_id)
        if op.op == "load_state":
            await self.load_named(op.path, op.optimizer)
            return TinkerResult(**r, path=op.path, policy_version=self.version)
        raise OpError(f"op: {op.op!r} is not served")

    async def check_store_quota(self, what: str) -> None:
        """Raises OpError when the objects of this job's user's jobs (both object stores)
        already hold Settings.store_bytes_per_user bytes (an admin's: no limit)."""
        tenant = self.tenant
        if tenant.admin:
            return
        jobs = set(await access.jobs_of(self.bus, tenant.user)) | {self.job_id}
        used = 0
        for bucket in (S.OBJ_WEIGHTS, S.OBJ_CHECKPOINTS):
            try:
                infos = await (await self.bus.objects(bucket)).list()
            except NotFoundError:  # an empty store
                continue
            used += sum(i.size or 0 for i in infos if not i.deleted and i.name.partition("/")[0] in jobs)
        cap = self.settings.store_bytes_per_user
        if used >= cap:
            raise OpError(f"{what}: your jobs' saves and weights hold {used} bytes (store_bytes_per_user = {cap}); "
                          "a finished job's are deleted with its record (job_retention_days, "
                          "finished_jobs_per_user)")

    async def note_save(self, op: TinkerOp, kind: str) -> None:
        """Keep a written save's expiry (op.ttl_s from now; 0: never) and user metadata
        (TinkerCheckpointMeta, KV `ot_tinker`, checkpoint_key), replacing what an earlier
        save of the name had; neither: the key is purged. Called only after the save is
        written, so a refused save leaves the name's earlier metadata alone."""
        kv = await self.bus.kv(S.KV_TINKER)
        key = checkpoint_key(self.job_id, kind, op.name)
        if not op.ttl_s and not op.user_metadata:
            with contextlib.suppress(KeyNotFoundError):
                await kv.purge(key)
            return
        await kv.put(key, encode(TinkerCheckpointMeta(
            job_id=self.job_id, user=self.tenant.user, kind=kind, name=op.name,
            expires_s=time.time() + op.ttl_s if op.ttl_s else 0.0, user_metadata=op.user_metadata)))

    async def save_named(self, name: str, overwrite: bool) -> None:
        """Weights and optimizer state under `name` (checkpoint.object_name). Raises
        OpError for a bad name, a name already saved without `overwrite` (a save of it
        queued before this one: the API checked at submit) or a user over
        store_bytes_per_user."""
        check_name(name)
        if not overwrite and await self.bus.has_object(S.OBJ_CHECKPOINTS, checkpoint.object_name(self.job_id, name)):
            raise OpError(overwrite_refused(name))
        await self.check_store_quota("save_state")
        state_dir = self.scratch / f"save-{name}"
        meta = {"job_id": self.job_id, "step": self.step, "policy_version": self.version,
                "rng": checkpoint.rng_state(), "time_s": time.time()}

        def write() -> bytes:
            self.engine.save_state(state_dir)
            data = checkpoint.pack(meta, state_dir)
            shutil.rmtree(state_dir, ignore_errors=True)
            return data

        await checkpoint.put(self.bus, self.job_id, await self.in_engine(write), name)

    async def load_named(self, path: str, optimizer: bool) -> None:
        """The state saved as `<job_id>/<name>` (any job's: the API checks the caller
        may name it). Raises OpError when there is none."""
        job_id, _, name = path.partition("/")
        try:
            data = await checkpoint.get(self.bus, job_id, name)
        except ValueError as e:
            raise OpError(f"path: {e}") from None
        if data is None:
            raise OpError(f"path: no saved state {path!r}")
        meta, state_dir = await self.in_engine(checkpoint.unpack, data, self.scratch / "restore")
        await self.in_engine(self.engine.load_state, state_dir, optimizer)
        self.version = int(meta.get("policy_version", 0))
        self.step = int(meta.get("step", 0))

    async def cleanup_bus(self) -> None:
        d = S.tinker_ops_durable(self.job_id)
        await self.bus.delete_durable(d)
        await self.bus.purge_subject(d.stream, d.subject)  # the ops; their results stay for the API
