"""Job checkpoints: trainable weights + optimizer state (DeepSpeed's files), RNG
states, the step, the policy version and the trajectory-stream position.

Where: object `<job_id>/latest` in the `ot_checkpoints` object store. A small state
(a LoRA adapter and its optimizer state: a few MB) travels inside that object; a large
one (full fine-tuning) is moved to `<home>/checkpoints/<job_id>/step-<n>/` and the
object only points at it (large weights never go through the bus).
The object is one `torch.save` dict: {"format", "meta", "files" | "dir"}.

The stream position makes a resume exact: every OT_TRAJ sequence up to `traj_floor`
was consumed or discarded before the checkpoint, and `traj_used` lists the sequences
above it that trained a checkpointed step. A resumed learner replays from
`traj_floor + 1` and skips `traj_used`, so it neither loses nor repeats a trajectory.
"""

from __future__ import annotations

import io
import random
import shutil
from pathlib import Path
from typing import Any

import torch
from nats.js.errors import ObjectNotFoundError

from opentinker.schemas import subjects as S
from opentinker.schemas.tinker import CHECKPOINT_NAME_RE, state_object
from opentinker.services.core.bus import Bus

FORMAT = 1
# above this a checkpoint goes to a file and the object store holds a pointer
SMALL_BYTES = 64 * 1024 * 1024


def object_name(job_id: str, name: str = "") -> str:
    """The job's latest checkpoint, or its checkpoint saved under `name` (a tinker
    session's save_state; schemas.tinker.CHECKPOINT_NAME_RE)."""
    if not name:
        return f"{S.check_job_id(job_id)}/latest"
    if not CHECKPOINT_NAME_RE.match(name):
        raise ValueError(f"checkpoint name {name!r} must match {CHECKPOINT_NAME_RE.pattern}")
    return state_object(S.check_job_id(job_id), name)


def job_dir(home: str | Path, job_id: str) -> Path:
    """`<home>/checkpoints/<job_id>`: large checkpoints and the final HF export."""
    return Path(home) / "checkpoints" / S.check_job_id(job_id)


def rng_state() -> dict[str, Any]:
    """Python's and torch's RNG states (CUDA's too on a GPU)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _dir_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def pack(meta: dict[str, Any], state_dir: Path) -> bytes:
    """Every file under `state_dir` plus `meta`, as torch.save bytes."""
    files = {str(p.relative_to(state_dir)): p.read_bytes() for p in sorted(state_dir.rglob("*")) if p.is_file()}
    return _save({"format": FORMAT, "meta": meta, "files": files})


def _save(obj: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unpack(data: bytes, scratch: Path) -> tuple[dict[str, Any], Path]:
    """(meta, directory holding the engine's files). Inline files are written under
    `scratch`. Raises ValueError for an unknown format or a pointer to a missing dir."""
    # weights_only: the object store is shared; never unpickle arbitrary objects from it
    obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ValueError(f"checkpoint: unknown format {obj.get('format') if isinstance(obj, dict) else obj!r}")
    if "dir" in obj:
        d = Path(obj["dir"])
        if not d.is_dir():
            raise ValueError(f"checkpoint: points at {d}, which does not exist")
        return obj["meta"], d
    if scratch.exists():
        shutil.rmtree(scratch)
    for rel, blob in obj["files"].items():
        p = scratch / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(blob)
    return obj["meta"], scratch


def store(home: str | Path, job_id: str, meta: dict[str, Any], state_dir: Path) -> bytes:
    """The object bytes for a checkpoint whose engine files are in `state_dir`.

    Small: the files go inline. Large: `state_dir` is moved to
    `<home>/checkpoints/<job_id>/step-<meta["step"]>/` and the bytes point at it.
    Blocking file I/O: call it off the event loop.
    """
    if _dir_bytes(state_dir) <= SMALL_BYTES:
        return pack(meta, state_dir)
    dest = job_dir(home, job_id) / f"step-{meta['step']}"
    if dest.exists():
        shutil.rmtree(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(state_dir), dest)
    return _save({"format": FORMAT, "meta": meta, "dir": str(dest)})


def prune(home: str | Path, job_id: str, keep_step: int) -> None:
    """Remove large-checkpoint folders other than `step-<keep_step>` (call after the
    pointer to it is stored)."""
    root = job_dir(home, job_id)
    for d in root.glob("step-*"):
        if d.name != f"step-{keep_step}":
            shutil.rmtree(d, ignore_errors=True)


async def put(bus: Bus, job_id: str, data: bytes, name: str = "") -> None:
    await bus.put_object(S.OBJ_CHECKPOINTS, object_name(job_id, name), data)


async def get(bus: Bus, job_id: str, name: str = "") -> bytes | None:
    """The latest checkpoint object's bytes (the one saved as `name`), or None when the
    job has none."""
    try:
        return await bus.get_object(S.OBJ_CHECKPOINTS, object_name(job_id, name))
    except ObjectNotFoundError:
        return None
