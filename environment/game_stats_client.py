"""GameStatsClient: upstream OpenTinker's per-job game statistics, at its import path
(`opentinker.environment.game_stats_client`), with its methods and keys.

Upstream's games run in a separate game server, and this client asks that server over
HTTP. Here the game runs in the caller's own process (`run_inference` plays it there),
so the statistics are kept in this process, per job id, and the client reads them
directly: `game_server_url` is accepted and unused, and `health_check()` is True.

    stats = GameStatsClient(args.env_endpoint, job_id=job_id)
    stats.reset_all()
    run_inference(..., game_class=MathGame, job_id=job_id)   # records each episode
    stats.get_all_stats()["mean_final_reward"]

What is recorded: every episode `run_inference` plays for a job id, and every episode
of a training job (training and evaluation) that the env served by `ServiceClient.fit`
from this process plays, under the GameEnvironment's `job_id`, when it ends. Wins,
losses and draws are read from the sign of an ended episode's last reward (> 0, < 0,
0), as in a game whose final reward says who won (upstream's Gomoku: +10, -10, 0).
Thread-safe; standard library only.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _JobStats:
    step: int = 0
    # (final reward, summed reward, env steps, done) of each episode of the current step
    episodes: list[tuple[float, float, int, bool]] = field(default_factory=list)
    cumulative: dict[str, float] = field(default_factory=lambda: defaultdict(float))


_lock = threading.Lock()
_jobs: dict[str, _JobStats] = {}


def record_episode(job_id: str, final_reward: float, sum_reward: float, steps: int, done: bool) -> None:
    """Record one finished episode of `job_id` (`done`: the game ended it, rather than a
    turn or token limit). Called by run_inference."""
    with _lock:
        js = _jobs.setdefault(job_id, _JobStats())
        js.episodes.append((float(final_reward), float(sum_reward), int(steps), bool(done)))
        js.cumulative["total_samples"] += 1
        if done:
            js.cumulative["total_games"] += 1
            js.cumulative["total_final_reward"] += float(final_reward)
            outcome = "total_wins" if final_reward > 0 else "total_losses" if final_reward < 0 else "total_draws"
            js.cumulative[outcome] += 1
        else:
            js.cumulative["total_incomplete"] += 1


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _step_stats(job_id: str) -> dict[str, Any]:
    js = _jobs.get(job_id) or _JobStats()
    done = [e for e in js.episodes if e[3]]
    n = len(js.episodes)
    mean_final = _mean([e[0] for e in done])
    games = len(done) or 1
    return {"job_id": job_id, "step": js.step, "total_samples": n, "games_in_step": len(done),
            "win_rate": sum(e[0] > 0 for e in done) / games, "loss_rate": sum(e[0] < 0 for e in done) / games,
            "draw_rate": sum(e[0] == 0 for e in done) / games,
            "incomplete_samples": n - len(done), "completion_rate": len(done) / n if n else 0.0,
            "mean_final_reward": mean_final, "mean_sum_reward": _mean([e[1] for e in done]),
            "mean_sum_reward_all": _mean([e[1] for e in js.episodes]),
            "mean_avg_reward": _mean([e[1] / max(1, e[2]) for e in done]),
            "mean_game_steps": _mean([float(e[2]) for e in done]), "mean_reward": mean_final,
            "total_interactions": sum(e[2] for e in js.episodes)}


def _cumulative(job_id: str) -> dict[str, Any]:
    js = _jobs.get(job_id) or _JobStats()
    out: dict[str, Any] = {"job_id": job_id, **dict(js.cumulative)}
    if js.cumulative.get("total_games"):
        out["cumulative_win_rate"] = js.cumulative.get("total_wins", 0.0) / js.cumulative["total_games"]
    return out


class GameStatsClient:
    """Upstream's `GameStatsClient(game_server_url, job_id="default", timeout=5.0)`:
    reset_step, get_step_stats, get_all_stats, get_cumulative_stats, reset_all,
    list_jobs, health_check, with upstream's dict keys (step stats: step,
    total_samples, games_in_step, incomplete_samples, completion_rate, win_rate,
    loss_rate, draw_rate, mean_final_reward, mean_sum_reward, mean_avg_reward,
    mean_game_steps, mean_reward, total_interactions, job_id)."""

    def __init__(self, game_server_url: str = "", job_id: str = "default", timeout: float = 5.0):
        self.url = str(game_server_url or "").rstrip("/")
        self.job_id = job_id
        self.timeout = timeout

    def reset_step(self) -> dict[str, Any]:
        """Start a new step: this step's episodes are cleared. Returns {"step", "job_id"}."""
        with _lock:
            js = _jobs.setdefault(self.job_id, _JobStats())
            js.step += 1
            js.episodes.clear()
            return {"message": "Step stats reset", "step": js.step, "job_id": self.job_id}

    def get_step_stats(self) -> dict[str, Any]:
        """The current step's figures (the keys above)."""
        with _lock:
            return _step_stats(self.job_id)

    def get_cumulative_stats(self) -> dict[str, Any]:
        """Since the last reset_all: total_samples, total_games, total_incomplete,
        total_final_reward, total_wins, total_losses, total_draws, cumulative_win_rate
        (only the keys with a count)."""
        with _lock:
            return _cumulative(self.job_id)

    def get_all_stats(self) -> dict[str, Any]:
        """The step figures, the cumulative ones beside them, and {"cumulative": ...}."""
        with _lock:
            cumulative = _cumulative(self.job_id)
            return {**cumulative, **_step_stats(self.job_id), "cumulative": cumulative}

    def reset_all(self) -> dict[str, Any]:
        """Forget every figure of this job."""
        with _lock:
            _jobs.pop(self.job_id, None)
        return {"message": "All stats reset", "job_id": self.job_id}

    def list_jobs(self) -> dict[str, Any]:
        """{"jobs": the job ids with figures in this process, "count"}."""
        with _lock:
            jobs = sorted(_jobs)
        return {"jobs": jobs, "count": len(jobs)}

    def health_check(self) -> bool:
        """True: the statistics live in this process."""
        return True
