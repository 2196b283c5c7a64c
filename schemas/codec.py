"""One MessagePack encoder and one typed decoder per message type, made once."""

from functools import cache
from typing import TypeVar

import msgspec

T = TypeVar("T", bound=msgspec.Struct)

_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    """Encode a schema Struct to MessagePack bytes."""
    return _encoder.encode(msg)


@cache
def _decoder(kind: type) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(kind)


def decode(data: bytes, kind: type[T]) -> T:
    """Decode MessagePack bytes into `kind`.

    Raises msgspec.DecodeError (malformed bytes) or msgspec.ValidationError (wrong
    shape; the message names the offending field, e.g. "Expected `int`, got `str`
    - at `$.step`").
    """
    return _decoder(kind).decode(data)


def schema_name(kind: type) -> str:
    """The name carried in the `Ot-Schema` header, e.g. "Trajectory"."""
    return kind.__name__
