"""Every repository path a page names is a real file or folder; and the
pages are written for users: no table cell too long to read, no work-log
headings, nothing outside the repository, performance.md short.

A page (README.md, docs/*.md, clients/python/README.md) that names
``tensorserve/batching/drain.py`` or ``benchmarks/soak.py`` sends a reader
there; once that file is renamed or deleted the page is wrong, silently.
The paths are found in the pages' text each run, so a page that is
rewritten is checked as it is now. Not checked:

- ``<commit>:path``, a file as it was at a commit (``git show 66cf52f:x.py``),
  for scripts deleted once their answer was in the docs;
- what a command creates: a path after ``--out``/``--output`` (its results)
  and anything under a dot-folder (``benchmarks/.cache/``, ``.venvs/``);
- ``module.attribute`` (``scripts/generate_example_weights.make_variant``),
  checked as its module's file;
- CHANGELOG.md and benchmarks/results/HISTORY.md: dated records, whose
  paths are as they were at each entry's commit.
"""

from __future__ import annotations

import re

import pytest

from tests.conftest import ROOT

PAGES = ["README.md", "clients/python/README.md",
         *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
TOP = ("tensorserve", "benchmarks", "bench", "tests", "scripts", "deploy", "model_repository",
       "clients", "docs")
# A path starts at one of the repository's top folders, not inside a longer
# path, a URL or a ``<commit>:`` citation (none of "\w./:@-" just before it).
PATH = re.compile(rf"(?<![\w./:@-])((?:{'|'.join(TOP)})/[\w./-]*[\w/])")
OUTPUT_FLAG = re.compile(r"--(?:out|output|png|plot)[ =]$")
# Files a page names before they exist: an entry whose file exists is
# reported, so that it is removed from this list.
PENDING: dict[str, str] = {}


def named_paths(text: str) -> list[tuple[int, str]]:
    """(line, path) for every repository path the text names and we check."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in PATH.finditer(line):
            path = match.group(1)
            if OUTPUT_FLAG.search(line[: match.start()]):
                continue  # written by the command
            if any(part.startswith(".") and part not in (".", "..") for part in path.split("/")):
                continue  # a cache or virtualenv a command creates
            found.append((number, path))
    return found


def exists(path: str) -> bool:
    if (ROOT / path).exists():
        return True
    module, dot, _attribute = path.rpartition(".")
    return bool(dot) and (ROOT / f"{module}.py").is_file()


@pytest.mark.parametrize("page", PAGES)
def test_every_path_a_page_names_exists(page: str) -> None:
    missing = [
        f"{page}:{line}: {path}"
        for line, path in named_paths((ROOT / page).read_text())
        if not exists(path) and path not in PENDING
    ]
    assert not missing, "pages name paths that do not exist:\n" + "\n".join(missing)


def test_pending_paths_are_still_pending() -> None:
    landed = [path for path in PENDING if (ROOT / path).exists()]
    assert not landed, f"{landed} exist now: remove them from PENDING"


def test_the_finder_sees_paths_and_skips_citations_outputs_and_caches() -> None:
    text = (
        "see `tensorserve/batching/drain.py`, and `python benchmarks/soak.py --seconds 10`\n"
        "deleted: `66cf52f:benchmarks/oip_codec.py`; https://example.com/tensorserve/x.py\n"
        "--out benchmarks/results/new.json into benchmarks/.cache/repo\n"
        "`scripts/generate_example_weights.make_variant(...)`, tests/test_admission.py::test_x\n"
    )
    assert named_paths(text) == [
        (1, "tensorserve/batching/drain.py"),
        (1, "benchmarks/soak.py"),
        (4, "scripts/generate_example_weights.make_variant"),
        (4, "tests/test_admission.py"),
    ]
    assert exists("scripts/generate_example_weights.make_variant")
    assert not exists("tensorserve/server.py")


# ------------------------------------------------------------------ written for users
PERFORMANCE_MAX_LINES = 250
CELL_MAX_CHARS = 300
FENCE = re.compile(r"^\s*```")
# A work log's headings: a date, a session or round, a numbered step or
# phase, a commit hash (7+ hex digits with a digit and a letter).
WORK_LOG_HEADING = re.compile(
    r"\d{4}-\d{2}-\d{2}|\b(?:session|round|phase|step|iteration)s? \d|\bsession\b"
    r"|\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b",
    re.IGNORECASE,
)
# What only the project's own machines have: a folder beside the checkout,
# machines lent for a while, a device tool whose $OUT folder's files come back.
OUTSIDE = re.compile(
    r"\.\./shared|\$OUT\b|\blent\b|\bdevice call|\bfiles come back|come back from the machine",
    re.IGNORECASE,
)


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(number, line) of every line outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def long_cells(text: str, limit: int = CELL_MAX_CHARS) -> list[tuple[int, int]]:
    """(line, length) of every markdown table cell longer than ``limit``."""
    found = []
    for number, line in prose_lines(text):
        if line.lstrip().startswith("|"):
            for cell in re.split(r"(?<!\\)\|", line.strip().strip("|")):
                if len(cell.strip()) > limit:
                    found.append((number, len(cell.strip())))
    return found


def work_log_headings(text: str) -> list[str]:
    return [
        line for _, line in prose_lines(text)
        if line.startswith("#") and WORK_LOG_HEADING.search(line)
    ]


def test_performance_md_holds_todays_figures_in_at_most_250_lines() -> None:
    lines = (ROOT / "docs" / "performance.md").read_text().count("\n")
    assert lines <= PERFORMANCE_MAX_LINES, (
        f"docs/performance.md has {lines} lines: keep today's figures, one table per question, "
        "and move what they supersede to benchmarks/results/HISTORY.md"
    )


@pytest.mark.parametrize("page", PAGES)
def test_no_table_cell_is_over_300_characters(page: str) -> None:
    found = long_cells((ROOT / page).read_text())
    assert not found, f"{page}: table cells over {CELL_MAX_CHARS} characters (line, length): {found}"


@pytest.mark.parametrize("page", PAGES)
def test_no_heading_reads_like_a_work_log(page: str) -> None:
    found = work_log_headings((ROOT / page).read_text())
    assert not found, f"{page}: headings with a date, session, round or commit: {found}"


@pytest.mark.parametrize("page", PAGES)
def test_no_page_names_what_only_the_projects_machines_have(page: str) -> None:
    found = [
        f"{number}: {line.strip()}"
        for number, line in enumerate((ROOT / page).read_text().splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not found, f"{page} names what is outside the repository:\n" + "\n".join(found)


def test_the_history_keeps_what_performance_md_held() -> None:
    history = (ROOT / "benchmarks" / "results" / "HISTORY.md").read_text()
    assert "\n## Moved from docs/performance.md on 2026-11-28\n" in history
    moved = history.split("\n## Moved from docs/performance.md on 2026-11-28\n", 1)[1]
    assert "### Many cores: `--frontends N`" in moved and "### On a GPU" in moved


def test_the_finders_see_long_cells_work_log_headings_and_outside_paths() -> None:
    text = (
        "## Round 3: faster\n## The scheduler, 2026-11-27\n## Session 10\n## Before 647a9a2\n"
        "## 1. Save the weights\n## Many cores: `--frontends N`\n"
        f"| a | {'x' * 301} |\n| b | {'y' * 300} | a \\| b |\n"
        "```text\n## 2026-11-27 in a code block\n| " + "z" * 400 + " |\n```\n"
    )
    assert work_log_headings(text) == [
        "## Round 3: faster", "## The scheduler, 2026-11-27", "## Session 10", "## Before 647a9a2",
    ]
    assert long_cells(text) == [(7, 301)]
    assert OUTSIDE.search("run ../shared/gpu/carry-wheels.sh") is not None
    assert OUTSIDE.search('--out "$OUT/gpu_check.json"') is not None
    assert OUTSIDE.search("the lent nvidia-h200 machine") is not None
    assert OUTSIDE.search("a folder whose files come back from the machine") is not None
    assert OUTSIDE.search("every release is signed; the talent") is None
