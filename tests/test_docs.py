"""Every code block of the docs (README.md, docs/*.md, clients/python/README.md)
runs, or is checked, here. The convention the pages follow:

- Every fenced block names its language. ``text`` is not code: output,
  trees, diagrams, HTTP exchanges.
- ``python`` blocks run as scripts against a real server (this session's,
  serving the bundled repository): ``http://localhost:8000`` and
  ``TENSORSERVE_URL`` point at it.
- ``bash`` blocks run with ``bash -euo pipefail`` in a scratch folder that
  links the repository's top-level entries (what a block writes stays
  there), against the same server. A block that starts ``tensorserve serve``
  gets a free port (``TENSORSERVE_PORT``, and its ``:8000`` URLs rewritten)
  instead, unless it starts the bundled repository with default settings
  (``tensorserve serve &``), which is what the session's server runs: that
  block uses the session's server; ``tensorserve bench`` runs are shortened (``--duration 0.3
  --warmup 0.1``, a concurrency sweep's first two levels); background jobs
  are killed when the block ends. A page's blocks run in order, in one
  scratch folder, so a block may use what an earlier one wrote.
- ``promql`` blocks are evaluated by a real Prometheus against a real server
  (scripts/check_prometheus.py, which .ci/run runs).
- ``toml``, ``json`` and ``yaml`` blocks are parsed; a TOML block with
  ``[[input]]`` is validated as a model's config.toml, one with
  ``[[instance_group]]`` as instance groups.
- A block that cannot run on a test machine has a marker on the line just
  before its fence, ``<!-- not run: KIND -->``, and gets KIND's check:
  ``install`` (every extra it installs exists), ``docker`` (its build
  arguments are the Dockerfile's, its stop timeout covers the drain),
  ``kubernetes`` (every path it applies exists; tests/test_deploy_manifests.py
  validates them), ``benchmark`` (minutes long) and ``interactive`` (runs
  until stopped): each command's ``--help`` accepts every flag it uses; ``sketch`` (Python that needs what the page
  describes, not this machine: it compiles and its tensorserve imports resolve).
- ``<!-- output -->`` before a ``text`` block: it is what the ``bash`` block
  just before it prints; the first lines must match.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import yaml
from tensorserve_bench.server import free_port

from tensorserve.repository.config import InstanceGroup, parse_config
from tensorserve.settings import Settings
from tests.conftest import ROOT, ServerProcess

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")),
         "clients/python/README.md"]
RUN = {"python", "bash"}
PARSED = {"toml", "json", "yaml"}
# promql blocks are evaluated by a real Prometheus: scripts/check_prometheus.py, run by .ci/run.
ELSEWHERE = {"promql": ROOT / "scripts" / "check_prometheus.py"}
KINDS = {"install", "docker", "kubernetes", "benchmark", "interactive", "sketch"}
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
MARK = re.compile(r"^\s*<!--\s*(not run:\s*(\w+)|output)\s*-->\s*$")


@dataclass
class Block:
    page: str
    line: int
    lang: str
    code: str
    not_run: str | None = None
    output_of: Block | None = None  # for an <!-- output --> text block

    def __str__(self) -> str:
        return f"{self.page}:{self.line}:{self.lang}"


def blocks(page: str) -> list[Block]:
    lines = (ROOT / page).read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, lang = len(match.group(1)), match.group(2)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        code = "\n".join(line[indent:] for line in lines[i + 1:end]) + "\n"
        mark = MARK.match(lines[i - 1]) if i else None
        block = Block(page, i + 1, lang, code)
        if mark and mark.group(2):
            block.not_run = mark.group(2)
        elif mark:
            runs = [b for b in found if b.lang == "bash"]
            block.output_of = runs[-1] if runs else None
        found.append(block)
        i = end + 1
    return found


ALL = [b for page in PAGES if (ROOT / page).exists() for b in blocks(page)]


def by_kind(test: str) -> list[Block]:
    if test == "run":
        return [b for b in ALL if b.lang in RUN and b.not_run is None]
    if test == "checked":
        return [b for b in ALL if b.not_run is not None]
    return [b for b in ALL if b.lang in PARSED]


# ------------------------------------------------------------------ the convention
def test_every_block_names_its_language_and_markers_are_known() -> None:
    for block in ALL:
        assert block.lang in RUN | PARSED | set(ELSEWHERE) | {"text"}, f"{block}: give the block a language"
        if block.lang in ELSEWHERE:
            assert ELSEWHERE[block.lang].exists(), ELSEWHERE[block.lang]
        if block.not_run is not None:
            assert block.not_run in KINDS, f"{block}: unknown marker kind {block.not_run!r}"
            assert block.lang in RUN, f"{block}: only python and bash blocks are 'not run'"
        if block.lang == "text" and block.output_of is None:
            assert not block.code.lstrip().startswith(("$ ", "pip ", "python ", "tensorserve ")), (
                f"{block}: a command in a text block; make it bash"
            )


def test_no_page_points_at_issues_or_targets_a_reader_cannot_see() -> None:
    for page in PAGES:
        text = (ROOT / page).read_text()
        for phrase in ("the issue", "issue's", "issue #", "the targets", "the task"):
            assert phrase not in text.lower(), f"{page}: {phrase!r}"


def test_every_page_is_linked_from_the_readme_and_mkdocs() -> None:
    readme = (ROOT / "README.md").read_text()
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    in_nav = {next(iter(entry.values())) for entry in nav}
    for page in (ROOT / "docs").glob("*.md"):
        assert f"](docs/{page.name})" in readme, f"README does not link docs/{page.name}"
        assert page.name in in_nav, f"mkdocs.yml's nav lacks {page.name}"
    assert "](clients/examples/)" in readme
    for target in in_nav:
        assert (ROOT / "docs" / target).exists(), target


@pytest.mark.timeout(300)
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    # mkdocs.yml makes a link to a missing page or anchor a warning, and
    # --strict makes a warning fail the build.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=280, check=False,
    )
    warnings = [line for line in result.stderr.splitlines() if "WARNING" in line or "ERROR" in line]
    assert result.returncode == 0, "\n".join(warnings) or result.stderr[-3000:]
    assert (tmp_path / "site" / "deployment" / "index.html").is_file()


def test_relative_links_resolve() -> None:
    for page in PAGES:
        folder = (ROOT / page).parent
        for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (ROOT / page).read_text()):
            if "://" in link or link.startswith("mailto:"):
                continue
            assert (folder / link).exists(), f"{page}: broken link {link}"


# ------------------------------------------------------------------ running
@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder that looks like the repository root, where blocks may write."""
    folder = tmp_path_factory.mktemp("docs-run")
    for entry in ROOT.iterdir():
        if entry.name not in (".git",):
            (folder / entry.name).symlink_to(entry)
    return folder


