"""Tenant isolation on the bus: NATS accounts, the auth callout, NATS JWTs, nkeys and
xkeys.

Three NATS accounts (what a NATS operator would set up: nats-server docs, "Accounts"
and "Auth callout"; ADR-26 in nats-io/nats-architecture-and-design):

- **OT** holds the services (scheduler, learner, rollout, envhost, recorder, operators'
  tools) and JetStream. Services authenticate with an nkey (a seed file named by
  `$NATS_NKEY`, its public key listed in the server config) and bypass the callout.
- **TENANTS** holds every API-key user (the SDK and CLI of a shared service). It has no
  JetStream, no KV and no service of its own: it imports, read-only, the stream of job
  subjects `ot.job.>` exported by OT. A user's connection may subscribe to its own
  jobs' subjects only (`ot.job.<own>.>`, every job for an admin) and may publish
  nothing at all: a user submits and cancels jobs over the REST API. So no publish,
  reply subject or JetStream PubAck of a user can reach a service's subject, a KV
  bucket or another tenant: those live in another account, which imports nothing from
  TENANTS.
- **SYS**, the system account, holds one nkey user the scheduler uses to find and
  disconnect a revoked key's live connections (`$SYS.REQ.SERVER.PING.CONNZ`,
  `$SYS.REQ.SERVER.<id>.KICK`).

nats-server hands every connection that is not a service's to the scheduler's auth
callout (`$SYS.REQ.USER.AUTH`), encrypted with the callout's xkey (curve25519 box, the
nkeys `xkv1` format). The scheduler checks the API key (argon2, as the REST API does)
and answers with a user JWT placing the connection in TENANTS with the permissions
above, computed when the connection is made; the JWT expires after USER_JWT_TTL_S and
the client reconnects (a revoked key is refused, and its live connections are kicked
when it is revoked).

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
import nacl.public
import nacl.signing
import nacl.utils
import nkeys

from opentinker.schemas import env as S_ENV
from opentinker.schemas import subjects as S

log = logging.getLogger("opentinker.natsauth")

CALLOUT_SUBJECT = "$SYS.REQ.USER.AUTH"
CALLOUT_QUEUE = "ot-auth-callout"
SERVER_XKEY_HEADER = "Nats-Server-Xkey"  # the server's xkey, on a sealed callout request
REQUEST_AUDIENCE = "nats-authorization-request"
ACCOUNT = "OT"                 # services and JetStream
TENANT_ACCOUNT = "TENANTS"     # every API-key user (no JetStream; imports ot.job.> read-only)
SYSTEM_ACCOUNT = "SYS"         # the system account (connection listing and kicks)
JOB_STREAM_EXPORT = "ot.job.>"  # what TENANTS sees of OT: job subjects, filtered per user
USER_JWT_TTL_S = 3600          # a user connection re-authenticates this often
GRANT_FINISHED_S = 3600.0      # finished jobs stay in a new grant this long
TENANT_ENV_EXPORT = S.TENANT_ENVS + ".>"  # what OT reaches of TENANTS: users' own envhosts
RESPONSE_TTL_S = 180.0         # a user's envhost may answer a request this long after it came
TENANT_PAYLOAD_BYTES = S_ENV.ENV_REPLY_BYTES  # the largest message a user's connection may send
_HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}


class JwtError(ValueError):
    """A JWT that is malformed or whose signature does not verify."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def new_seed(kind: str) -> bytes:
    """A fresh nkey seed (`S...`) for kind "user", "account" or "curve" (an xkey)."""
    if kind == "curve":
        return _encode_curve_seed(os.urandom(32))
    prefix = {"user": nkeys.PREFIX_BYTE_USER, "account": nkeys.PREFIX_BYTE_ACCOUNT}[kind]
    return nkeys.encode_seed(os.urandom(32), prefix)


def public_key(seed: bytes | str) -> str:
    """The public nkey (`U...`/`A...`, or `X...` for an xkey) of a seed."""
    seed = seed.encode() if isinstance(seed, str) else seed
    if seed.startswith(b"SX"):
        return curve_public_key(XKey.from_seed(seed).private.public_key)
    return nkeys.from_seed(seed).public_key.decode()


