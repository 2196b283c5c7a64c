"""bench/RESULTS.md is bench/results_page.py's output (so it cannot go stale), and the
README and the manual hold together: the README is a front door of at most 300 lines that
opens with its two commands, and every relative link in README.md, docs/, bench/ and
CHANGELOG.md names a file that exists (and, with a #fragment, a heading in it)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "bench" / "README.md",
         ROOT / "bench" / "RESULTS.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def results_page():
    spec = importlib.util.spec_from_file_location("results_page", ROOT / "bench" / "results_page.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_results_md_is_the_generated_page():
    page = results_page()
    assert (ROOT / "bench" / "RESULTS.md").read_text() == page.build(), \
        "bench/RESULTS.md is stale: run .venv/bin/python bench/results_page.py"


def test_results_page_names_a_missing_results_file(tmp_path, monkeypatch):
    page = results_page()
    monkeypatch.setattr(page, "RESULTS", tmp_path)
    results = page._results()  # none: the folder is empty
    text = "".join(page.task_section(results, *t) for t in page.TASKS) + page.seeds_section(results)
    for stem in ("tool_use_seeds", "game_seeds", "selfplay_seeds", "distill_seeds"):
        assert f"`bench/results/{stem}.json` is not in this checkout" in text
    assert "`bench/results/main_job_seeds.json` is not in this checkout" in text


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, len(lines)
    opening = "\n".join(lines[:15])
    first = [line for line in lines if line.startswith("bash scripts/")][:2]
    assert [line.split()[:2] for line in first] == [["bash", "scripts/train.sh"], ["bash", "scripts/test.sh"]]
    assert all(line in opening for line in first)
    for marker in ("main_job_seeds", "tool_use_seeds", "game_seeds", "selfplay_seeds", "distill_seeds"):
        assert f"<!-- {marker} -->" in lines and f"<!-- /{marker} -->" in lines
    links = {m for line in lines for m in LINK.findall(line)}
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"docs/{page.name}" in links, f"README does not link docs/{page.name}"


def anchors(md: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out, fence = set(), False
    for line in md.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_relative_links_resolve():
    bad = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, frag = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif frag and dest.suffix == ".md" and frag not in anchors(dest):
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


def test_no_paths_outside_the_repo():
    for page in PAGES:
        assert "../shared" not in page.read_text(), page
