"""Users and API keys, as the scheduler keeps them in KV (`ot_users`, `ot_keys`).

An API key is shown once, when it is made; only its argon2 hash is stored. A key is
found by its id (a short hash of the key, `key_id`) and then checked against the hash.
"""

import re
from typing import Literal

from opentinker.schemas.base import Message

Role = Literal["admin", "user"]
# a user name: also a folder name (<home>/users/<user>/) and a subject token (ot.env.user.<user>.>)
USER_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


class User(Message, frozen=True, kw_only=True):
    """A user. Quotas of 0 mean the scheduler's defaults."""

    name: str
    role: Role = "user"
    max_jobs: int = 0
    max_workers: int = 0
    created_s: float = 0.0
    disabled: bool = False


class ApiKey(Message, frozen=True, kw_only=True):
    """A stored API key: its id, owner, argon2 hash; `revoked_s` > 0 once revoked."""

    key_id: str
    user: str
    hash: str
    label: str = ""
    created_s: float = 0.0
    revoked_s: float = 0.0