# -- xkeys: curve25519 keys in nkey encoding, and the `xkv1` sealed box --------------
# The nkeys library on PyPI (0.2.1) has no curve keys; this follows nkeys' xkeys.go:
# a curve seed is base32(seed prefix | curve prefix, 32 raw bytes, crc16), the public
# key base32(curve prefix, 32 bytes, crc16), and a sealed message is
# b"xkv1" + 24-byte nonce + NaCl box (curve25519-xsalsa20-poly1305) of the plaintext.

_PREFIX_CURVE = 23 << 3  # base32 'X'
_XKEY_V1 = b"xkv1"
_NONCE = 24


def _b32(raw: bytes) -> bytes:
    return base64.b32encode(raw + bytes(nkeys.crc16_checksum(bytearray(raw)))).rstrip(b"=")


def _unb32(text: bytes | str) -> bytes:
    """The body of an nkey string after checking its crc16. Raises JwtError."""
    text = text.encode() if isinstance(text, str) else text
    try:
        raw = base64.b32decode(text + b"=" * (-len(text) % 8))
    except ValueError as e:
        raise JwtError(f"not an nkey: {e}") from None
    body, crc = raw[:-2], raw[-2:]
    if len(raw) < 3 or bytes(nkeys.crc16_checksum(bytearray(body))) != crc:
        raise JwtError("nkey checksum does not match")
    return body


def _encode_curve_seed(raw: bytes) -> bytes:
    return _b32(bytes([nkeys.PREFIX_BYTE_SEED | _PREFIX_CURVE >> 5, (31 & _PREFIX_CURVE) << 3]) + raw)


def curve_public_key(key: nacl.public.PublicKey) -> str:
    """`X...`: a curve25519 public key in nkey encoding."""
    return _b32(bytes([_PREFIX_CURVE]) + bytes(key)).decode()


def parse_curve_public_key(text: str) -> nacl.public.PublicKey:
    """The key of an `X...` string. Raises JwtError."""
    body = _unb32(text)
    if len(body) != 33 or body[0] != _PREFIX_CURVE:
        raise JwtError(f"not a curve (xkey) public key: {text[:8]}...")
    return nacl.public.PublicKey(body[1:])


class XKey:
    """A curve25519 key pair (an nkeys "xkey"): seal to, and open from, another xkey."""

    def __init__(self, private: nacl.public.PrivateKey):
        self.private = private

    @classmethod
    def from_seed(cls, seed: bytes | str) -> XKey:
        """Raises JwtError for a seed that is not a curve seed."""
        body = _unb32(seed)
        prefix = (body[0] & 7) << 5 | (body[1] & 248) >> 3
        if len(body) != 34 or body[0] & 248 != nkeys.PREFIX_BYTE_SEED or prefix != _PREFIX_CURVE:
            raise JwtError("not a curve (xkey) seed")
        return cls(nacl.public.PrivateKey(body[2:]))

    @property
    def public(self) -> str:
        return curve_public_key(self.private.public_key)

    def seal(self, data: bytes, recipient: str) -> bytes:
        """`data` encrypted and authenticated for `recipient` (an `X...` key)."""
        nonce = nacl.utils.random(_NONCE)
        box = nacl.public.Box(self.private, parse_curve_public_key(recipient))
        return _XKEY_V1 + nonce + box.encrypt(data, nonce).ciphertext

    def open(self, data: bytes, sender: str) -> bytes:
        """The plaintext of a message `sender` sealed for us. Raises JwtError."""
        if not data.startswith(_XKEY_V1) or len(data) < len(_XKEY_V1) + _NONCE:
            raise JwtError("not an xkv1 sealed message")
        nonce, body = data[4:4 + _NONCE], data[4 + _NONCE:]
        try:
            return nacl.public.Box(self.private, parse_curve_public_key(sender)).decrypt(body, nonce)
        except nacl.exceptions.CryptoError as e:
            raise JwtError(f"sealed message does not open: {e}") from None


