"""Who may change what is served, against real server processes:
``--model-control-mode`` (none refuses load and unload, explicit allows them,
poll follows the repository's files) and ``--restricted-api`` (an API
answered only for requests carrying its header)."""

from __future__ import annotations

import os
import shutil
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgpack
import numpy as np
import pytest

from tensorserve.cli import main
from tensorserve.serving.poller import compare, fingerprint
from tensorserve.settings import Settings
from tests.conftest import ServerProcess
from tests.helpers import ECHO, MSGPACK, body, from_wire, wait_until, write_toy_model

# y = x * FACTOR: which version is served shows in every answer.
FACTOR_MODEL = """
    import torch

    class Model(torch.nn.Module):
        def forward(self, x):
            return x * {factor}
"""
BROKEN_MODEL = """
    raise ImportError("this version is broken on purpose")
"""
ADMIN = {"X-Admin-Key": "s3cret"}


def infer(url: str, model: str = "echo") -> float:
    """The model's answer for x = 1 (so the factor it multiplies by)."""
    reply = httpx.post(f"{url}/v2/models/{model}/infer", headers=MSGPACK, timeout=30,
                       content=body([{"x": np.ones((1, 4), np.float32)}]))
    assert reply.status_code == 200, reply.content
    return float(from_wire(msgpack.unpackb(reply.content)["outputs"][0]["y"])[0, 0])


def replace_model_py(repo: Path, name: str, text: str) -> None:
    """Rewrite a model's model.py in one step (a poll never reads half a file)."""
    path = repo / name / "1" / "model.py"
    staged = path.with_suffix(".staged")
    staged.write_text(textwrap.dedent(text))
    os.replace(staged, path)


def refusal(reply: httpx.Response) -> tuple[int, str, str]:
    return reply.status_code, reply.json()["code"], reply.json()["error"]


def disabled(action: str, why: str) -> str:
    return (
        f"cannot {action} model 'echo': {why}; it is left as it was. Start the server with "
        f"--model-control-mode explicit (TENSORSERVE_MODEL_CONTROL_MODE=explicit) to "
        f"{action} models through the API"
    )


RESTRICTED = (
    "the {api} API is restricted: send the header 'x-admin-key' with the value the server "
    "was given in --restricted-api (TENSORSERVE_RESTRICTED_API)"
)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("control")
    write_toy_model(repo, "echo", FACTOR_MODEL.format(factor=2), **ECHO)
    return repo


