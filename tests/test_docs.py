"""The documentation: the site builds in strict mode and every file the repository cites exists.

A strict MkDocs build fails on a broken link or anchor, a page missing from the nav, a missing
snippet include or a hook error, so a stale reference in docs/ fails `make test`. The citation
check covers what MkDocs cannot see: file paths named in code, bench scripts, the Makefile
and the docs' prose (`bench/RESULTS.md`, `recipes/...`, `docs/stack.md`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Path-like citations: a top-level folder of the repository, then a path.
_TOP = r"(?:bench|recipes|docs|tests|mtprun)"
_PATH = re.compile(rf"(?<![\w./-]){_TOP}/[\w./*-]*[\w/*]")
# A bare Markdown file name (STACK.md, RESULTS.md) not part of a longer path.
_MD_NAME = re.compile(r"(?<![\w./-])[\w-]+\.md\b")
# Paths built at run time or named as examples, not files of the repository.
_NOT_FILES = re.compile(r"[<>{}]|/step_|/logs/")
# Pages the docs hook generates at build time (docs/hooks/recipe_reference.py).
GENERATED = {"recipe-reference.md"}


def _code_files() -> list[Path]:
    files = [
        *ROOT.joinpath("mtprun").rglob("*.py"),
        *ROOT.joinpath("bench").glob("*.py"),
        *ROOT.joinpath("tests").rglob("*.py"),
    ]
    # This file names a missing file on purpose (its regular expressions' examples).
    return [f for f in files if f != Path(__file__).resolve()] + [ROOT / "Makefile"]


def _doc_files() -> list[Path]:
    return [ROOT / "README.md", *ROOT.joinpath("docs").rglob("*.md")]


def _repository_names() -> set[str]:
    names = set(GENERATED)
    for path in ROOT.rglob("*.md"):
        if not {".venv", ".git", "site", "runs"} & set(path.relative_to(ROOT).parts):
            names.add(path.name)
    return names


def _cited(text: str, tops: tuple[str, ...]) -> set[str]:
    paths = {m.group(0).rstrip(".") for m in _PATH.finditer(text)}
    return {p for p in paths if p.split("/", 1)[0] in tops and not _NOT_FILES.search(p)}


def _exists(cited: str) -> bool:
    if cited.startswith("docs/") and Path(cited).name in GENERATED:
        return True
    if "*" in cited:  # a glob such as tests/runner/test_run_*.py: it matches something
        return any(ROOT.glob(cited))
    return (ROOT / cited.rstrip("/")).exists()


def test_cited_files_exist() -> None:
    """Code (tests included) cites bench/, recipes/ and docs/ files and Markdown names; the
    docs (README included) also cite tests/ and mtprun/ files. Each one exists."""
    names = _repository_names()
    missing = []
    for path, tops in [(p, ("bench", "recipes", "docs")) for p in _code_files()] + [
        (p, ("bench", "recipes", "docs", "tests", "mtprun")) for p in _doc_files()
    ]:
        text = path.read_text(encoding="utf-8")
        where = path.relative_to(ROOT)
        missing += [f"{where}: {c}" for c in sorted(_cited(text, tops)) if not _exists(c)]
        # A bare Markdown name cites a file of that name somewhere in the repository.
        stripped = _PATH.sub("", text)
        bare = {m.group(0) for m in _MD_NAME.finditer(stripped)}
        missing += [f"{where}: {name}" for name in sorted(bare - names)]
    assert not missing, "cited files that do not exist:\n" + "\n".join(missing)


def test_readme_short_and_its_recipe_shipped() -> None:
    """The README stays an overview; the recipe it shows is the shipped quickstart verbatim."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) < 250
    quickstart = (ROOT / "recipes" / "quickstart.yaml").read_text(encoding="utf-8")
    assert f"```yaml\n{quickstart.rstrip()}\n```" in readme


def test_docs_build_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="the dev extra installs mkdocs")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # the theme's end-of-life banner
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    reference = (tmp_path / "recipe-reference" / "index.html").read_text(encoding="utf-8")
    # The generated page names every top-level section and a nested one with its defaults.
    for key in ("model", "task", "losses", "rollout", "trainer", "model.tiny", "kind"):
        assert f"<code>{key}</code>" in reference, key
