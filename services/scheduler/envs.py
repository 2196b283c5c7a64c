"""Which envhosts serve a job's env: the submitter's own, else the operator's.

A job of user U naming `env = E` resolves, at submit, to
1. U's own served env, when an envhost of U's answers `ot.env.user.U.E.info` (a tenant's
   envhost, services/envhost/tenant.py): the job record's `env_owner` is then U and every
   env request of the job goes under `ot.env.user.U.`;
2. else the operator's E, when E is in the operator's catalog (KV `ot_envs`, written by
   the operator's envhosts) or an operator envhost answers `ot.env.E.info`;
3. else the job is refused, naming `env`. The refusal depends only on U's own envs and
   the operator's, so naming another user's env gets the same answer as naming one that
   does not exist (no existence oracle).
"""

from __future__ import annotations

import msgspec
import nats.errors

from opentinker.schemas import EnvInfoReply, EnvInfoRequest, JobSpec
from opentinker.schemas import subjects as S
from opentinker.schemas.job import SpecError
from opentinker.services.core.bus import Bus

INFO_TIMEOUT_S = 3.0  # a served env answers `info` at once; a stalling one counts as not served


def uses_env(spec: JobSpec, kind: str) -> bool:
    """Whether a job's episodes run an env: GRPO training (SFT and Tinker sessions do not;
    an inference job's episodes, if any, do, but it may just serve its model)."""
    return kind == "train" and spec.algorithm == "grpo"


async def serves(bus: Bus, env: str, owner: str) -> bool:
    """Whether an envhost answers `info` for `env` under `owner`'s namespace ("" = the
    operator's) with that env's name."""
    try:
        reply = await bus.request(S.env_info(env, owner), EnvInfoRequest(env=env), EnvInfoReply,
                                  timeout_s=INFO_TIMEOUT_S)
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError, msgspec.MsgspecError):
        return False
    return reply.env == env and bool(reply.host_id)


async def operator_catalog(bus: Bus) -> list[str]:
    """The env names the operator's envhosts have served (KV `ot_envs`), sorted."""
    return sorted(await bus.kv_values(S.KV_ENVS))


async def resolve_env_owner(bus: Bus, spec: JobSpec, kind: str, user: str) -> str:
    """`user` when the user's own envhost serves `spec.env`, "" for the operator's env
    (or a job that runs no env). Raises SpecError("env", ...) when neither serves it."""
    if not spec.env:
        return ""
    if user and await serves(bus, spec.env, user):
        return user
    if not uses_env(spec, kind):
        return ""
    catalog = await operator_catalog(bus)
    if spec.env in catalog or await serves(bus, spec.env, ""):
        return ""
    raise SpecError("env", f"no environment {spec.env!r} is served for you (the operator's: "
                           f"{', '.join(catalog) or 'none yet'}); serve your own with `opentinker envhost "
                           "--env FILE.py:Class` and submit while it runs")
