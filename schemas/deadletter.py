"""Dead letters: what a service could not decode or process, with the reason."""

from opentinker.schemas.base import Message


class DeadLetter(Message, frozen=True, kw_only=True):
    """Published on `ot.dlq.<service>` (stream OT_DLQ). `payload` is the original bytes,
    or their first 64 KiB: `payload_bytes` is the original size, and `truncated` is
    True when the payload, a header or the reason was cut (bus.Bus.dead_letter)."""

    service: str
    subject: str
    reason: str
    payload: bytes
    headers: dict[str, str] = {}
    time_s: float = 0.0
    payload_bytes: int = 0
    truncated: bool = False
