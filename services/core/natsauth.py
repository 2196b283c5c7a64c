"""Tenant isolation on the bus: NATS auth callout, NATS JWTs and nkeys.

Two kinds of NATS identity (what a NATS operator would set up; nats-server docs,
"Auth callout", and ADR-26 in nats-io/nats-architecture-and-design):

- **Services** (scheduler, learner, rollout, envhost, recorder, operators' tools)
  authenticate with an nkey: a seed file named by `$NATS_NKEY`, its public key listed in
  the server config. They bypass the callout (`auth_users`) and may use the whole
  account, JetStream included.
- **Users** (the SDK and CLI with an API key) connect with the key as their token.
  nats-server hands every such connection to the scheduler's auth callout
  (`$SYS.REQ.USER.AUTH`), which checks the key (argon2, as the REST API does) and
  answers with a user JWT whose permissions reach only that user's own job subjects,
  computed when the connection is made:
    publish   ot.ctl.submit, ot.ctl.cancel, ot.job.<own>.rollout.>, ot.job.<own>.events
    subscribe ot.job.<own>.>, _INBOX.<key id>.>  (the SDK's inbox prefix)
  No JetStream API and no KV: a user's history and records come from the REST API.
  An admin key reaches every job's subjects the same way. The JWT expires after
  USER_JWT_TTL_S; the client reconnects and the callout grants afresh (new jobs, and a
  revoked key is refused).

The JWTs are NATS's format (nats-io/jwt v2): base64url header
`{"typ":"JWT","alg":"ed25519-nkey"}`, claims, and an ed25519 signature by an nkey over
`header.claims`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import nacl.exceptions
import nacl.signing
import nkeys

log = logging.getLogger("opentinker.natsauth")

CALLOUT_SUBJECT = "$SYS.REQ.USER.AUTH"
CALLOUT_QUEUE = "ot-auth-callout"
REQUEST_AUDIENCE = "nats-authorization-request"
ACCOUNT = "OT"                 # the one account services and users share
USER_JWT_TTL_S = 3600          # a user connection re-authenticates this often
GRANT_FINISHED_S = 3600.0      # finished jobs stay in a new grant this long
_HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}


class JwtError(ValueError):
    """A JWT that is malformed or whose signature does not verify."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def new_seed(kind: str) -> bytes:
    """A fresh nkey seed (`S...`) for kind "user" or "account"."""
    prefix = {"user": nkeys.PREFIX_BYTE_USER, "account": nkeys.PREFIX_BYTE_ACCOUNT}[kind]
    return nkeys.encode_seed(os.urandom(32), prefix)


def public_key(seed: bytes | str) -> str:
    """The public nkey (`U...`/`A...`) of a seed."""
    return nkeys.from_seed(seed.encode() if isinstance(seed, str) else seed).public_key.decode()


def ensure_seed_file(path: str | Path, kind: str) -> str:
    """Make `path` hold an nkey seed (mode 0600) unless it does; return the public key."""
    p = Path(path)
    if not p.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(new_seed(kind) + b"\n")
    return public_key(p.read_bytes().strip())


def _verify_key(public: str) -> nacl.signing.VerifyKey:
    raw = base64.b32decode(public + "=" * (-len(public) % 8))
    if len(raw) != 35:  # prefix byte, 32-byte key, crc16
        raise JwtError(f"not an nkey public key: {public[:8]}...")
    return nacl.signing.VerifyKey(raw[1:33])


def encode_jwt(claims: dict[str, Any], signer: nkeys.KeyPair) -> str:
    """Sign `claims` as a NATS JWT. Sets `iss` (the signer's public key), `iat` and `jti`
    (base32 of the SHA-512/256 of the claims, as nats-io/jwt does)."""
    claims = dict(claims, iss=signer.public_key.decode(), iat=int(time.time()), jti="")
    body = json.dumps(claims, separators=(",", ":"), sort_keys=True).encode()
    claims["jti"] = base64.b32encode(hashlib.new("sha512_256", body).digest()).decode().rstrip("=")
    signing_input = _b64(json.dumps(_HEADER).encode()) + "." + _b64(json.dumps(claims).encode())
    return signing_input + "." + _b64(signer.sign(signing_input.encode()))


def decode_jwt(token: str) -> dict[str, Any]:
    """The claims of a NATS JWT, after checking the signature against its own `iss`.
    Raises JwtError."""
    try:
        head, body, sig = token.split(".")
        header = json.loads(_unb64(head))
        claims = json.loads(_unb64(body))
    except (ValueError, json.JSONDecodeError) as e:
        raise JwtError(f"malformed JWT: {e}") from None
    if header.get("alg") not in ("ed25519-nkey", "ed25519"):
        raise JwtError(f"JWT alg {header.get('alg')!r} is not ed25519-nkey")
    try:
        _verify_key(claims["iss"]).verify(f"{head}.{body}".encode(), _unb64(sig))
    except (KeyError, nacl.exceptions.BadSignatureError, ValueError) as e:
        raise JwtError(f"JWT signature does not verify: {e!r}") from None
    return claims


