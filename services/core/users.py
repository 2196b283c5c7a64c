"""Users and API keys: creation, hashed storage, authentication, revocation.

Keys are random (`otk-` + 43 url-safe characters, 256 bits) and stored only as argon2id
hashes (argon2-cffi, RFC 9106); a key's id is the first 16 hex digits of its BLAKE2b
digest, so a presented key finds its record without a scan and the id reveals nothing
usable. A verified key is remembered in memory (by its SHA-256) for VERIFIED_TTL_S so
that each request does not pay for argon2, but its record is read from KV on every
request, so a revocation takes effect at once.

Bootstrap: `OPENTINKER_ADMIN_KEY` (the key itself, in the environment) or
`OPENTINKER_ADMIN_KEY_FILE` (a file holding it) makes user "admin" with that key when
the scheduler starts. There is no default key: without either, only existing users
can authenticate.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import time
from pathlib import Path

import msgspec
from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from opentinker.schemas import decode, encode
from opentinker.schemas import subjects as S
from opentinker.schemas.users import USER_NAME_RE, ApiKey, Role, User
from opentinker.services.core.bus import Bus

log = logging.getLogger("opentinker.users")
USER_RE = USER_NAME_RE
KEY_PREFIX = "otk-"
MIN_KEY_CHARS = 32
VERIFIED_TTL_S = 300.0
ADMIN = "admin"


class AuthError(Exception):
    """Authentication or authorization failed. `status`: 401 (no valid key) or 403
    (a valid key without the right)."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status
        self.reason = reason


class UserError(ValueError):
    """A bad user or key request; `field` names what is wrong, `status` the HTTP code."""

    def __init__(self, field: str, reason: str, status: int = 422):
        super().__init__(f"`{field}`: {reason}")
        self.field = field
        self.status = status


def key_id(key: str) -> str:
    """The lookup id of an API key: 16 hex digits of BLAKE2b(key)."""
    return hashlib.blake2b(key.encode(), digest_size=8).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


