"""A tenant's own env is untrusted input: its subjects stay in the tenant's namespace,
every reply is checked against schemas.env's limits before the rollout uses it, and an
envhost answers an env author's oversized reply with an error naming the field instead
of sending it."""

import pytest

from opentinker.environment.base_game import AbstractGame, StepResult
from opentinker.schemas import (
    AgentOpening, EnvInitReply, EnvResetReply, EnvResetRequest, EnvStepReply, EnvStepRequest, encode,
)
from opentinker.schemas import env as E
from opentinker.schemas import subjects as S
from opentinker.services.envhost.service import EnvHost


def test_a_users_env_subjects_lie_in_that_users_namespace_only():
    assert S.env_init("mygame") == "ot.env.mygame.init"
    assert S.env_init("mygame", "alice") == "ot.env.user.alice.mygame.init"
    assert S.env_reset("mygame", "alice") == "ot.env.user.alice.mygame.reset"
    assert S.env_info("mygame", "alice") == "ot.env.user.alice.mygame.info"
    assert S.env_step("h1", "alice") == "ot.env.user.alice.host.h1.step"
    assert S.env_close("h1") == "ot.env.host.h1.close"
    assert S.tenant_envs("alice") == "ot.env.user.alice.>"
    for bad in ("alice.bob", "*", ">", "", "Alice", "a b"):
        with pytest.raises(ValueError):
            S.env_init("mygame", bad) if bad else S.tenant_envs(bad)


@pytest.mark.parametrize("reply, field", [
    (EnvStepReply(reward=float("nan")), "`reward`"),
    (EnvStepReply(reward=float("inf")), "`reward`"),
    (EnvStepReply(observation="x" * (E.MAX_ENV_TEXT_CHARS + 1)), "`observation`"),
    (EnvStepReply(images=[b"x"] * (E.MAX_ENV_REPLY_IMAGES + 1)), "`images`"),
    (EnvStepReply(images=[b"x" * (E.MAX_ENV_REPLY_IMAGE_BYTES + 1)]), "`images[0]`"),
    (EnvStepReply(info={"blob": "x" * (E.MAX_ENV_JSON_BYTES + 1)}), "`info`"),
    (EnvStepReply(rewards={"p1": float("nan")}), "`rewards['p1']`"),
    (EnvStepReply(observations={f"p{i}": "" for i in range(E.MAX_ENV_SEATS + 1)}), "seats"),
    (EnvResetReply(system_prompt="x" * (E.MAX_ENV_TEXT_CHARS + 1)), "`system_prompt`"),
    (EnvResetReply(user_message="x" * (E.MAX_ENV_TEXT_CHARS + 1)), "`user_message`"),
    (EnvResetReply(tools=[{"name": "t"}] * (E.MAX_ENV_TOOLS + 1)), "`tools`"),
    (EnvResetReply(agents=[AgentOpening(agent="p1", user_message="x" * (E.MAX_ENV_TEXT_CHARS + 1))]),
     "user_message"),
    (EnvInitReply(state={"blob": "x" * (E.MAX_ENV_STATE_BYTES + 1)}), "`state`"),
])
def test_an_env_reply_over_a_limit_is_refused_naming_the_field(reply, field):
    assert field in E.check_env_reply(reply)


def test_an_env_reply_within_the_limits_passes():
    for reply in (EnvStepReply(observation="ok", reward=1.0, info={"a": 1}), EnvResetReply(user_message="hi"),
                  EnvInitReply(state={"a": 1})):
        assert E.check_env_reply(reply) == ""


class HugeGame(AbstractGame):
    """An env that answers its step with a 100 MiB observation."""

    def reset(self, **kw) -> str:
        return "go"

    def get_system_prompt(self) -> str:
        return ""

    def step(self, action: str) -> StepResult:
        return StepResult("x" * (100 * 1024 * 1024), 1.0, False, {})


async def test_an_envhost_answers_an_oversized_reply_with_an_error_and_drops_the_episode():
    host = EnvHost({"huge": HugeGame}, "h1", 2, 60.0, owner="alice", max_reply_bytes=E.ENV_REPLY_BYTES)
    try:
        opened = await host.reset("huge", EnvResetRequest(env="huge", episode_id="e1", job_id="j"), None)
        assert opened.error == "" and opened.host_id == "h1"
        reply = await host.step(EnvStepRequest(episode_id="e1", job_id="j", action="a"), None)
        assert "env reply over a limit: `observation`" in reply.error and reply.observation == ""
        assert len(encode(reply)) < E.ENV_REPLY_BYTES and ("j", "e1") not in host.episodes
    finally:
        host.shutdown()
