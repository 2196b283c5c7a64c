"""Multi-agent self-play: the two-player games' rules, the envhost's phase protocol,
and the rollout coordinator on the real transformers engine (tiny model) with the
envhost's own functions in process: one token-exact trajectory per seat, each with its
own loss mask and reward, phases synchronised."""

from __future__ import annotations

import pytest

from opentinker.environment.multi_agent import MultiAgentGame, PhaseResult
from opentinker.schemas import EnvInitReply, EnvResetReply, RolloutRequest, SamplingParams
from opentinker.schemas.stats import seat_stats
from opentinker.services.envhost.envs.selfplay import GomokuDuelGame, NegotiationGame
from opentinker.services.envhost.service import initial_state, open_multi_episode, take_phase
from opentinker.services.learner.ledger import seats_complete
from opentinker.services.rollout.agent_loop import AgentLoop


# -- the games -------------------------------------------------------------------

def test_gomoku_duel_win_gives_the_loser_minus_one():
    g = GomokuDuelGame(size=5, win_length=3, opening=0)
    g.reset()
    moves = [("black", "A1"), ("white", "E5"), ("black", "B1"), ("white", "E4")]
    for seat, mv in moves:
        assert g.acting_agents() == [seat]
        r = g.step_phase({seat: mv})
        assert not r.done and r.rewards == {}
        assert list(r.observations) == [g.other(seat)] and f"played {mv}" in r.observations[g.other(seat)]
    r = g.step_phase({"black": "C1"})
    assert r.done and r.rewards == {"black": 1.0, "white": -1.0} and r.info["result"] == "black"


def test_gomoku_duel_illegal_moves_retry_then_lose():
    g = GomokuDuelGame(size=5, win_length=3, opening=0, max_illegal=2)
    g.reset()
    r = g.step_phase({"black": "no idea"})
    assert not r.done and r.rewards == {"black": -0.1} and g.acting_agents() == ["black"]
    r = g.step_phase({"black": "Z9"})
    assert r.done and r.rewards == {"black": pytest.approx(-1.1), "white": 1.0} and r.info["result"] == "white"


def test_gomoku_duel_openings_differ_by_seed_and_split():
    g = GomokuDuelGame(opening=2)
    a, b = g.generate_initial_state(1), g.generate_initial_state(2)
    assert a == g.generate_initial_state(1) and a != b
    assert g.generate_initial_state(1, "test") != a
    with pytest.raises(ValueError, match="env_args.size"):
        GomokuDuelGame(size=3)


def test_negotiation_deal_no_deal_and_discount():
    g = NegotiationGame(pot=10, rounds=2, discount=0.5)
    g.reset(pot=10)
    assert g.acting_agents() == ["alice", "bob"]
    r = g.step_phase({"alice": "I want 7", "bob": "6 please"})
    assert not r.done and "Bob asked for 6" in r.observations["alice"] and "Alice asked for 7" in r.observations["bob"]
    r = g.step_phase({"alice": "5", "bob": "4"})
    assert r.done and r.info["result"] == "deal"
    assert r.rewards == {"alice": pytest.approx(0.5 * 0.5), "bob": pytest.approx(0.4 * 0.5)}
    g.reset(pot=10)
    g.step_phase({"alice": "9", "bob": "9"})
    r = g.step_phase({"alice": "nothing", "bob": "8"})  # no number: the whole pot
    assert r.done and r.info["result"] == "no_deal" and r.rewards == {"alice": 0.0, "bob": 0.0}


# -- the envhost's side of a phase ------------------------------------------------

def test_a_phase_must_carry_exactly_the_acting_seats():
    g, openings, acting = open_multi_episode(GomokuDuelGame, {"size": 5, "win_length": 3, "opening": 0}, {})
    assert [o.agent for o in openings] == ["black", "white"] and acting == ["black"]
    assert "moves first" in openings[1].user_message and "Your move" in openings[0].user_message
    with pytest.raises(ValueError, match=r"acting seats are \['black'\], got \['white'\]"):
        take_phase(g, {"white": "A1"}, acting)
    reply = take_phase(g, {"black": "A1"}, acting)
    assert reply.acting == ["white"] and not reply.done and "X played A1" in reply.observations["white"]