def shortened(code: str) -> str:
    """A bench run measured for a moment: short windows, a sweep's first two loads."""
    if "tensorserve bench" not in code:
        return code
    code = re.sub(r"--duration \S+", "--duration 0.3", code)
    code = re.sub(r"--warmup \S+", "--warmup 0.1", code)
    return re.sub(r"--concurrency (\d+,\d+)(?:,\d+)+", r"--concurrency \1", code)


# Starting the bundled repository with default settings: the session's server
# already is that (started by the same command), so the block uses it.
BUNDLED_SERVER = re.compile(r"^tensorserve serve( --model-repository model_repository)? *&.*$", re.MULTILINE)


def run_bash(code: str, server_url: str, cwd: Path, timeout: float = 170) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORSERVE_")}
    port = server_url.rsplit(":", 1)[1]
    code = BUNDLED_SERVER.sub("# the session's server serves the bundled repository", code)
    if re.search(r"\btensorserve serve\b", code):
        port = str(free_port())
        env["TENSORSERVE_PORT"] = port
        # Its gRPC port too: blocks and other servers run at once, and 8001 is one port.
        env["TENSORSERVE_GRPC_PORT"] = str(free_port())
    code = re.sub(r"(localhost|127\.0\.0\.1):8000", rf"\g<1>:{port}", shortened(code))
    env["TENSORSERVE_URL"] = f"http://127.0.0.1:{port}"
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    out, err = cwd / ".block.out", cwd / ".block.err"
    with out.open("w") as stdout, err.open("w") as stderr:
        process = subprocess.Popen(
            ["bash", "-euo", "pipefail", "-c", code], cwd=cwd, env=env, stdout=stdout,
            stderr=stderr, stdin=subprocess.DEVNULL, start_new_session=True,
        )
        try:
            returncode = process.wait(timeout=timeout)
        finally:
            try:  # the block's background jobs (a server) end with it
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    assert returncode == 0, f"exit {returncode}\n{out.read_text()[-3000:]}\n{err.read_text()[-3000:]}"
    return out.read_text()


@pytest.mark.timeout(200)
@pytest.mark.parametrize("block", by_kind("run"), ids=str)
def test_block_runs(block: Block, server: ServerProcess, scratch: Path) -> None:
    server_url = server.url
    if block.lang == "python":
        code = block.code
        for default in ("http://127.0.0.1:8000", "http://localhost:8000"):
            code = code.replace(default, server_url)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORSERVE_")}
        env["TENSORSERVE_URL"] = server_url
        env["TENSORSERVE_GRPC_URL"] = f"grpc://{server.grpc_address}"
        result = subprocess.run(
            [sys.executable, "-c", code], check=False, cwd=scratch, env=env, capture_output=True, text=True,
            timeout=170,
        )
        assert result.returncode == 0, f"{block} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
        return
    output = run_bash(block.code, server_url, scratch)
    shown = next((b for b in ALL if b.output_of is block), None)
    if shown is not None:
        expected = shown.code.splitlines()[:2]
        assert output.splitlines()[: len(expected)] == expected, f"{shown}: not what {block} prints"


