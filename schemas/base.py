"""The base of every bus message: frozen, keyword-only, versioned; and the bounded
integer types its fields use, so an out-of-range value (a negative step, a uint64, a
token id a 32-bit column cannot hold) fails at decode, naming the field, in every
service alike, instead of deep inside one of them."""

from typing import Annotated

import msgspec

MAX_COUNT = 2**53  # the largest integer every consumer (JSON, JavaScript, float64) holds exactly

# steps, policy versions, attempts, indices, sizes, lengths
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
# a token id: stored as int32 in the trajectory log
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]
# a loss-mask entry
MaskBit = Annotated[int, msgspec.Meta(ge=0, le=1)]

# Bumped only when a field is removed or retyped (never done: new fields get defaults).
SCHEMA_VERSION = 1


class Message(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """Base class for bus messages. Unknown fields are ignored so newer producers
    can add fields (with defaults) without breaking older consumers."""

    schema_version: Count = SCHEMA_VERSION