def test_a_game_with_bad_seats_is_refused():
    class OneSeat(MultiAgentGame):
        agents = ("solo",)

        def reset(self, **state):
            return ""

    with pytest.raises(ValueError, match="two or more distinct seat names"):
        open_multi_episode(OneSeat, {}, {})

    class Liar(NegotiationGame):
        def step_phase(self, actions):
            return PhaseResult({"carol": "hi"}, {}, False)

    g, _, acting = open_multi_episode(Liar, {}, {"pot": 8})
    with pytest.raises(ValueError, match="carol"):
        take_phase(g, {"alice": "1", "bob": "2"}, acting)


# -- the coordinator ----------------------------------------------------------------

class LocalHost:
    """The envhost's own functions behind the rollout's EnvClient protocol, in process."""

    def __init__(self, cls):
        self.cls, self.games, self.acting, self.steps = cls, {}, {}, []

    async def init(self, req):
        return EnvInitReply(state=initial_state(self.cls, req.env_args, req.seed, req.split))

    async def reset(self, req):
        game, openings, acting = open_multi_episode(self.cls, req.env_args, req.state)
        self.games[req.episode_id], self.acting[req.episode_id] = game, acting
        return EnvResetReply(host_id="h1", agents=openings, acting=acting)

    async def step(self, host_id, req):
        self.steps.append((req.episode_id, dict(req.actions)))
        reply = take_phase(self.games[req.episode_id], req.actions, self.acting[req.episode_id])
        self.acting[req.episode_id] = reply.acting
        return reply

    async def close(self, host_id, req):
        self.games.pop(req.episode_id, None)


@pytest.fixture(scope="module")
def engine(tiny_model):
    from opentinker.services.rollout.engine_hf import HFEngine

    return HFEngine(tiny_model, seed=3)


def duel_request(**kw) -> RolloutRequest:
    sampling = kw.pop("sampling", SamplingParams(max_new_tokens=4, max_turns=3, max_total_tokens=1024))
    return RolloutRequest(job_id="j1", request_id="r1", step=0, group_index=0, group_seed=5, policy_version=0,
                          model="tiny", env="gomoku-duel",
                          env_args=kw.pop("env_args", {"size": 5, "win_length": 3, "illegal": "random"}),
                          group_size=2, sampling=sampling, agents=kw.pop("agents", 2), **kw)


async def version0() -> int:
    return 0


def check_seat(t, tok) -> None:
    """Token-exact masks: 1 exactly on each turn's [gen_start, gen_end); the reward is
    the sum of the turn rewards; observations between turns are masked out."""
    expect = [0] * len(t.token_ids)
    for turn in t.turns:
        expect[turn.gen_start:turn.gen_end] = [1] * (turn.gen_end - turn.gen_start)
        assert turn.action == tok.decode(t.token_ids[turn.gen_start:turn.gen_end], skip_special_tokens=True)
    assert list(t.loss_mask) == expect and len(t.logprobs) == len(t.token_ids)
    assert t.reward == pytest.approx(sum(turn.reward for turn in t.turns))


async def test_self_play_gives_one_trajectory_per_seat(engine):
    host = LocalHost(GomokuDuelGame)
    [trajs] = await AgentLoop(engine, host, worker="w0").run([duel_request()], version0)
    assert len(trajs) == 4 and seats_complete(trajs, 2)
    assert sorted(t.episode_id for t in trajs) == ["r1-e0-black", "r1-e0-white", "r1-e1-black", "r1-e1-white"]
    tok = engine.tokenizer
    for t in trajs:
        assert not t.error and t.agent in ("black", "white") and t.game_id == t.episode_id.rsplit("-", 1)[0]
        check_seat(t, tok)
        prompt = tok.decode(t.token_ids[:t.prompt_len])
        assert ("as X against" in prompt) == (t.agent == "black")
        if t.agent == "white" and t.turns:  # white's first prompt holds black's first move
            assert "X played" in prompt
    for game_id in {t.game_id for t in trajs}:
        seats = {t.agent: t for t in trajs if t.game_id == game_id}
        phases = sorted((turn.phase, a) for a, t in seats.items() for turn in t.turns)
        # turn-based: one seat per phase, black first, phases numbered without gaps
        assert [p for p, _ in phases] == list(range(len(phases)))
        assert phases[0][1] == "black"
        # what each seat did is what the env was told, phase by phase
        env_moves = [acts for gid, acts in host.steps if gid == game_id]
        assert [sorted(acts) for acts in env_moves] == [[a] for _, a in phases]
        black_actions = [a["black"] for a in env_moves if "black" in a]
        assert black_actions == [turn.action for turn in seats["black"].turns]
    assert all(t.turns for t in trajs)  # a random move stands in for an illegal one: both seats play
    assert set(seat_stats(trajs)) == {"reward_mean/black", "reward_mean/white"}


