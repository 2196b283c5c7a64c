"""A job's learner as N data-parallel ranks on this host (`learner_ranks` = N > 1).

The learner service stays the job's one voice on the bus: it fetches the trajectories,
keeps the ledger, builds each step's micro-batches, publishes one weight event per
step and writes the checkpoints, exactly as with one rank. Only the engine moves out:
`RankGroup` has `TrainEngine`'s interface and runs N ranks it starts itself (`python
-m opentinker.services.learner.ranks`, RANK / LOCAL_RANK / WORLD_SIZE set), gloo on
CPU, nccl on CUDA (one GPU per local rank), over loopback. The ranks meet in a file
store in the group's private folder, not through torchrun, whose TCP store listens on
every interface with no authentication (process_group.py). Rank 0 receives every
engine call from the service over a loopback connection authenticated by a one-time
key (`multiprocessing.connection`, HMAC challenge; the key is in a 0600 file, never on
a command line) and scatters it to the ranks
(`torch.distributed.scatter_object_list`): a training step's micro-batches are split
by `batching.shard_updates`, so each rank trains on its shard and DeepSpeed
all-reduces the gradients (ZeRO 0-3 partitions what the stage says across the N
ranks); every other call (logprobs, weights, checkpoints) runs on every rank, as the
collectives of ZeRO-3 need. Rank 0 answers with its result. A rank whose call fails
ends the group at once (the others may be waiting for it in a collective): the call
raises RankError naming the rank and its error.

Why one rank talks to the bus, not each rank consuming its own shard: a step is the
set of groups the ledger (ledger.py) admits (duplicates skipped, stale runs dropped,
groups asked again after a timeout or a lost worker), and its advantages are computed
per group; N consumers would each need the whole step to agree on it. One consumer
keeps the exactly-once accounting of one rank, and the micro-batches a step sends to
the ranks are a few MB.

A rank that dies takes the group down (the service stops the others, which may wait for
it in a collective); the engine call in flight raises RankError, and the job fails
with it. The service's own death
closes rank 0's connection, and the group exits.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import secrets
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

import msgspec

from opentinker.schemas import JobSpec
from opentinker.services.learner.loss import LossConfig
from opentinker.services.learner.process_group import STORE_ENV

log = logging.getLogger("opentinker.learner.ranks")

START_TIMEOUT_S = 300.0   # N imports of torch and deepspeed, then rank 0 connects
POLL_S = 0.5              # how often a call in flight looks for a rank that has exited
CLOSE_TIMEOUT_S = 60.0
# the engine calls a RankGroup forwards; anything else is refused by the ranks
CALLS = frozenset({"sequence_logprobs", "train_step", "weights_bytes", "save_state", "load_state",
                   "save_pretrained", "set_lr"})
LAUNCH_ENV_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                   "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID", STORE_ENV)


class RankError(RuntimeError):
    """An engine call failed on a rank (the message names the rank and the error), or
    the rank group stopped answering."""


class RankGroup:
    """`learner_ranks` data-parallel ranks with the interface of engine_deepspeed.TrainEngine.

    spec: the job's spec (spec.learner_ranks >= 2 ranks); model_path: what
    `from_pretrained` accepts; device: "cpu" or "cuda" (one GPU per rank); scratch: a
    private folder (0700) for the connection file; threads: intra-op threads per rank
    (None: the machine's cores divided among the ranks). Every rank starts from this
    process's torch RNG state, so the LoRA initialisation is the one a single-rank
    engine would draw. Raises RankError when the ranks do not start (their log's tail
    in the message) or the engine fails to build on one of them.
    """

    def __init__(self, spec: JobSpec, model_path: str, device: str, scratch: Path, threads: int | None = None):
        import torch

        self.spec = spec
        self.world_size = spec.learner_ranks
        self.rank = 0
        self.device = device
        self.kind = "lora" if spec.lora_rank > 0 else "full"
        self.loss_cfg = LossConfig.from_spec(spec)
        authkey = secrets.token_bytes(32)
        self._listener = Listener(("127.0.0.1", 0), authkey=authkey)
        address = self._listener.address
        conn_file = scratch / "ranks.json"
        fd = os.open(conn_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"host": address[0], "port": address[1], "authkey": authkey.hex()}, f)
        self._dir = scratch
        self._log = scratch / "ranks.log"
        env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV_VARS}
        per_rank = threads or max(1, (os.cpu_count() or 1) // self.world_size)
        env.update(OMP_NUM_THREADS=str(per_rank), MKL_NUM_THREADS=str(per_rank), PYTHONUNBUFFERED="1",
                   WORLD_SIZE=str(self.world_size), LOCAL_WORLD_SIZE=str(self.world_size))
        env[STORE_ENV] = str(scratch / f"store-{secrets.token_hex(8)}")  # a fresh file: the store's own
        # the ranks of one host talk over loopback
        env.setdefault("NCCL_SOCKET_IFNAME" if device == "cuda" else "GLOO_SOCKET_IFNAME", "lo")
        cmd = [sys.executable, "-m", "opentinker.services.learner.ranks", str(conn_file), device]
        self._procs: list[subprocess.Popen] = []
        self._conn: Connection | None = None
        try:
            with open(self._log, "ab") as out:
                for r in range(self.world_size):
                    # a process group of their own (rank 0's pid): _kill() stops every rank at once
                    self._procs.append(subprocess.Popen(
                        cmd, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=out, stderr=subprocess.STDOUT,
                        process_group=self._procs[0].pid if r else 0))
            self._conn = self._accept(address, authkey)
            info = self._call("init", msgspec.json.encode(spec), model_path, torch.get_rng_state().numpy().tobytes())
        except BaseException:
            self._kill()
            raise
        finally:
            self._listener.close()
        self.vocab_size: int = info["vocab_size"]
        self.pad_id: int = info["pad_id"]
        self.n_trainable: int = info["n_trainable"]
        log.info("rank group of %d ready (pids %s), %s", self.world_size, [p.pid for p in self._procs], device)

    # -- the engine's interface ---------------------------------------------------

    def sequence_logprobs(self, batches, reference: bool):
        return self._call("sequence_logprobs", batches, reference)

    def train_step(self, micro_batches, updates, totals, lrs=None) -> dict[str, float]:
        return self._call("train_step", micro_batches, updates, totals, lrs)

    def weights_bytes(self) -> bytes:
        return self._call("weights_bytes")

    def save_state(self, directory) -> None:
        self._call("save_state", str(directory))

    def load_state(self, directory, optimizer: bool = True) -> None:
        self._call("load_state", str(directory), optimizer)

    def save_pretrained(self, directory) -> None:
        self._call("save_pretrained", str(directory))

    def set_lr(self, lr: float) -> None:
        self._call("set_lr", lr)

    def close(self) -> None:
        """Stop the ranks: a clean close, else (after CLOSE_TIMEOUT_S, or a broken
        group) their process group is killed."""
        if self._conn is not None:
            with contextlib.suppress(Exception):
                _send(self._conn, ("close",))
                if self._conn.poll(CLOSE_TIMEOUT_S):
                    _recv(self._conn)
            self._conn.close()
            self._conn = None
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        try:
            for p in self._procs:
                p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._kill()

    # -- plumbing -------------------------------------------------------------------

    def _accept(self, address, authkey: bytes) -> Connection:
        box: list[Any] = []

        def accept() -> None:
            try:
                box.append(self._listener.accept())
            except Exception as e:  # a wrong key, a closed listener
                box.append(e)

        t = threading.Thread(target=accept, daemon=True)
        t.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while t.is_alive():
            t.join(0.5)
            if t.is_alive() and (self._exited() or time.monotonic() > deadline):
                with contextlib.suppress(Exception):  # unblock accept() with a connection of our own
                    Client(address, authkey=authkey).close()
                t.join(5.0)
                raise RankError(f"the {self.world_size} learner ranks did not start "
                                f"({self._exits() or 'timed out'}): {self._tail()}")
        if not box or isinstance(box[0], Exception):
            raise RankError(f"rank 0 did not connect: {box[0] if box else 'no connection'}")
        return box[0]

    def _call(self, name: str, *args):
        if self._conn is None:
            raise RankError("the rank group is closed")
        try:
            _send(self._conn, ("call", name, args))
            while not self._conn.poll(POLL_S):
                if self._exited():
                    raise EOFError
            status, value = _recv(self._conn)
        except (EOFError, OSError) as e:
            gone = self._exits() or type(e).__name__  # before _end() kills the rest
            self._end()
            errors = sorted(self._dir.glob("rank-*.error"))
            why = "; ".join(f.read_text(errors="replace") for f in errors) or self._tail()
            raise RankError(f"the learner ranks stopped during {name} ({gone}): {why}") from None
        if status != "ok":
            self._end()
            raise RankError(f"{name} failed on {value}")
        return value

    def _end(self) -> None:
        """A rank failed or exited, and the others may wait for it in a collective:
        stop them all."""
        self._kill()
        with contextlib.suppress(OSError):
            self._conn.close()
        self._conn = None

    def _exited(self) -> bool:
        return any(p.poll() is not None for p in self._procs)

    def _exits(self) -> str:
        """The ranks that have exited and how, e.g. "rank 1 exit -9"."""
        return ", ".join(f"rank {r} exit {p.returncode}" for r, p in enumerate(self._procs) if p.poll() is not None)

    def _tail(self, n: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self._log.read_bytes()[-n:].decode(errors="replace")
        return ""

    def _kill(self) -> None:
        import signal

        with contextlib.suppress(ProcessLookupError, PermissionError, IndexError):
            os.killpg(self._procs[0].pid, signal.SIGKILL)  # the ranks' process group: we started it
        for p in self._procs:
            with contextlib.suppress(Exception):
                p.wait(10)


# -- a rank ------------------------------------------------------------------------

def _send(conn: Connection, obj: Any) -> None:
    # plain pickle: Connection.send's pickler would pass tensors as shared-memory file
    # descriptors (torch.multiprocessing's reductions), which only a child process can open
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())  # from the other end of an authenticated loopback connection


def _payloads(msg: tuple, world_size: int) -> list[tuple]:
    """What rank 0 scatters for one service message: a training step split into each
    rank's shard (its micro-batches, each update's indices into them), anything else
    the same for every rank."""
    from opentinker.services.learner.batching import shard_updates

    if msg[0] == "call" and msg[1] == "train_step":
        micro_batches, updates, totals, lrs = msg[2]
        return [("call", "train_step", (*shard_updates(micro_batches, updates, r, world_size), totals, lrs))
                for r in range(world_size)]
    return [msg] * world_size


def _execute(engine, msg: tuple, device: str):
    import torch

    from opentinker.services.learner.engine_deepspeed import TrainEngine

    name, args = msg[1], msg[2]
    if name == "init":
        spec_bytes, model_path, rng = args
        torch.set_rng_state(torch.frombuffer(bytearray(rng), dtype=torch.uint8))
        eng = TrainEngine(msgspec.json.decode(spec_bytes, type=JobSpec), model_path, device)
        return eng, {"vocab_size": eng.vocab_size, "pad_id": eng.pad_id, "n_trainable": eng.n_trainable}
    if engine is None or name not in CALLS:
        raise RankError(f"unknown engine call {name!r}" if name not in CALLS else "the engine is not built")
    return engine, getattr(engine, name)(*args)


def rank_main(conn_file: str, device: str) -> int:
    """One rank's loop (RankGroup sets RANK, LOCAL_RANK, WORLD_SIZE and the store's file):
    rank 0 reads the service's messages and scatters them; every rank executes its
    part; rank 0 answers with its result or the first rank's error. Returns the exit
    status."""
    import torch.distributed as dist

    from opentinker.services.learner.process_group import init_distributed

    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank %(process)d %(name)s %(message)s")
    rank, world_size = init_distributed(device)
    conn = None
    if rank == 0:
        info = json.loads(Path(conn_file).read_text())
        conn = Client((info["host"], info["port"]), authkey=bytes.fromhex(info["authkey"]))
    engine = None
    while True:
        payloads = None
        if conn is not None:
            try:
                msg = _recv(conn)
            except EOFError:  # the learner service is gone: stop the group
                msg = ("close",)
            payloads = _payloads(msg, world_size)
        box: list[Any] = [None]
        dist.scatter_object_list(box, payloads, src=0)
        msg = box[0]
        if msg[0] == "close":
            break
        try:
            engine, result = _execute(engine, msg, device)
        except Exception as e:
            # the other ranks may wait in a collective this rank will never join: end the
            # group (the service stops the rest), leaving the error for the service to name
            error = f"rank {rank}: {type(e).__name__}: {e}"
            logging.getLogger("opentinker.learner.ranks").error("%s\n%s", error, traceback.format_exc())
            with contextlib.suppress(OSError):
                (Path(conn_file).parent / f"rank-{rank}.error").write_text(error[:4000])
            if conn is not None:
                with contextlib.suppress(OSError):
                    _send(conn, ("error", error))
            os._exit(1)
        if conn is not None:
            _send(conn, ("ok", result))
    if engine is not None:
        engine.close()
    if conn is not None:
        with contextlib.suppress(Exception):
            _send(conn, ("ok", None))
            conn.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(rank_main(sys.argv[1], sys.argv[2]))