class Users:
    """The user and key store over KV, with argon2 verification."""

    def __init__(self, bus: Bus):
        self.bus = bus
        self.hasher = PasswordHasher()
        self._verified: dict[str, tuple[str, float]] = {}  # sha256(key) -> (key_id, until)

    async def _get(self, bucket: str, key: str, kind):
        try:
            entry = await (await self.bus.kv(bucket)).get(key)
        except KeyNotFoundError:
            return None
        return decode(entry.value, kind) if entry.value else None

    async def user(self, name: str) -> User | None:
        return await self._get(S.KV_USERS, name, User) if USER_RE.match(name) else None

    async def _all(self, bucket: str, kind):
        """Every readable record of `bucket`; an unreadable one is logged and skipped
        (one bad entry must not stop every placement round, as it once did)."""
        out = []
        for key, (value, _) in (await self.bus.kv_values(bucket)).items():
            try:
                rec = decode(value, kind)
            except msgspec.MsgspecError as e:
                log.warning("ignoring an unreadable %s entry %r: %s", bucket, key, e)
                continue
            if getattr(rec, "name", None) == key or getattr(rec, "key_id", None) == key:
                out.append(rec)
            else:
                log.warning("ignoring %s entry %r: it describes another key", bucket, key)
        return out

    async def users(self) -> list[User]:
        return sorted(await self._all(S.KV_USERS, User), key=lambda u: u.name)

    async def keys(self, user: str | None = None) -> list[ApiKey]:
        out = await self._all(S.KV_KEYS, ApiKey)
        return sorted((k for k in out if user is None or k.user == user), key=lambda k: k.created_s)

    async def create_user(self, name: str, role: Role = "user", max_jobs: int = 0, max_workers: int = 0) -> User:
        """Raises UserError (bad name or quota: 422; the name is taken: 409)."""
        if not USER_RE.match(name):
            raise UserError("name", f"{name!r} must match {USER_RE.pattern}")
        if max_jobs < 0 or max_workers < 0:
            raise UserError("max_jobs" if max_jobs < 0 else "max_workers", "must be >= 0 (0 = the default)")
        user = User(name=name, role=role, max_jobs=max_jobs, max_workers=max_workers, created_s=time.time())
        try:
            await (await self.bus.kv(S.KV_USERS)).create(name, encode(user))
        except KeyWrongLastSequenceError:
            raise UserError("name", f"user {name!r} exists", status=409) from None
        return user

    async def create_key(self, user: str, label: str = "", key: str | None = None) -> tuple[ApiKey, str]:
        """A new key for `user`: (its record, the key itself, shown only now)."""
        if await self.user(user) is None:
            raise UserError("user", f"no user {user!r}", status=404)
        key = key or new_key()
        rec = ApiKey(key_id=key_id(key), user=user, hash=self.hasher.hash(key), label=label[:200],
                     created_s=time.time())
        await (await self.bus.kv(S.KV_KEYS)).put(rec.key_id, encode(rec))
        return rec, key

    async def key(self, kid: str) -> ApiKey | None:
        """The stored key with id `kid`, or None."""
        return await self._get(S.KV_KEYS, kid, ApiKey) if re.fullmatch(r"[0-9a-f]{16}", kid) else None

    async def revoke(self, kid: str) -> ApiKey:
        """Mark key `kid` revoked. Raises UserError (404) if there is no such key."""
        rec = await self.key(kid)
        if rec is None:
            raise UserError("key_id", f"no key {kid!r}", status=404)
        if not rec.revoked_s:
            rec = msgspec.structs.replace(rec, revoked_s=time.time())
            await (await self.bus.kv(S.KV_KEYS)).put(kid, encode(rec))
        return rec

    async def authenticate(self, key: str | None) -> User:
        """The user a key belongs to. Raises AuthError(401) for a missing, unknown,
        wrong or revoked key, or a disabled user."""
        if not key:
            raise AuthError(401, "missing API key (send `Authorization: Bearer <key>`)")
        rec = await self._get(S.KV_KEYS, key_id(key), ApiKey)
        if rec is None:
            raise AuthError(401, "invalid API key")
        if rec.revoked_s:
            raise AuthError(401, f"API key {rec.key_id} was revoked")
        digest = hashlib.sha256(key.encode()).hexdigest()
        cached = self._verified.get(digest)
        if cached is None or cached[0] != rec.key_id or cached[1] < time.monotonic():
            try:
                self.hasher.verify(rec.hash, key)
            except (VerificationError, InvalidHashError):
                raise AuthError(401, "invalid API key") from None
            self._verified[digest] = (rec.key_id, time.monotonic() + VERIFIED_TTL_S)
        user = await self.user(rec.user)
        if user is None or user.disabled:
            raise AuthError(401, f"user {rec.user!r} is disabled or gone")
        return user

    async def bootstrap_admin(self) -> bool:
        """Create user "admin" with the key in $OPENTINKER_ADMIN_KEY or the file named
        by $OPENTINKER_ADMIN_KEY_FILE (if set). Returns whether a key was given.
        Raises ValueError for a key shorter than MIN_KEY_CHARS."""
        key = os.environ.get("OPENTINKER_ADMIN_KEY", "")
        path = os.environ.get("OPENTINKER_ADMIN_KEY_FILE", "")
        if not key and path:
            key = Path(path).read_text().strip()
        if not key:
            if await self.user(ADMIN) is None:
                log.warning("no admin user and no OPENTINKER_ADMIN_KEY(_FILE): nobody can create users")
            return False
        if len(key) < MIN_KEY_CHARS:
            raise ValueError(f"the admin key must have at least {MIN_KEY_CHARS} characters")
        if await self.user(ADMIN) is None:
            try:
                await self.create_user(ADMIN, role="admin")
            except UserError as e:
                if e.status != 409:
                    raise
        existing = await self._get(S.KV_KEYS, key_id(key), ApiKey)
        if existing is None or existing.user != ADMIN:
            await self.create_key(ADMIN, label="bootstrap", key=key)
            log.info("admin key %s installed from the environment", key_id(key))
        return True
