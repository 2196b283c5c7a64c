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


def test_a_user_is_granted_only_their_own_jobs_and_inbox():
    perms = A.user_permissions(["job-a", "job-b"], "k1")
    assert perms["sub"]["allow"] == ["_INBOX.k1.>", "ot.job.job-a.>", "ot.job.job-b.>"]
    assert "ot.job.job-a.events" in perms["pub"]["allow"] and "ot.ctl.submit" in perms["pub"]["allow"]
    assert not any(s.startswith(("$JS", "_INBOX", "ot.ctl.assign")) or s == "ot.job.*.>"
                   for s in perms["pub"]["allow"] + perms["sub"]["allow"][1:])
    assert "ot.job.*.>" in A.user_permissions(None, "k1")["sub"]["allow"]  # an admin


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
    assert user["sub"] == user_nkey and user["aud"] == A.ACCOUNT and user["name"] == "alice"
    assert user["nats"]["sub"]["allow"] == ["_INBOX.k1.>", "ot.job.job-a.>"]
    assert user["exp"] - user["iat"] == A.USER_JWT_TTL_S

    for token, reason in (("otk-bad", "wrong API key"), (None, "no API key")):
        refused = A.decode_jwt(await callout.answer(request_jwt(server, token, user_nkey)))
        assert "jwt" not in refused["nats"] and reason in refused["nats"]["error"]

    with pytest.raises(A.JwtError, match="not an authorization request"):
        await callout.answer(A.encode_jwt({"aud": "elsewhere", "nats": {}}, server))
