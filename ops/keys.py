"""`opentinker nats-keys DIR`: a deployment's NATS keys, made once (compose/ uses them)."""

from __future__ import annotations

from pathlib import Path

from opentinker.services.core.natsauth import ensure_seed_file, server_auth_config


def write_nats_keys(out: Path, say=print) -> None:
    """Make the NATS keys of a deployment (services/core/natsauth.py) in `out`, once:
    the services' nkey seed, the auth callout's issuer seed and xkey seed, the system
    account's nkey seed (all 0600, secrets) and `auth.conf`, the server config block
    with their public keys and the accounts (include it)."""
    svc = ensure_seed_file(out / "service.nk", "user")
    issuer = ensure_seed_file(out / "callout-issuer.nk", "account")
    xkey = ensure_seed_file(out / "callout.xk", "curve")
    system = ensure_seed_file(out / "system.nk", "user")
    (out / "auth.conf").write_text(server_auth_config(svc, issuer, xkey, system))
    say(f"{out / 'service.nk'}: the services' nkey seed (NATS_NKEY), public key {svc}")
    say(f"{out / 'callout-issuer.nk'}: the scheduler's callout issuer seed "
        f"(OPENTINKER_NATS_CALLOUT_ISSUER_FILE), public key {issuer}")
    say(f"{out / 'callout.xk'}: the scheduler's callout xkey seed (OPENTINKER_NATS_CALLOUT_XKEY_FILE), "
        f"public key {xkey}")
    say(f"{out / 'system.nk'}: the scheduler's system-account nkey seed (OPENTINKER_NATS_SYSTEM_NKEY_FILE), "
        f"public key {system}")
    say(f"{out / 'auth.conf'}: include it in the nats-server config")
