"""Every repository path a page names is a real file or folder.

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