async def test_simultaneous_phases_never_show_a_seat_the_others_action(engine):
    host = LocalHost(NegotiationGame)
    req = RolloutRequest(job_id="j1", request_id="r2", step=0, group_index=0, group_seed=1, policy_version=0,
                         model="tiny", env="negotiation", env_args={"pot": 10, "rounds": 2}, group_size=2,
                         sampling=SamplingParams(max_new_tokens=4, max_turns=2, max_total_tokens=1024), agents=2)
    [trajs] = await AgentLoop(engine, host).run([req], version0)
    assert len(trajs) == 4
    for game_id in {t.game_id for t in trajs}:
        a, b = (next(t for t in trajs if t.game_id == game_id and t.agent == s) for s in ("alice", "bob"))
        assert [turn.phase for turn in a.turns] == [turn.phase for turn in b.turns]  # both act every phase
        steps = [acts for gid, acts in host.steps if gid == game_id]
        assert all(sorted(acts) == ["alice", "bob"] for acts in steps)
        # a seat's next prompt holds the other's demand of the last round, never of this one
        if len(a.turns) == 2:
            between = engine.tokenizer.decode(a.token_ids[a.turns[0].gen_end:a.turns[0].obs_end])
            judge = NegotiationGame()
            judge.reset(pot=10)
            assert f"Bob asked for {judge._demand(b.turns[0].action)}," in between
            assert b.turns[1].action not in between or not b.turns[1].action.strip()


async def test_seat_count_mismatch_fails_every_seat_clearly(engine):
    host = LocalHost(GomokuDuelGame)
    req = duel_request(agents=3)
    [trajs] = await AgentLoop(engine, host).run([req], version0)
    assert len(trajs) == 6
    assert all("has 2 seats (black, white); the job's agents is 3" in t.error for t in trajs)


async def test_an_opponent_jobs_policy_plays_its_seat_in_calls_of_its_own(engine):
    """`opponents = {"white": "champ"}`: white's prompts go to the engine only after
    the loop asked for champ's policy, never in a call with black's; its turns carry
    champ's version and its trajectories name champ (the learner leaves them out)."""
    host = LocalHost(GomokuDuelGame)
    log: list = []

    class Recording:
        name, max_model_len, tokenizer = engine.name, engine.max_model_len, engine.tokenizer

        def generate(self, prompts, sampling, max_new_tokens=None, seeds=None):
            log.append(("generate", len(prompts)))
            return engine.generate(prompts, sampling, max_new_tokens, seeds=seeds)

    async def versions(of: str = "") -> int:
        log.append(("policy", of))
        return 7 if of == "champ" else 3

    [trajs] = await AgentLoop(Recording(), host).run([duel_request(opponents={"white": "champ"})], versions)
    assert len(trajs) == 4 and all(not t.error for t in trajs)
    for t in trajs:
        assert t.policy_of == ("champ" if t.agent == "white" else "")
        assert t.turns and all(turn.policy_version == (7 if t.agent == "white" else 3) for turn in t.turns)
    # every engine call follows the policy it is for; turn-based, so each round is one seat's
    policies = [x for kind, x in log if kind == "policy"]
    assert "champ" in policies and "" in policies
    assert all(log[k][0] == "policy" and log[k + 1][0] == "generate" for k in range(0, len(log), 2))
    white_turns = sum(len(t.turns) for t in trajs if t.agent == "white")
    champ_prompts = sum(log[k + 1][1] for k in range(0, len(log), 2) if log[k] == ("policy", "champ"))
    assert champ_prompts == white_turns
    # an opponent on a seat the env does not have fails the job's episodes, naming it
    [bad] = await AgentLoop(engine, host).run([duel_request(opponents={"red": "champ"})], versions)
    assert all("opponents name seats ['red']" in t.error for t in bad)
