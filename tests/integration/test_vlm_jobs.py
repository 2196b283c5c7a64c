"""Vision-language jobs through the real services (scheduler, envhost, rollout on the
transformers engine, learner, recorder) on a tiny random-init LLaVA made in the test:
geometry3k single-turn and its calculator-tool variant, on the shipped generated
diagrams, and geometry3k on the vLLM engine. Every episode's images land in the Parquet log by hash (the `images` table
holds the shipped PNG bytes), their placeholders expanded in the token ids outside the
loss mask; the learner's forward with the images gives back the sampler's logprobs."""

import hashlib
from pathlib import Path

from opentinker.services.core.logdb import run_query

from conftest import log_rows, train_jobs
from test_env_jobs import check_episode, spec, start_stack

IMAGE_TOKENS = 16  # make_tiny_vlm: 56x56 images, 14-pixel patches


def shipped_hashes() -> set[str]:
    import opentinker.services.envhost.envs as envs

    folder = Path(envs.__file__).parent / "data" / "geometry3k"
    return {hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*.png")}


async def test_geometry3k_jobs_train_with_images_logged_by_hash(services, nats_url, tmp_path, tiny_vlm, job_id):
    data_dir = tmp_path / "log"
    start_stack(services, data_dir, engine="auto")  # a worker with both engines
    # a random model never answers right: every group has zero reward variance, and
    # skip_zero_variance = false makes the learner run its forward on them all the same
    vlm = {"skip_zero_variance": False}
    jobs = {
        "geometry3k": spec(tiny_vlm, "geometry3k", sampling={"max_new_tokens": 6, "max_total_tokens": 1024}, **vlm),
        "geometry3k-tool": spec(tiny_vlm, "geometry3k-tool", **vlm,
                                sampling={"max_new_tokens": 6, "max_turns": 2, "max_total_tokens": 1024}),
        # vLLM samples the same prompts (its own placeholder expansion checked against the
        # processor's) and takes the trained LoRA merged into the checkpoint's weights
        "geometry3k-vllm": spec(tiny_vlm, "geometry3k", engine="vllm", **vlm,
                                sampling={"max_new_tokens": 6, "max_total_tokens": 1024}),
    }
    handles, metrics = await train_jobs(nats_url, services, jobs, job_id, 900)
    from transformers import AutoConfig

    image_id = AutoConfig.from_pretrained(tiny_vlm).image_token_id
    shipped = shipped_hashes()
    for env, h in handles.items():
        s = jobs[env]
        n = s["steps"] * s["prompts_per_step"] * s["group_size"]
        await log_rows(data_dir, f"SELECT count(*) FROM trajectories WHERE job_id = '{h.id}'", n)
        await log_rows(data_dir, f"SELECT count(*) > 0 FROM images WHERE job_id = '{h.id}'", 1)
        cols, rows = run_query(f"SELECT reward, token_ids, loss_mask, logprobs, prompt_len, turns, env_info, error, "
                               f"image_sha256 FROM trajectories WHERE job_id = '{h.id}'", str(data_dir))
        eps = [dict(zip(cols, r)) for r in rows]
        assert len(eps) == n
        _, img_rows = run_query(f"SELECT sha256, data, width, height FROM images WHERE job_id = '{h.id}'",
                                str(data_dir))
        logged = {sha: data for sha, data, _, _ in img_rows}
        for sha, data, w, hgt in img_rows:
            assert hashlib.sha256(data).hexdigest() == sha and w > 0 and hgt > 0
        for ep in eps:
            assert not ep["error"], ep["error"]
            check_episode(ep)
            hashes = ep["image_sha256"]
            # the diagram with the problem; every image a shipped diagram, logged once by hash
            assert len(hashes) >= 1 and set(hashes) <= shipped and set(hashes) <= logged.keys()
            assert sum(t["images"] for t in ep["turns"]) == len(hashes) - 1
            ids, mask = ep["token_ids"], ep["loss_mask"]
            assert ids[:ep["prompt_len"]].count(image_id) == IMAGE_TOKENS
            assert ids.count(image_id) == IMAGE_TOKENS * len(hashes)
            assert all(m == 0 for x, m in zip(ids, mask) if x == image_id)
        if env == "geometry3k-tool":
            assert any(len(ep["turns"]) == 2 for ep in eps), "a second turn after the first observation"
        train = [m for m in metrics[env] if m.split == "train"]
        assert [m.step for m in train] == [0, 1]
        # the learner's logprobs (its forward with the pixel values) are the sampler's
        # wherever both ran one policy: step 0, and step 1 when sampled with version 1
        # (the trained LoRA the rollout engine loaded)
        same = [m for m in train if m.values["policy_lag_max"] == 0]
        assert same and all(m.values["mismatch_kl"] < 1e-4 for m in same), [m.values for m in train]
        assert all(m.values["fwd_bwd_s"] > 0 for m in train)  # the forward ran
