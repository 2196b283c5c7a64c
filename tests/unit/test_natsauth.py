"""NATS JWTs and the auth callout's answers (services/core/natsauth.py), without a
server: signatures verify, a tampered token does not, and the user JWT grants only the
user's own job subjects. The server side is tests/integration/test_isolation.py."""

import nkeys
import pytest

from opentinker.services.core import natsauth as A


def request_jwt(server: nkeys.KeyPair, token: str | None, user_nkey: str) -> str:
    claims = {"sub": "issuer", "aud": A.REQUEST_AUDIENCE,
              "nats": {"type": "authorization_request", "version": 2, "user_nkey": user_nkey,
                       "server_id": {"id": server.public_key.decode(), "name": "s"},
                       "client_info": {"host": "127.0.0.1"},
                       "connect_opts": {"auth_token": token} if token else {}}}
    return A.encode_jwt(claims, server)


def test_a_jwt_round_trips_and_a_tampered_one_is_refused():
    kp = nkeys.from_seed(A.new_seed("account"))
    token = A.encode_jwt({"sub": "x", "nats": {"type": "user"}}, kp)
    claims = A.decode_jwt(token)
    assert claims["iss"] == kp.public_key.decode() and claims["sub"] == "x" and claims["jti"]
    head, body, sig = token.split(".")
    other = A.encode_jwt({"sub": "y", "nats": {"type": "user"}}, kp).split(".")[1]
    with pytest.raises(A.JwtError, match="signature"):
        A.decode_jwt(f"{head}.{other}.{sig}")
    with pytest.raises(A.JwtError, match="malformed"):
        A.decode_jwt("not-a-jwt")


def test_a_user_may_subscribe_to_their_own_jobs_and_env_namespace_only_and_publish_only_replies():
    perms = A.user_permissions(["job-a", "job-b"], "alice")
    assert perms["sub"]["allow"] == ["ot.job.job-a.>", "ot.job.job-b.>", "ot.env.user.alice.>"]
    assert perms["pub"] == {"deny": [">"]}  # no publish but a reply to a request it received:
    assert perms["resp"] == {"max": 1, "ttl": int(A.RESPONSE_TTL_S * 1e9)}  # one each (ns)
    assert A.user_permissions(None, "root")["sub"]["allow"] == ["ot.job.*.>", "ot.env.user.root.>"]  # an admin
    # no jobs and no name: not an empty allow list (nats-server reads that as "anything")
    assert A.user_permissions([])["sub"] == {"deny": [">"]}
    with pytest.raises(ValueError):
        A.user_permissions([], "a.b")  # a name that is not one subject token


def test_xkeys_seal_and_open_as_nkeys_xkv1_and_refuse_tampering():
    a = A.XKey.from_seed(A.new_seed("curve"))
    b = A.XKey.from_seed(A.new_seed("curve"))
    assert a.public.startswith("X") and A.public_key(A.new_seed("curve")).startswith("X")
    sealed = a.seal(b"the request", b.public)
    assert sealed.startswith(b"xkv1") and b"the request" not in sealed
    assert b.open(sealed, a.public) == b"the request"
    with pytest.raises(A.JwtError, match="does not open"):
        b.open(sealed[:-1] + bytes([sealed[-1] ^ 1]), a.public)
    with pytest.raises(A.JwtError, match="does not open"):
        A.XKey.from_seed(A.new_seed("curve")).open(sealed, a.public)  # not the recipient
    with pytest.raises(A.JwtError):
        A.XKey.from_seed(A.new_seed("user"))  # not a curve seed