def ensure_seed_file(path: str | Path, kind: str) -> str:
    """Make `path` hold an nkey seed of `kind` ("user", "account", "curve"; mode 0600)
    unless it does; return the public key."""
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


def user_permissions(job_ids: Iterable[str] | None, user: str = "") -> dict[str, Any]:
    """The publish/subscribe permissions of a user's connection: subscribe to the
    subjects of `job_ids` (None: every job, for an admin) and to the user's own env
    namespace `ot.env.user.<user>.>` (an envhost the user runs); publish nothing but
    one reply to each request the connection received, within RESPONSE_TTL_S (NATS's
    response permission, "allow_responses"). A user submits and cancels over the REST
    API; the only thing a user's connection can send is an env reply, and only as an
    answer to a service's request."""
    jobs = ["*"] if job_ids is None else sorted(set(job_ids))
    allow = [f"ot.job.{j}.>" for j in jobs] + ([S.tenant_envs(user)] if user else [])
    # an empty allow list would mean "no restriction" to nats-server: a user with no
    # jobs yet (and no name) is denied every subscription instead
    sub = {"allow": allow} if allow else {"deny": [">"]}
    return {"pub": {"deny": [">"]}, "sub": sub,
            "resp": {"max": 1, "ttl": int(RESPONSE_TTL_S * 1e9)}}


def connection_name(user: str, key_id: str) -> str:
    """The name a user's NATS connection carries (the JWT `name`, CONNZ's
    `authorized_user`): `<user>/<key id>`, so a revoked key's connections can be found."""
    return f"{user}/{key_id}"