def user_inbox_prefix(key_id: str) -> str:
    """The inbox prefix a user's client must use: `_INBOX.<key id>` (its replies land
    under it, and it may subscribe nowhere else in `_INBOX`)."""
    return f"_INBOX.{key_id}"


def user_permissions(job_ids: Iterable[str] | None, key_id: str) -> dict[str, Any]:
    """The publish/subscribe allow-lists of a user's connection. `job_ids`: the jobs it
    may reach (None: every job, for an admin)."""
    jobs = ["*"] if job_ids is None else sorted(set(job_ids))
    pub = ["ot.ctl.submit", "ot.ctl.cancel"]
    sub = [user_inbox_prefix(key_id) + ".>"]
    for j in jobs:
        pub += [f"ot.job.{j}.rollout.>", f"ot.job.{j}.events"]
        sub.append(f"ot.job.{j}.>")
    return {"pub": {"allow": pub}, "sub": {"allow": sub}}


def user_claims(user_nkey: str, name: str, permissions: dict[str, Any], now: float | None = None) -> dict[str, Any]:
    """The claims of a user JWT placing the connection in ACCOUNT with `permissions`."""
    now = time.time() if now is None else now
    return {"sub": user_nkey, "name": name, "aud": ACCOUNT, "exp": int(now + USER_JWT_TTL_S),
            "nats": {**permissions, "subs": -1, "data": -1, "payload": -1, "type": "user", "version": 2}}


def response_claims(user_nkey: str, server_id: str, user_jwt: str = "", error: str = "") -> dict[str, Any]:
    """An authorization_response: the user JWT, or the reason the connection is refused."""
    nats: dict[str, Any] = {"type": "authorization_response", "version": 2}
    if user_jwt:
        nats["jwt"] = user_jwt
    else:
        nats["error"] = error or "not authorized"
    return {"sub": user_nkey, "aud": server_id, "nats": nats}


# Grant(token) -> (user name, job ids or None for all, key id); raises PermissionError
# with the reason to refuse.
Grant = Callable[[str], Awaitable[tuple[str, list[str] | None, str]]]


class AuthCallout:
    """The auth callout service: answers nats-server's authorization requests.

    `issuer`: the account nkey seed whose public key is `auth_callout.issuer` in the
    server config. `grant`: turns a presented token (an API key) into the user's name,
    jobs and key id, or raises PermissionError with the reason.
    """

    def __init__(self, nc, issuer_seed: bytes, grant: Grant):
        self.nc = nc
        self.issuer = nkeys.from_seed(issuer_seed)
        self.grant = grant
        self.sub = None

    async def start(self) -> None:
        self.sub = await self.nc.subscribe(CALLOUT_SUBJECT, queue=CALLOUT_QUEUE, cb=self.on_request)

    async def answer(self, request_jwt: str) -> str:
        """The signed authorization_response for one request JWT (never raises for a
        bad token: the response carries the reason, which nats-server logs)."""
        req = decode_jwt(request_jwt)
        nats = req.get("nats", {})
        if req.get("aud") != REQUEST_AUDIENCE or nats.get("type") != "authorization_request":
            raise JwtError("not an authorization request")
        user_nkey = nats["user_nkey"]
        server_id = nats["server_id"]["id"]
        token = (nats.get("connect_opts") or {}).get("auth_token", "")
        client = (nats.get("client_info") or {}).get("host", "?")
        try:
            if not token:
                raise PermissionError("no API key: connect with your OpenTinker API key as the token")
            name, jobs, kid = await self.grant(token)
        except PermissionError as e:
            log.warning("NATS connection from %s refused: %s", client, e)
            return encode_jwt(response_claims(user_nkey, server_id, error=str(e)), self.issuer)
        user_jwt = encode_jwt(user_claims(user_nkey, name, user_permissions(jobs, kid)), self.issuer)
        return encode_jwt(response_claims(user_nkey, server_id, user_jwt=user_jwt), self.issuer)

    async def on_request(self, msg) -> None:
        try:
            reply = await self.answer(msg.data.decode())
        except (JwtError, KeyError, UnicodeDecodeError) as e:
            log.warning("unreadable auth callout request: %s", e)
            return
        await msg.respond(reply.encode())


def server_auth_config(service_nkey: str, issuer: str) -> str:
    """The nats-server config block: one account (JetStream on) holding the services'
    nkey user, and the auth callout for everyone else."""
    return (
        f"accounts {{\n  {ACCOUNT}: {{\n    jetstream: enabled\n"
        f'    users: [ {{ nkey: "{service_nkey}" }} ]\n  }}\n}}\n'
        f"authorization {{\n  timeout: 5\n  auth_callout {{\n"
        f'    issuer: "{issuer}"\n    account: {ACCOUNT}\n'
        f'    auth_users: [ "{service_nkey}" ]\n  }}\n}}\n'
    )
