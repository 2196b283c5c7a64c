"""The base of every bus message: frozen, keyword-only, versioned."""

import msgspec

# Bumped only when a field is removed or retyped (never done: new fields get defaults).
SCHEMA_VERSION = 1


class Message(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """Base class for bus messages. Unknown fields are ignored so newer producers
    can add fields (with defaults) without breaking older consumers."""

    schema_version: int = SCHEMA_VERSION
