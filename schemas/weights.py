"""Weight events (learner -> rollout, recorder, SDK). Weights never travel inside a
message: the event names a version, a sha256 and where to fetch the bytes."""

from typing import Literal

import msgspec

from opentinker.schemas.base import Message


class WeightsPublished(Message, frozen=True, kw_only=True):
    """A new policy version is available (subject `ot.job.<id>.weights`).

    `uri` is `nats-os://<bucket>/<object>` (NATS object store) or `file:///path`.
    The bytes are a safetensors file: for kind "lora", a peft adapter state dict
    (`lora_A`/`lora_B` per target module, scale = lora_alpha / lora_rank); for
    kind "full", every parameter under its Hugging Face name.
    """

    job_id: str
    policy_version: int
    kind: Literal["lora", "full"]
    uri: str
    sha256: str
    size_bytes: int
    lora_rank: int = 0
    lora_alpha: int = 0
    target_modules: list[str] = msgspec.field(default_factory=list)
    step: int = 0
    time_s: float = 0.0
