"""Statistics of episodes, each defined once. The learner's step and evaluation metrics,
`opentinker infer`'s summary and the wandb bridge's rollout figures all take them from
here, so `reward_mean` or `policy_lag_mean` means the same number everywhere.

Pure functions of Trajectory lists; the standard library only.
"""

from __future__ import annotations

import hashlib
import statistics
from collections.abc import Sequence

from opentinker.schemas.rollout import Trajectory


def derived_seed(*parts: object) -> int:
    """A seed in [0, 2**31) that is a pure function of `parts` (the first 8 bytes of
    BLAKE2b over their ':'-joined text, little-endian, top bit cleared), so any RNG an
    environment uses accepts it. Training groups use (seed, step, group index),
    their dynamic-sampling replacements ("refill", seed, step, group index, n),
    evaluation ("eval", seed, index), inference ("infer", seed, index)."""
    h = hashlib.blake2b(":".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & 0x7FFFFFFF


def policy_lag(t: Trajectory) -> int:
    """How many policy versions behind its step an episode was sampled: `step -
    policy_version` (0 = on-policy; the learner bounds it by `spec.max_staleness`)."""
    return t.step - t.policy_version


def episode_stats(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """Per-episode means over `trajs` (all 0.0 when empty):

    episodes          number of episodes
    reward_mean/std   episode return (sum of turn rewards), mean and population std
    correct_frac      fraction solved (`Trajectory.correct`: the env's `correct` info,
                      else reward > 0)
    episode_len_mean  tokens per episode (prompt, actions and observations)
    gen_tokens_mean   sampled tokens per episode (the loss mask's ones)
    turns_mean        turns per episode
    error_frac        fraction that ended on an error (env crash, timeout)
    """
    n = len(trajs)
    if not n:
        return {k: 0.0 for k in ("episodes", "reward_mean", "reward_std", "correct_frac", "episode_len_mean",
                                 "gen_tokens_mean", "turns_mean", "error_frac")}
    rewards = [t.reward for t in trajs]
    return {
        "episodes": float(n),
        "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards),
        "correct_frac": sum(t.correct for t in trajs) / n,
        "episode_len_mean": statistics.fmean(len(t.token_ids) for t in trajs),
        "gen_tokens_mean": statistics.fmean(sum(t.loss_mask) for t in trajs),
        "turns_mean": statistics.fmean(len(t.turns) for t in trajs),
        "error_frac": sum(1 for t in trajs if t.error) / n,
    }


def lag_stats(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """`policy_lag_mean` and `policy_lag_max` over the episodes that sampled any token
    (an episode that ended before generating trains nothing) with the job's own policy
    (not an opponent job's seat); 0.0 when there are none."""
    lags = [policy_lag(t) for t in trajs if any(t.loss_mask) and not t.policy_of] or [0]
    return {"policy_lag_mean": statistics.fmean(lags), "policy_lag_max": float(max(lags))}


def game_results(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """`win_rate`, `draw_rate`, `loss_rate` over the single-agent episodes whose env info
    reports a `result` of "win", "draw" or "loss" (a game against a built-in opponent);
    {} when none does (a multi-agent game's seats: seat_results)."""
    results = [t.env_info["result"] for t in trajs
               if not t.agent and t.env_info.get("result") in ("win", "draw", "loss")]
    if not results:
        return {}
    return {f"{r}_rate": results.count(r) / len(results) for r in ("win", "draw", "loss")}


def seat_results(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """Per seat of a multi-agent game whose env info reports a `result`:
    `win_rate/<seat>`, `draw_rate/<seat>`, `loss_rate/<seat>` over its episodes whose
    result says who won (the seat won on "win" or its own name, as gomoku-duel names the
    winner; lost on "loss" or another seat's name; "draw"), and `result_rate/<result>`
    for every result the games reported (e.g. negotiation's "deal" and "no_deal"), per
    game. {} for single-agent episodes or when no episode reports a result."""
    seated = [t for t in trajs if t.agent and "result" in t.env_info]
    seats = {t.agent for t in seated}
    by: dict[str, list[str]] = {}
    for t in seated:
        r = t.env_info["result"]
        if r in ("win", "draw", "loss") or r in seats:
            by.setdefault(t.agent, []).append("win" if r in ("win", t.agent) else "draw" if r == "draw" else "loss")
    out = {f"{k}_rate/{a}": rs.count(k) / len(rs) for a, rs in sorted(by.items()) for k in ("win", "draw", "loss")}
    games = {(t.game_id or t.episode_id): str(t.env_info["result"]) for t in seated}
    for r in sorted(set(games.values())):
        out[f"result_rate/{r}"] = sum(x == r for x in games.values()) / len(games)
    return out


def seat_stats(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """`reward_mean/<seat>` for each seat of a multi-agent job's episodes (per-agent
    reward curves); {} for a single-agent job."""
    by: dict[str, list[float]] = {}
    for t in trajs:
        if t.agent:
            by.setdefault(t.agent, []).append(t.reward)
    return {f"reward_mean/{a}": statistics.fmean(r) for a, r in sorted(by.items())}