def user_claims(user_nkey: str, name: str, permissions: dict[str, Any], now: float | None = None) -> dict[str, Any]:
    """The claims of a user JWT placing the connection in TENANT_ACCOUNT (in a
    config-mode server the JWT's `aud` names the account) with `permissions`; the
    connection may send messages of at most TENANT_PAYLOAD_BYTES (its env replies)."""
    now = time.time() if now is None else now
    return {"sub": user_nkey, "name": name, "aud": TENANT_ACCOUNT, "exp": int(now + USER_JWT_TTL_S),
            "nats": {**permissions, "subs": -1, "data": -1, "payload": TENANT_PAYLOAD_BYTES, "type": "user",
                     "version": 2}}


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
    jobs and key id, or raises PermissionError with the reason. `xkey`: the curve seed
    whose public key is `auth_callout.xkey` (requests arrive sealed to it, answers go
    back sealed to the server's xkey); None for a server configured without one.
    """

    def __init__(self, nc, issuer_seed: bytes, grant: Grant, xkey_seed: bytes | None = None,
                 on_unreadable: Callable[[Any, str], Awaitable[None]] | None = None):
        self.nc = nc
        self.issuer = nkeys.from_seed(issuer_seed)
        self.grant = grant
        self.xkey = XKey.from_seed(xkey_seed) if xkey_seed else None
        self.on_unreadable = on_unreadable  # (msg, reason): e.g. Bus.dead_letter
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
        user_jwt = encode_jwt(user_claims(user_nkey, connection_name(name, kid), user_permissions(jobs, name)),
                              self.issuer)
        return encode_jwt(response_claims(user_nkey, server_id, user_jwt=user_jwt), self.issuer)

    async def on_request(self, msg) -> None:
        server_xkey = (msg.headers or {}).get(SERVER_XKEY_HEADER, "")
        try:
            if server_xkey:
                if self.xkey is None:
                    raise JwtError("the server seals its requests but this callout has no xkey")
                data = self.xkey.open(msg.data, server_xkey)
            elif self.xkey is not None:
                raise JwtError("an unsealed request, but the callout expects sealed ones")
            else:
                data = msg.data
            reply = (await self.answer(data.decode())).encode()
        except (JwtError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
            log.warning("unreadable auth callout request: %s", e)
            if self.on_unreadable is not None:
                await self.on_unreadable(msg, f"unreadable auth callout request: {e!r}")
            return
        await msg.respond(self.xkey.seal(reply, server_xkey) if server_xkey else reply)



class SystemClient:
    """The system account's view of the servers: a revoked key's live connections, and
    kicking them (nats-server's `$SYS.REQ.SERVER.PING.CONNZ` and
    `$SYS.REQ.SERVER.<id>.KICK`). `nc`: a connection as the SYS account's nkey user."""

    def __init__(self, nc, gather_s: float = 0.5):
        self.nc = nc
        self.gather_s = gather_s

    async def _ping(self, subject: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        """Every server's answer to a PING request (one each, gathered for gather_s)."""
        import asyncio

        inbox = self.nc.new_inbox()
        got: list[dict[str, Any]] = []

        async def cb(m) -> None:
            try:
                got.append(json.loads(m.data))
            except ValueError:
                pass

        sub = await self.nc.subscribe(inbox, cb=cb)
        try:
            await self.nc.publish(subject, json.dumps(body).encode(), reply=inbox)
            await self.nc.flush()
            await asyncio.sleep(self.gather_s)
        finally:
            await sub.unsubscribe()
        return got

    async def connections(self, name_prefix: str) -> list[tuple[str, int]]:
        """(server id, client id) of every TENANTS connection whose name starts with
        `name_prefix`."""
        out = []
        for answer in await self._ping("$SYS.REQ.SERVER.PING.CONNZ",
                                       {"acc": TENANT_ACCOUNT, "auth": True, "limit": 100_000}):
            server = (answer.get("server") or {}).get("id", "")
            for c in (answer.get("data") or {}).get("connections") or []:
                if str(c.get("authorized_user", "")).startswith(name_prefix):
                    out.append((server, int(c["cid"])))
        return out

    async def kick(self, user: str, key_id: str) -> int:
        """Disconnect every live connection made with key `key_id` of `user`; returns how
        many were kicked."""
        n = 0
        for server, cid in await self.connections(connection_name(user, key_id)):
            r = await self.nc.request(f"$SYS.REQ.SERVER.{server}.KICK", json.dumps({"cid": cid}).encode(),
                                      timeout=5)
            err = (json.loads(r.data) or {}).get("error")
            if err:
                log.warning("kick of connection %d on %s failed: %s", cid, server, err)
            else:
                n += 1
        return n


def server_auth_config(service_nkey: str, issuer: str, xkey: str, system_nkey: str) -> str:
    """The nats-server config block: account OT (JetStream, the services' nkey user,
    exporting the job subjects), account TENANTS (API-key users, importing them), the
    system account with its nkey user, and the auth callout (sealed with `xkey`) for
    every connection that is not one of those two nkeys."""
    return (
        "accounts {\n"
        f"  {ACCOUNT}: {{\n    jetstream: enabled\n"
        f'    users: [ {{ nkey: "{service_nkey}" }} ]\n'
        f'    exports: [ {{ stream: "{JOB_STREAM_EXPORT}" }} ]\n'
        f'    imports: [ {{ service: {{ account: {TENANT_ACCOUNT}, subject: "{TENANT_ENV_EXPORT}" }} }} ]\n  }}\n'
        f"  {TENANT_ACCOUNT}: {{\n"
        f'    imports: [ {{ stream: {{ account: {ACCOUNT}, subject: "{JOB_STREAM_EXPORT}" }} }} ]\n'
        f'    exports: [ {{ service: "{TENANT_ENV_EXPORT}" }} ]\n  }}\n'
        f'  {SYSTEM_ACCOUNT}: {{\n    users: [ {{ nkey: "{system_nkey}" }} ]\n  }}\n'
        "}\n"
        f"system_account: {SYSTEM_ACCOUNT}\n"
        "authorization {\n  timeout: 5\n  auth_callout {\n"
        f'    issuer: "{issuer}"\n    account: {ACCOUNT}\n'
        f'    auth_users: [ "{service_nkey}", "{system_nkey}" ]\n'
        f'    xkey: "{xkey}"\n  }}\n}}\n'
    )