def test_the_server_config_separates_services_tenants_and_the_system_account():
    conf = A.server_auth_config("USVC", "AISS", "XKEY", "USYS")
    assert 'OT: {\n    jetstream: enabled\n    users: [ { nkey: "USVC" } ]' in conf
    assert 'exports: [ { stream: "ot.job.>" } ]' in conf
    assert 'TENANTS: {\n    imports: [ { stream: { account: OT, subject: "ot.job.>" } } ]' in conf
    # the services reach the users' own envhosts (a service import of TENANTS' export);
    # TENANTS imports no service: nothing a user sends reaches OT but a reply
    assert 'imports: [ { service: { account: TENANTS, subject: "ot.env.user.>" } } ]' in conf
    assert 'exports: [ { service: "ot.env.user.>" } ]' in conf
    tenants = conf[conf.index("TENANTS: {"):conf.index("SYS: {")]
    assert "imports: [ { service" not in tenants
    assert 'xkey: "XKEY"' in conf and 'auth_users: [ "USVC", "USYS" ]' in conf
    assert "system_account: SYS" in conf


async def test_the_callout_answers_with_a_signed_grant_or_the_reason():
    issuer_seed = A.new_seed("account")
    issuer = nkeys.from_seed(issuer_seed)
    server = nkeys.from_seed(nkeys.encode_seed(b"\x01" * 32, nkeys.PREFIX_BYTE_SERVER))
    user_nkey = A.public_key(A.new_seed("user"))

    async def grant(token: str):
        if token != "otk-good":
            raise PermissionError("wrong API key")
        return "alice", ["job-a"], "k1"

    callout = A.AuthCallout(None, issuer_seed, grant)
    ok = A.decode_jwt(await callout.answer(request_jwt(server, "otk-good", user_nkey)))
    assert ok["iss"] == issuer.public_key.decode()
    assert ok["sub"] == user_nkey and ok["aud"] == server.public_key.decode()
    user = A.decode_jwt(ok["nats"]["jwt"])
    assert user["sub"] == user_nkey and user["aud"] == A.TENANT_ACCOUNT and user["name"] == "alice/k1"
    assert user["nats"]["sub"]["allow"] == ["ot.job.job-a.>", "ot.env.user.alice.>"]
    assert user["nats"]["pub"] == {"deny": [">"]} and user["nats"]["resp"]["max"] == 1
    assert user["nats"]["payload"] == A.TENANT_PAYLOAD_BYTES
    assert user["exp"] - user["iat"] == A.USER_JWT_TTL_S

    for token, reason in (("otk-bad", "wrong API key"), (None, "no API key")):
        refused = A.decode_jwt(await callout.answer(request_jwt(server, token, user_nkey)))
        assert "jwt" not in refused["nats"] and reason in refused["nats"]["error"]

    with pytest.raises(A.JwtError, match="not an authorization request"):
        await callout.answer(A.encode_jwt({"aud": "elsewhere", "nats": {}}, server))


class _Msg:
    def __init__(self, data: bytes, headers: dict):
        self.data, self.headers, self.sent = data, headers, []

    async def respond(self, data: bytes) -> None:
        self.sent.append(data)


async def test_the_callout_opens_sealed_requests_and_seals_its_answer():
    issuer_seed, xkey_seed = A.new_seed("account"), A.new_seed("curve")
    server = nkeys.from_seed(nkeys.encode_seed(b"\x02" * 32, nkeys.PREFIX_BYTE_SERVER))
    server_x = A.XKey.from_seed(A.new_seed("curve"))
    callout_x = A.XKey.from_seed(xkey_seed)
    user_nkey = A.public_key(A.new_seed("user"))

    async def grant(token: str):
        return "bob", [], "k2"

    callout = A.AuthCallout(None, issuer_seed, grant, xkey_seed)
    req = server_x.seal(request_jwt(server, "otk-x", user_nkey).encode(), callout_x.public)
    msg = _Msg(req, {A.SERVER_XKEY_HEADER: server_x.public})
    await callout.on_request(msg)
    answer = A.decode_jwt(server_x.open(msg.sent[0], callout_x.public).decode())
    assert answer["sub"] == user_nkey and "jwt" in answer["nats"]
    # an unsealed request to a callout that expects sealed ones gets no answer at all
    plain = _Msg(request_jwt(server, "otk-x", user_nkey).encode(), {})
    await callout.on_request(plain)
    assert plain.sent == []
