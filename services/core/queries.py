"""Example queries over the trajectory log's DuckDB views (logdb.py). Plain strings,
so the CLI can list them without importing DuckDB."""

# Queries worth knowing (docs/observability.md "The trajectory log"); `opentinker query --example NAME`
# runs one for a job. {job} is the job id.
EXAMPLES: dict[str, str] = {
    "reward-by-step": (
        "SELECT step, round(avg(reward), 3) AS reward, count(*) AS episodes, "
        "round(avg(num_policy_tokens), 1) AS policy_tokens FROM trajectories "
        "WHERE job_id = '{job}' AND split = 'train' GROUP BY step ORDER BY step"),
    "per-turn": (
        "SELECT t.i AS turn_no, count(*) AS episodes, round(avg(t.turn.reward), 3) AS reward, "
        "round(avg(t.turn.gen_end - t.turn.gen_start), 1) AS tokens, "
        "round(avg(t.turn.env_ms), 1) AS env_ms "
        "FROM (SELECT unnest(turns) AS turn, generate_subscripts(turns, 1) AS i FROM trajectories "
        "WHERE job_id = '{job}') AS t GROUP BY t.i ORDER BY t.i"),
    "policy-lag": (
        "SELECT step, max(step - policy_version) AS max_lag, "
        "round(avg(step - policy_version), 2) AS mean_lag FROM trajectories "
        "WHERE job_id = '{job}' AND split = 'train' GROUP BY step ORDER BY step"),
    "slowest-envs": (
        "SELECT env, count(*) AS episodes, round(avg(env_ms), 1) AS env_ms_mean, "
        "round(quantile_cont(env_ms, 0.95), 1) AS env_ms_p95, round(avg(gen_ms), 1) AS gen_ms_mean "
        "FROM trajectories WHERE job_id = '{job}' GROUP BY env ORDER BY env_ms_mean DESC"),
    "metric": (
        "SELECT step, split, key, round(value, 4) AS value FROM metrics "
        "WHERE job_id = '{job}' AND key IN ('reward_mean', 'kl', 'entropy', 'step_time_s') "
        "ORDER BY split, key, step"),
}
