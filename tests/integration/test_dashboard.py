"""The web dashboard in headless Chromium (Debian's `chromium`, driven by Playwright)
against a running stack: a job trains while the page shows it, the workers and its
reward curve. The test saves a screenshot."""

import os
import shutil

import httpx
import pytest

from conftest import HOME
from test_api import ADMIN, start_api

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.timeout(600)
async def test_dashboard_shows_jobs_workers_and_a_live_reward_curve(services, tiny_model, job_id):
    from playwright.async_api import async_playwright

    # scripts/install.sh installs it; a missing package fails here, by name, never a skip
    assert CHROMIUM, "system package 'chromium' is not installed (apt-get install chromium; scripts/install.sh does it)"

    url = await start_api(services)
    services.start("envhost")
    services.start("learner")
    services.start("rollout", "engine=hf")
    spec = {"name": "dash", "model": tiny_model, "env": "arith", "engine": "hf", "lora_rank": 4,
            "prompts_per_step": 2, "group_size": 2, "steps": 4, "micro_batch_size": 4,
            "sampling": {"max_new_tokens": 8, "max_total_tokens": 256}}
    async with httpx.AsyncClient(base_url=url, headers=ADMIN) as c:
        r = await c.post("/v1/jobs", json={"spec": spec, "job_id": job_id})
        assert r.status_code == 201, r.text

    shot = HOME / "artifacts" / "dashboard.png"
    shot.parent.mkdir(parents=True, exist_ok=True)
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                          args=["--no-sandbox", "--disable-dev-shm-usage"])
        try:
            page = await browser.new_page(viewport={"width": 1280, "height": 900})
            await page.goto(url + "/")
            await page.fill("#key", os.environ["OPENTINKER_ADMIN_KEY"])
            await page.click("button[type=submit]")
            await page.wait_for_selector(f'tr[data-job="{job_id}"]', timeout=30_000)
            assert "signed in as admin" in await page.text_content("#who")
            # both workers of the pool are listed, and the job is placed on them
            await page.wait_for_function("document.querySelectorAll('tr[data-worker]').length >= 2",
                                         timeout=60_000)
            # the reward curve grows as steps finish, live, until the job completes
            points = f"Number((document.getElementById('curve-{job_id}') || {{dataset: {{}}}}).dataset.points || 0)"
            await page.wait_for_function(f"{points} >= 1", timeout=300_000)
            await page.wait_for_selector(f'tr[data-job="{job_id}"] .state-completed', timeout=300_000)
            await page.wait_for_selector(f'#curve-{job_id}[data-points="4"]', timeout=30_000)
            row = await page.text_content(f'tr[data-job="{job_id}"]')
            assert "admin" in row and "completed" in row
            assert await page.locator(f"#curve-{job_id} canvas").count() == 1
            assert os.environ["OPENTINKER_ADMIN_KEY"] not in page.url
            await page.screenshot(path=str(shot), full_page=True)
        finally:
            await browser.close()
    assert shot.stat().st_size > 10_000
    print(f"dashboard screenshot: {shot}")
