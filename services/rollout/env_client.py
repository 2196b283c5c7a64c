"""The rollout worker's client of the env hosts: agent_loop.EnvClient over NATS.

Calls (core request/reply, no stream): ot.env.<env>.init and ot.env.<env>.reset go to
any envhost serving the env; ot.env.host.<host>.step and ot.env.host.<host>.close go to
the host holding the episode's game (the host_id its reset replied with). A job whose
record names an `env_owner` (the user's own envhost, services/envhost/tenant.py) sends
the same calls under ot.env.user.<owner>. instead, and nowhere else. Transport failures,
replies that do not decode and replies over schemas.env's limits (check_env_reply: text
sizes, seats, tools, images, a reward that is not finite) become agent_loop.EnvError,
which ends that episode with the reason; such a reply is also dead-lettered
(`ot.dlq.rollout`) with the reason, naming the field.
"""

from __future__ import annotations

import re

import msgspec
import nats.errors
import tenacity

from opentinker.schemas import (
    EnvCloseRequest,
    EnvInitReply,
    EnvInitRequest,
    EnvResetReply,
    EnvResetRequest,
    EnvStepReply,
    EnvStepRequest,
    decode,
    encode,
)
from opentinker.schemas import subjects as S
from opentinker.schemas.env import check_env_reply
from opentinker.services.core.bus import Bus, undecodable
from opentinker.services.rollout.agent_loop import EnvError

ENV_SETUP_TIMEOUT_S = 30.0
ENV_SETUP_RETRY_S = 60.0     # how long init/reset wait for an envhost of the env to appear
ENV_STEP_TIMEOUT_S = 120.0   # a user's step may run tools or a verifier
ENV_CLOSE_TIMEOUT_S = 2.0
_HOST_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


class NatsEnvClient:
    """agent_loop.EnvClient over NATS request/reply; transport failures -> EnvError.

    Init and reset go to any envhost of the env, so "no env host serves it" there is
    retried with backoff for up to `setup_retry_s` (an envhost restarting, or starting
    after the job): an envhost restart costs time, not episodes. A step goes to the
    host holding the episode's game; if that host is gone, so is the game, and the
    episode ends with the error."""

    def __init__(self, bus: Bus, setup_retry_s: float = 0.0, owner: str = "",
                 step_timeout_s: float = ENV_STEP_TIMEOUT_S):
        self.bus = bus
        self.setup_retry_s = setup_retry_s
        self.owner = owner  # "" = the operator's envs; else the user whose own envhosts serve
        self.step_timeout_s = step_timeout_s

    def for_owner(self, owner: str) -> NatsEnvClient:
        """This client, sending to `owner`'s own envhosts ("" = the operator's)."""
        if owner == self.owner:
            return self
        return NatsEnvClient(self.bus, self.setup_retry_s, S.check_user(owner) if owner else "",
                             self.step_timeout_s)

    def _whose(self) -> str:
        return f"user {self.owner!r}'s own envhost" if self.owner else "the operator's envhost"

    async def _request(self, subject: str, msg: msgspec.Struct, kind: type, timeout_s: float,
                       retry_s: float = 0.0):
        try:
            async for attempt in tenacity.AsyncRetrying(
                    retry=tenacity.retry_if_exception_type(nats.errors.NoRespondersError),
                    wait=tenacity.wait_exponential_jitter(multiplier=0.5, max=5.0, jitter=0.5),
                    stop=tenacity.stop_after_delay(retry_s), reraise=True):
                with attempt:
                    resp = await self.bus.nc.request(subject, encode(msg), timeout=timeout_s,
                                                     headers=self.bus.headers(msg, None, None))
        except nats.errors.NoRespondersError:
            raise EnvError(f"no env host serves {subject}"
                           + (f" (waited {retry_s:g} s for one)" if retry_s else "")) from None
        except nats.errors.TimeoutError:
            raise EnvError(f"no reply on {subject} within {timeout_s:g} s ({self._whose()})") from None
        try:
            reply = decode(resp.data, kind)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            why = f"unreadable {kind.__name__} on {subject} ({self._whose()}): {undecodable(kind, e)}"
        else:
            why = check_env_reply(reply)
            if not why:
                return reply
            why = f"{kind.__name__} on {subject} refused ({self._whose()}): {why}"
        await self.bus.dead_letter(resp, why)  # the reply, kept with the reason for the env's author and operators
        raise EnvError(why)

    @staticmethod
    def _host(host_id: str) -> str:
        if not _HOST_ID.match(host_id):
            raise EnvError(f"env reset replied with an invalid host_id {host_id!r}")
        return host_id

    async def init(self, req: EnvInitRequest) -> EnvInitReply:
        return await self._request(S.env_init(req.env, self.owner), req, EnvInitReply, ENV_SETUP_TIMEOUT_S,
                                   self.setup_retry_s)

    async def reset(self, req: EnvResetRequest) -> EnvResetReply:
        return await self._request(S.env_reset(req.env, self.owner), req, EnvResetReply, ENV_SETUP_TIMEOUT_S,
                                   self.setup_retry_s)

    async def step(self, host_id: str, req: EnvStepRequest) -> EnvStepReply:
        return await self._request(S.env_step(self._host(host_id), self.owner), req, EnvStepReply,
                                   self.step_timeout_s)

    async def close(self, host_id: str, req: EnvCloseRequest) -> None:
        try:
            await self.bus.nc.request(S.env_close(self._host(host_id), self.owner), encode(req),
                                      timeout=ENV_CLOSE_TIMEOUT_S, headers=self.bus.headers(req, None, None))
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as e:
            raise EnvError(f"close on {host_id}: {e!r}") from None
