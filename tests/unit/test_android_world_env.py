"""android-world is a named placeholder: a job that asks for it gets the reason at
once (an Android emulator this deployment does not have), through the envhost's own
request path."""

import pytest

from opentinker.services.envhost.envs.android_world import AndroidWorldGame
from opentinker.services.envhost.service import initial_state, open_episode


def test_android_world_says_it_needs_an_emulator():
    assert AndroidWorldGame.name == "android-world"
    for call in (lambda: AndroidWorldGame(), lambda: initial_state(AndroidWorldGame, {"task": "x"}, 0, "train"),
                 lambda: open_episode(AndroidWorldGame, {}, {})):
        with pytest.raises(RuntimeError) as e:
            call()
        msg = str(e.value)
        assert "android-world is not available in this deployment" in msg
        assert "Android emulator" in msg and "ADB" in msg and "KVM" in msg