@pytest.fixture(scope="module")
def default_server(repo: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(repo)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def admin_server(repo: Path) -> Iterator[ServerProcess]:
    """Explicit mode, the repository and config APIs behind a header (set
    through the environment)."""
    process = ServerProcess(
        repo, "--model-control-mode", "explicit",
        env={"TENSORSERVE_RESTRICTED_API": "model-repository,model-config:X-Admin-Key=s3cret"},
    )  # fmt: skip
    yield process
    process.stop()


@pytest.mark.parametrize("action", ["unload", "load"])
def test_the_default_mode_refuses_load_and_unload_and_the_model_keeps_serving(
    default_server: ServerProcess, action: str
) -> None:
    url = default_server.url
    reply = httpx.post(f"{url}/v2/repository/models/echo/{action}", timeout=30)
    assert refusal(reply) == (
        403, "model_control_disabled",
        disabled(action, "model control is disabled (--model-control-mode none)"),
    )  # fmt: skip
    assert infer(url) == 2.0
    assert httpx.get(f"{url}/v2/models/echo/ready").status_code == 200
    # The index stays readable.
    index = httpx.post(f"{url}/v2/repository/index")
    assert index.status_code == 200
    assert index.json() == [{"name": "echo", "version": "1", "state": "READY"}]


def test_a_restricted_api_refuses_a_request_without_its_header_or_with_another_value(
    admin_server: ServerProcess,
) -> None:
    url = admin_server.url
    for headers in ({}, {"X-Admin-Key": "s3cret!"}, {"X-Admin-Key": ""}, {"X-Other": "s3cret"}):
        assert refusal(httpx.post(f"{url}/v2/repository/index", headers=headers)) == (
            403, "api_restricted", RESTRICTED.format(api="model-repository"),
        )  # fmt: skip
        unload = httpx.post(f"{url}/v2/repository/models/echo/unload", headers=headers)
        assert refusal(unload) == (
            403, "api_restricted", RESTRICTED.format(api="model-repository"),
        )  # fmt: skip
        assert refusal(httpx.get(f"{url}/v2/models/echo/config", headers=headers)) == (
            403, "api_restricted", RESTRICTED.format(api="model-config"),
        )  # fmt: skip
    # Refused before the handler ran: the model still serves.
    assert infer(url) == 2.0
    # APIs not named stay open; a header's name is case-insensitive.
    assert httpx.get(f"{url}/v2/models/echo/stats").status_code == 200
    assert httpx.head(f"{url}/v2/health/ready").status_code == 200  # probes may send HEAD
    assert httpx.get(f"{url}/v2/models/echo/config", headers={"x-admin-key": "s3cret"}).json()[
        "name"
    ] == "echo"
    assert httpx.post(f"{url}/v2/repository/index", headers=ADMIN).status_code == 200


def test_explicit_mode_unloads_and_loads_with_the_header(admin_server: ServerProcess) -> None:
    url = admin_server.url
    unloaded = httpx.post(f"{url}/v2/repository/models/echo/unload", headers=ADMIN, timeout=30)
    assert unloaded.status_code == 200
    assert unloaded.json() == {"name": "echo", "version": "1", "state": "UNAVAILABLE"}
    assert httpx.get(f"{url}/v2/models/echo/ready").status_code == 503
    loaded = httpx.post(f"{url}/v2/repository/models/echo/load", headers=ADMIN, timeout=30)
    assert loaded.status_code == 200, loaded.text
    assert infer(url) == 2.0


def test_poll_mode_reloads_changed_loads_new_and_unloads_removed_models(
    tmp_path: Path,
) -> None:
    write_toy_model(tmp_path, "echo", FACTOR_MODEL.format(factor=2), **ECHO)
    log = tmp_path.parent / f"{tmp_path.name}.log"
    server = ServerProcess(
        tmp_path, "--model-control-mode", "poll", "--repository-poll-secs", "0.1",
        log=log,
    )  # fmt: skip
    url = server.url
    try:
        assert refusal(httpx.post(f"{url}/v2/repository/models/echo/unload")) == (
            403, "model_control_disabled",
            disabled("unload", "the server is in poll mode: it loads, reloads and unloads "
                               "models from the repository's files every 0.1 s"),
        )  # fmt: skip

        # A changed model.py is reloaded; every answer meanwhile is the old or the new one.
        replace_model_py(tmp_path, "echo", FACTOR_MODEL.format(factor=30))
        answers: list[float] = []
        wait_until(lambda: answers.append(infer(url)) or answers[-1] == 30.0,
                   "the changed model served", timeout=30)
        assert set(answers) <= {2.0, 30.0}

        # A change that fails to load keeps the old version serving.
        replace_model_py(tmp_path, "echo", BROKEN_MODEL)
        wait_until(lambda: "this version is broken on purpose" in log.read_text(),
                   "the broken version tried", timeout=30)
        assert infer(url) == 30.0
        assert httpx.get(f"{url}/v2/models/echo/ready").status_code == 200

        # A new model folder is loaded; a removed one unloaded and no longer listed.
        write_toy_model(tmp_path, "fresh", FACTOR_MODEL.format(factor=5), **ECHO)
        wait_until(lambda: httpx.get(f"{url}/v2/models/fresh/ready").status_code == 200,
                   "the new model ready", timeout=30)
        assert infer(url, "fresh") == 5.0
        shutil.rmtree(tmp_path / "fresh")
        wait_until(lambda: httpx.get(f"{url}/v2/models/fresh/ready").status_code == 404,
                   "the removed model gone", timeout=30)
        index = httpx.post(f"{url}/v2/repository/index").json()
        assert [model["name"] for model in index] == ["echo"]
    finally:
        assert server.stop().returncode == 0


@pytest.mark.parametrize(("spec", "message"), [
    ("trace:X-Key=v", (
        "unknown API 'trace'; choose from health, metadata, inference, model-config, "
        "model-repository, statistics"
    )),
    ("model-repository:X-Key", "the group for 'model-repository' is not API[,API...]:HEADER=VALUE"),
    ("health:A=1;health:B=2", "API 'health' is restricted twice"),
])
def test_a_bad_restricted_api_is_a_usage_error_that_never_shows_the_value(
    capsys: pytest.CaptureFixture[str], spec: str, message: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--restricted-api", spec])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--restricted-api / TENSORSERVE_RESTRICTED_API: Value error, " + message in err
    assert "X-Key=v" not in err


def test_restricted_apis_parse_with_case_insensitive_headers() -> None:
    spec = "model-repository, statistics:X-Admin-Key=a=b; inference:Y=z"
    settings = Settings(restricted_api=spec)
    assert settings.restrictions() == {
        "model-repository": ("x-admin-key", "a=b"),
        "statistics": ("x-admin-key", "a=b"),
        "inference": ("y", "z"),
    }


def test_a_fingerprint_sees_a_changed_file_and_not_the_bytecode_an_import_writes(
    tmp_path: Path,
) -> None:
    folder = write_toy_model(tmp_path, "echo", FACTOR_MODEL.format(factor=2), **ECHO)
    before = fingerprint(folder)
    (folder / "1" / "__pycache__").mkdir()
    (folder / "1" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"\0" * 64)
    assert fingerprint(folder) == before
    replace_model_py(tmp_path, "echo", FACTOR_MODEL.format(factor=30))
    after = fingerprint(folder)
    assert after != before
    changes = compare({"echo": before, "gone": ()}, {"echo": after, "new": ()})
    assert (changes.added, changes.changed, changes.removed) == (["new"], ["echo"], ["gone"])