# ------------------------------------------------------------------ parsed
@pytest.mark.parametrize("block", by_kind("parsed"), ids=str)
def test_block_parses(block: Block) -> None:
    if block.lang == "json":
        json.loads(block.code)
    elif block.lang == "yaml":
        list(yaml.safe_load_all(block.code))
    else:
        data = tomllib.loads(block.code)
        if "input" in data:
            parse_config(data, str(block))
        for group in data.get("instance_group", []):
            InstanceGroup.model_validate(group)


# ------------------------------------------------------------------ checked
def commands(code: str) -> Iterator[list[str]]:
    """Each simple command of a shell block (continuations joined, comments
    and operators split off)."""
    code = code.replace("\\\n", " ")
    for line in code.splitlines():
        line = line.split(" #", 1)[0].strip()
        for part in re.split(r"&&|\|\||;|\|", line):
            words = shlex.split(part.strip().strip("()&"), comments=True) if part.strip() else []
            # What runs: after shell keywords and environment assignments.
            while words and (words[0] in ("do", "then", "else", "time") or re.match(r"\w+=", words[0])):
                words.pop(0)
            if words:
                yield words


def extras(pyproject: Path) -> set[str]:
    return set(tomllib.loads(pyproject.read_text())["project"].get("optional-dependencies", {}))


def check_install(block: Block) -> None:
    for words in commands(block.code):
        if words[:2] != ["pip", "install"]:
            continue
        for word in words[2:]:
            match = re.fullmatch(r"(\.|clients/python)\[([\w,]+)\]", word)
            if match:
                known = extras(ROOT / match.group(1) / "pyproject.toml")
                assert set(match.group(2).split(",")) <= known, f"{block}: {word}: extras {known}"
            elif not word.startswith("-") and "==" not in word and ("/" in word or word in (".", "bench")):
                assert (ROOT / word).exists(), f"{block}: {word}"


def check_docker(block: Block) -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    arguments = set(re.findall(r"^ARG (\w+)", dockerfile, re.MULTILINE))
    drain = sum(
        float(v) for v in re.findall(r"TENSORSERVE_(?:DRAIN_DELAY_S|SHUTDOWN_GRACE_S)=(\S+)", dockerfile)
    )
    for words in commands(block.code):
        if words[0].endswith(".sh"):
            assert (ROOT / words[0]).exists(), f"{block}: {words[0]}"
        if words[0] not in ("docker", "podman"):
            continue
        for i, word in enumerate(words):
            if word == "--build-arg":
                assert words[i + 1].split("=")[0] in arguments, f"{block}: {words[i + 1]}"
            if word == "--stop-timeout":
                assert float(words[i + 1]) >= drain + 5, f"{block}: the stop timeout cuts the drain"
            if word == "-e" and words[i + 1].startswith("TENSORSERVE_"):
                name = words[i + 1].split("=")[0].removeprefix("TENSORSERVE_").lower()
                assert name in Settings.model_fields, f"{block}: no setting {name}"


def check_kubernetes(block: Block) -> None:
    for words in commands(block.code):
        if words[0] != "kubectl":
            continue
        for i, word in enumerate(words):
            if word in ("-f", "-k"):
                assert (ROOT / words[i + 1]).exists(), f"{block}: {words[i + 1]}"


@cache
def help_text(*command: str) -> str:
    result = subprocess.run([*command, "--help"], check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{command} --help: {result.stderr}"
    return result.stdout


def check_benchmark(block: Block) -> None:
    seen = 0
    for words in commands(block.code):
        if words[0] in ("python", "python3") and words[1].endswith(".py"):
            command, flags = (sys.executable, words[1]), words[2:]
        elif words[0] == "tensorserve" and len(words) > 1:
            command, flags = (sys.executable, "-m", "tensorserve", words[1]), words[2:]
        elif words[0] == "bash" and words[1].endswith(".sh"):
            assert (ROOT / words[1]).exists(), words[1]
            seen += 1
            continue
        else:
            continue
        seen += 1
        text = help_text(*command)
        for flag in flags:
            if flag.startswith("--"):
                assert flag.split("=")[0] in text, f"{block}: {' '.join(command[1:])} has no {flag}"
    assert seen, f"{block}: no benchmark command found"


def check_sketch(block: Block) -> None:
    tree = ast.parse(block.code)  # it compiles
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            ("tensorserve", "tensorserve_client")
        ):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{block}: {node.module}.{alias.name}"


@pytest.mark.parametrize("block", by_kind("checked"), ids=str)
def test_block_not_run_here_is_checked(block: Block) -> None:
    {
        "install": check_install,
        "docker": check_docker,
        "kubernetes": check_kubernetes,
        "benchmark": check_benchmark,
        "interactive": check_benchmark,
        "sketch": check_sketch,
    }[block.not_run or ""](block)
