"""Weight events (learner -> rollout, recorder, SDK). Weights never travel inside a
message: the event names a version, a sha256 and where to fetch the bytes."""

from typing import Literal

import msgspec

from opentinker.schemas.base import Count, Message


class WeightsPublished(Message, frozen=True, kw_only=True):
    """A new policy version is available (subject `ot.job.<id>.weights`).

    `uri` is `nats-os://<bucket>/<object>` (NATS object store) or `file:///path`.
    The bytes are a safetensors file: for kind "lora", a peft adapter state dict
    (`lora_A`/`lora_B` per target module, scale = lora_alpha / lora_rank); for
    kind "full", every parameter under its Hugging Face name.
    """

    job_id: str
    policy_version: Count
    kind: Literal["lora", "full"]
    uri: str
    sha256: str
    size_bytes: Count
    lora_rank: Count = 0
    lora_alpha: Count = 0
    target_modules: list[str] = msgspec.field(default_factory=list)
    step: Count = 0
    time_s: float = 0.0
    # the learner run that made these weights (a resumed run starts a new lineage and
    # re-announces its checkpoint's version) and the placement attempt it ran under
    run: str = ""
    attempt: Count = 0
