"""What benchmarks/gpu_check.py stands on: a temporary copy of a model
repository with the check's overrides, random items for a model, each item's
outputs computed alone on the CPU, a ``tensorserve serve`` child process,
and the native protocol (msgpack) over aiohttp.

Only the standard library, numpy, torch, aiohttp, msgpack, psutil and the
server's own loader (to build the CPU reference exactly as the server loads a
model) are used: no client package, no ``tensorserve.bench``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import psutil

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parent.parent
# Token ids are drawn below this when a model does not say its vocabulary.
DEFAULT_VOCAB = 1000
MIN_LENGTH, MAX_LENGTH = 2, 48  # torch.export specialises axes of length 0 and 1


@dataclass
class Check:
    """One line of the report: ``passed`` is true or false, never absent.

    ``compared``: how many comparisons the check made (items, parameters,
    batches...). A check that counts them fails at 0, whatever else it saw:
    a check that compared nothing has shown nothing."""

    name: str
    model: str
    isolation: str
    passed: bool
    detail: str
    seconds: float = 0.0  # what the check took, against the machine's 5 minutes
    compared: int | None = None  # None: a failure before anything could be compared

    def __post_init__(self) -> None:
        if self.compared == 0 and self.passed:
            self.passed = False
            self.detail = f"0 comparisons: nothing was checked | {self.detail}"

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "model": self.model, "isolation": self.isolation,
                "passed": bool(self.passed), "detail": self.detail,
                "seconds": round(self.seconds, 2), "compared": self.compared}


@dataclass
class ModelInfo:
    """What the check needs of one model of the repository."""

    name: str
    config: dict[str, Any]  # config.toml as parsed TOML
    source: Path  # the model's folder in the original repository
    reference: str  # the model whose CPU module gives the expected outputs

    @property
    def platform(self) -> str:
        return str(self.config.get("platform", "pytorch_tensorserve"))

    @property
    def inputs(self) -> list[dict[str, Any]]:
        return list(self.config.get("input", []))

    @property
    def outputs(self) -> list[dict[str, Any]]:
        return list(self.config.get("output", []))

    @property
    def vocab_size(self) -> int | None:
        """The size of the embedding table, for a token model: the model's
        ``vocab_size`` parameter, else its own ``max_value`` bound plus one."""
        vocab = self.config.get("parameters", {}).get("vocab_size")
        if vocab is None and self.config.get("input"):
            bound = self.config["input"][0].get("max_value")
            vocab = bound + 1 if isinstance(bound, int) else None
        return int(vocab) if vocab is not None else None

    def compute_dtype(self, device: str) -> str:
        """The dtype the model computes in on ``device``: on CUDA what its
        ``parameters.cuda_dtype`` says (the bench's encoder: float16), else
        float32 (every bundled model)."""
        if device.startswith("cuda"):
            return str(self.config.get("parameters", {}).get("cuda_dtype", "float32"))
        return "float32"

    @property
    def request_parameters(self) -> dict[str, Any]:
        """Each declared request parameter at its default (what a request
        that sends none gets)."""
        return {p["name"]: p["default"] for p in self.config.get("request_parameter", [])
                if "default" in p}


def discover_models(repository: Path) -> list[ModelInfo]:
    """Every folder of ``repository`` with a config.toml and a version folder."""
    found = []
    for folder in sorted(p for p in repository.iterdir() if p.is_dir()):
        config_file = folder / "config.toml"
        if config_file.is_file() and any(v.is_dir() and v.name.isdigit() for v in folder.iterdir()):
            config = tomllib.loads(config_file.read_text())
            found.append(ModelInfo(folder.name, config, folder, folder.name))
    return found


# ----------------------------------------------------------------- config overrides
def override_config(text: str, fields: Mapping[str, Any], drop: Sequence[str] = ()) -> str:
    """config.toml's text with top-level ``fields`` set (replaced where the
    file sets them, else added at the top) and the keys in ``drop`` removed
    wherever they are. Text, not a TOML writer: the file's comments and
    layout stay, and nothing here needs to know every table."""
    lines = text.splitlines()
    first_table = next((i for i, line in enumerate(lines) if line.lstrip().startswith("[")),
                       len(lines))
    top, rest = lines[:first_table], lines[first_table:]
    for key, value in fields.items():
        rendered = f"{key} = {_toml(value)}"
        pattern = re.compile(rf"^\s*{re.escape(key)}\s*=")
        at = next((i for i, line in enumerate(top) if pattern.match(line)), None)
        if at is None:
            top.insert(0, rendered)
        else:
            top[at] = rendered
    dropped = [re.compile(rf"^\s*{re.escape(key)}\s*=") for key in drop]
    kept = [line for line in top + rest if not any(p.match(line) for p in dropped)]
    return "\n".join(kept) + "\n"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_repository(
    target: Path, models: Sequence[ModelInfo], fields: Mapping[str, Any],
    drop: Sequence[str] = (), per_model: Mapping[str, Mapping[str, Any]] | None = None,
) -> Path:
    """A copy of ``models`` under ``target`` (a fresh folder), each config.toml
    with ``fields`` (and its own ``per_model`` fields) set and ``drop`` removed.
    Version folders are linked file by file, not copied: weights stay where they are."""
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    for model in models:
        folder = target / model.name
        folder.mkdir()
        for version in (v for v in model.source.iterdir() if v.is_dir() and v.name.isdigit()):
            (folder / version.name).mkdir()
            for file in version.iterdir():
                if file.is_file():
                    os.symlink(file.resolve(), folder / version.name / file.name)
        text = (model.source / "config.toml").read_text()
        if model.platform != "ensemble":  # an ensemble runs its steps where they are
            own = {**fields, **(per_model or {}).get(model.name, {})}
            text = override_config(text, own, drop)
        variable = any(-1 in spec.get("shape", []) for spec in model.inputs)
        if variable and not re.search(r"^\s*\[warmup\]", text, re.MULTILINE):
            # The check's items are at most MAX_LENGTH long: warming up at 128 on every
            # axis (the default) costs a CPU more than the whole check of some models.
            text += f"\n[warmup]\nlengths = [{MAX_LENGTH}]\n"
        (folder / "config.toml").write_text(text)
    return target


# ----------------------------------------------------------------- exported variants
@dataclass
class Exports:
    """What ``export_variants`` made, left out by rule (with why), and failed (with why)."""

    variants: list[ModelInfo]
    not_tried: list[str]
    failed: list[tuple[str, str]]  # (variant name, the exporter's error)


def export_variants(
    repository: Path, models: Sequence[ModelInfo], folder: Path, device: str
) -> Exports:
    """``<name>_pt`` (torch.jit.script) and ``<name>_pt2`` (torch.export) of
    every model.py model, exported here, by this machine's torch (a file made
    by another torch may not load) and on ``device`` (a torch.export program
    keeps the device its tensors were made on, e.g. a ``torch.arange``).
    Left out by rule, each with its reason: a model with request parameters
    (an exported program is served by the pytorch_libtorch platform, which
    passes none), and every .pt2 after the first (below). Every other
    export is tried, and one that raises is a failure."""
    import torch

    from tensorserve.repository.loader import discover, load_model, read_config

    variants: list[ModelInfo] = []
    skipped: list[str] = []
    failed: list[tuple[str, str]] = []
    sources = discover(repository)
    programs = 0
    for model in models:
        if model.platform != "pytorch_tensorserve" or model.name not in sources:
            continue
        if model.config.get("request_parameter"):
            skipped += [f"{model.name}{suffix}: not exported: request parameters, which the "
                        f"pytorch_libtorch platform does not pass" for suffix in ("_pt", "_pt2")]
            continue
        module = load_model(sources[model.name], None, read_config(sources[model.name])).module
        module = module.to(device)  # type: ignore[attr-defined]
        example = tuple(torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in
                        _padded_example(model))
        for suffix, file, export in (("_pt", "model.pt", _script), ("_pt2", "model.pt2", _export)):
            name = model.name + suffix
            if file == "model.pt2" and programs:
                # The server loads a repository's models on parallel threads, and two
                # torch.export.load calls at once fail (_CURRENT_DESERIALIZER is already set).
                skipped.append(f"{name}: {file} not tried: one torch.export program per "
                               f"server (torch.export.load is not thread-safe)")
                continue
            try:
                program_path = folder / name / "1" / file
                program_path.parent.mkdir(parents=True, exist_ok=True)
                with _quiet_torch_logs():
                    export(module, example, model, program_path)
            except Exception as exc:  # noqa: BLE001 - any exporter failure is a failed check
                shutil.rmtree(folder / name, ignore_errors=True)
                failed.append((name, f"{file} not exported: {_first_line(exc)}"))
                continue
            config = {k: v for k, v in model.config.items() if k != "parameters"}
            config["platform"] = "pytorch_libtorch"
            text = override_config((model.source / "config.toml").read_text(),
                                   {"platform": "pytorch_libtorch"})
            text = _without_table(text, "parameters")
            (folder / name / "config.toml").write_text(text)
            variants.append(ModelInfo(name, config, folder / name, model.name))
            programs += file == "model.pt2"
    return Exports(variants, skipped, failed)


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """torch.export logs a whole graph when it gives up on a model: the
    reason, one line, is in the report."""
    logger = logging.getLogger("torch")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _script(module: Any, example: tuple[Any, ...], model: ModelInfo, path: Path) -> None:
    import torch

    torch.jit.save(torch.jit.script(module), str(path))


def _export(module: Any, example: tuple[Any, ...], model: ModelInfo, path: Path) -> None:
    import torch

    batch = torch.export.Dim("batch", min=1, max=1024)
    axes = [torch.export.Dim(f"axis{k}", min=MIN_LENGTH, max=512) for k in range(4)]
    shapes = []
    for spec in model.inputs:
        dims: dict[int, Any] = {0: batch}
        variable = 0
        for k, d in enumerate(spec["shape"]):
            if d == -1:
                dims[k + 1] = axes[variable]
                variable += 1
        shapes.append(dims)
    program = torch.export.export(module, example, dynamic_shapes=tuple(shapes))
    torch.export.save(program, str(path))


def _without_table(text: str, table: str) -> str:
    out, skipping = [], False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("["):
            skipping = stripped == f"[{table}]"
        if not skipping:
            out.append(line)
    return "\n".join(out) + "\n"


def _padded_example(model: ModelInfo) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    items = make_items(model, 3, rng)
    return [pad([item[spec["name"]] for item in items], spec.get("pad_value", 0))
            for spec in model.inputs]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:160]}" if text else type(exc).__name__


# ----------------------------------------------------------------- items and references
def make_items(model: ModelInfo, count: int, rng: np.random.Generator) -> list[dict[str, np.ndarray]]:
    """``count`` random items, each with its own lengths (shared by every
    input of the item, axis by axis): ids below the vocabulary, masks of
    ones, floats from a normal distribution."""
    vocab = model.vocab_size or DEFAULT_VOCAB
    items = []
    for _ in range(count):
        lengths = [int(n) for n in rng.integers(MIN_LENGTH, MAX_LENGTH + 1, size=4)]
        item = {}
        for spec in model.inputs:
            shape, variable = [], 0
            for d in spec["shape"]:
                if d == -1:
                    shape.append(min(lengths[variable], spec.get("max_length") or MAX_LENGTH))
                    variable += 1
                else:
                    shape.append(d)
            dtype = np.dtype(spec["dtype"])
            if "mask" in spec["name"]:
                value = np.ones(shape, dtype=dtype)
            elif dtype.kind in "iu":
                value = rng.integers(1, vocab, size=shape).astype(dtype)
            elif dtype.kind == "b":
                value = rng.integers(0, 2, size=shape).astype(bool)
            else:
                value = rng.standard_normal(shape).astype(dtype)
            item[spec["name"]] = value
        items.append(item)
    return items


def pad(arrays: Sequence[np.ndarray], pad_value: float) -> np.ndarray:
    """Right-pad arrays of one rank to their largest extent on every axis."""
    shape = [len(arrays)] + [max(a.shape[k] for a in arrays) for k in range(arrays[0].ndim)]
    out = np.full(shape, pad_value, dtype=arrays[0].dtype)
    for row, a in enumerate(arrays):
        out[(row,) + tuple(slice(0, n) for n in a.shape)] = a
    return out


@dataclass
class Expected:
    outputs: dict[str, np.ndarray]
    parameters: dict[str, Any] = field(default_factory=dict)


class CpuReference:
    """Each model of the original repository loaded on the CPU, as the server
    loads it, run on one item at a time: no padding, no batch neighbours."""

    def __init__(self, *repositories: Path) -> None:
        from tensorserve.repository.loader import discover

        self.sources = {n: s for r in repositories for n, s in discover(r).items()}
        self._loaded: dict[str, Any] = {}
        self._known: dict[tuple[Any, ...], Expected] = {}  # both isolations send the same items

    def _model(self, name: str) -> Any:
        if name not in self._loaded:
            from tensorserve.repository.loader import load_model, read_config

            source = self.sources[name]
            config = read_config(source, {"device": "cpu"})
            self._loaded[name] = (load_model(source, None, config, intra_op_threads=1), config)
        return self._loaded[name]

    def expected(self, model: ModelInfo, item: Mapping[str, np.ndarray]) -> Expected:
        key = (model.name, *((k, v.dtype.str, v.shape, v.tobytes()) for k, v in item.items()))
        if key not in self._known:
            self._known[key] = self._run(model, item)
        return self._known[key]

    def _run(self, model: ModelInfo, item: Mapping[str, np.ndarray]) -> Expected:
        import torch

        from tensorserve import WithParameters
        from tensorserve.runtime.executor import named_outputs

        loaded, config = self._model(model.reference)
        features = {k: torch.from_numpy(np.ascontiguousarray(v))[None] for k, v in item.items()}
        arguments: dict[str, Any] = dict(features)
        for name, value in model.request_parameters.items():
            arguments[name] = [value]
        with torch.inference_mode():
            result = loaded.module(**arguments)
        parameters: dict[str, Any] = {}
        if isinstance(result, WithParameters):
            result, returned = result.outputs, result.parameters
            for name, values in returned.items():
                values = values.tolist() if isinstance(values, torch.Tensor) else list(values)
                parameters[name] = values[0]
        named = named_outputs(result, config.output)
        outputs = {}
        for spec in config.output:
            value = torch.as_tensor(named[spec.name]).detach().cpu().numpy()[0]
            if spec.unpad_like:
                like = item[spec.unpad_like]
                value = value[tuple(slice(0, n) for n in like.shape)]
            outputs[spec.name] = value
        return Expected(outputs, parameters)


def max_abs_error(got: Mapping[str, np.ndarray], want: Expected) -> tuple[float, float, str | None]:
    """(largest |got - want|, largest |want|, the first shape that differs)."""
    worst, scale = 0.0, 0.0
    for name, expected in want.outputs.items():
        value = got.get(name)
        if value is None or value.shape != expected.shape:
            return float("inf"), 0.0, (f"{name}: shape {None if value is None else value.shape}, "
                                       f"expected {expected.shape}")
        if expected.size:
            difference = np.abs(value.astype(np.float64) - expected.astype(np.float64))
            worst = max(worst, float(np.nan_to_num(difference, nan=np.inf).max()))
            scale = max(scale, float(np.abs(expected).max()))
    return worst, scale, None


def tolerance(model: ModelInfo, device: str, scale: float) -> float:
    """The largest error allowed for ``model``'s outputs of magnitude
    ``scale`` on ``device``, by the dtype it computes in there (the bounds
    and their reasons: tensorserve_bench/tolerance.py; float32's is tight
    enough to catch a TF32 or bfloat16 drift)."""
    from tensorserve_bench.tolerance import tolerance as by_dtype

    return by_dtype(model.compute_dtype(device), scale)


def drift_hint(model: ModelInfo, device: str, error: float, scale: float) -> str:
    """A float32 model on CUDA that misses its bound by a TF32-sized error
    says so: cuDNN's convolutions and RNNs use TF32 unless
    ``torch.backends.cudnn.allow_tf32`` is turned off."""
    if device.startswith("cuda") and model.compute_dtype(device) == "float32":
        relative = error / max(1.0, scale)
        if 1e-4 < relative < 1e-2:
            return " (a TF32-sized drift: torch.backends.cudnn.allow_tf32 is on by default)"
    return ""


# ----------------------------------------------------------------- the server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``python -m tensorserve serve`` on a free loopback port, HTTP only;
    ``start`` waits until it is ready (or raises with its log's tail)."""

    def __init__(self, repository: Path, log: Path, ready_timeout: float = 180.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.ready_timeout = ready_timeout
        self.command = [sys.executable, "-m", "tensorserve", "serve", "--host", "127.0.0.1",
                        "--port", str(self.port), "--grpc-port", "-1", "--model-repository",
                        str(repository), "--log-level", "WARNING", "--drain-delay-s", "0"]
        self.process: subprocess.Popen[bytes] | None = None
        self.ready_s: float | None = None  # seconds from start to ready
        self._tree: dict[int, psutil.Process] = {}

    def start(self) -> Server:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
        with open(self.log, "wb") as output:
            self.process = subprocess.Popen(self.command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                            stdout=output, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.ready_timeout
        while not self.ready():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server was not ready: {self.log_tail()}")
            time.sleep(0.1)
        self.ready_s = time.monotonic() - (deadline - self.ready_timeout)
        return self

    def ready(self, model: str | None = None) -> bool:
        path = f"/v2/models/{model}/ready" if model else "/v2/health/ready"
        try:
            with urllib.request.urlopen(self.url + path, timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def cpu_seconds(self) -> float:
        """User + system CPU of the server and every process it started (workers)."""
        assert self.process is not None
        try:
            root = psutil.Process(self.process.pid)
            self._tree.update({p.pid: p for p in [root, *root.children(recursive=True)]})
        except psutil.NoSuchProcess:
            pass
        total = 0.0
        for process in list(self._tree.values()):
            try:
                t = process.cpu_times()
            except psutil.Error:
                continue  # a worker that exited: its time is lost, as it would be to a reader
            total += t.user + t.system + t.children_user + t.children_system
        return total

    def stop(self) -> None:
        if self.process is None:
            return
        tree = []
        try:
            tree = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            pass
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for child in tree:  # by PID: only what this server started
            try:
                child.kill()
            except psutil.Error:
                pass

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


# ----------------------------------------------------------------- the native protocol
def encode(items: Sequence[Mapping[str, np.ndarray]], parameters: Mapping[str, Any] | None = None) -> bytes:
    wire = [{k: {"dtype": v.dtype.name, "shape": list(v.shape), "data": np.ascontiguousarray(v).tobytes()}
             for k, v in item.items()} for item in items]
    body: dict[str, Any] = {"items": wire}
    if parameters:
        body["parameters"] = dict(parameters)
    return msgpack.packb(body)


@dataclass
class Reply:
    status: int
    outputs: list[dict[str, np.ndarray]]
    parameters: list[dict[str, Any]]
    error: str | None


def decode(status: int, body: bytes) -> Reply:
    try:
        payload = msgpack.unpackb(body, raw=False)
    except Exception:  # noqa: BLE001 - an unreadable body is this reply's error
        return Reply(status, [], [], f"unreadable body ({len(body)} bytes)")
    if status != 200 or not isinstance(payload, dict):
        error = payload.get("code", "?") + ": " + str(payload.get("error"))[:200] \
            if isinstance(payload, dict) else str(payload)[:200]
        return Reply(status, [], [], error)
    outputs = [{name: np.frombuffer(t["data"], dtype=t["dtype"]).reshape(t["shape"])
                for name, t in item.items()} for item in payload.get("outputs", [])]
    parameters = list(payload.get("parameters") or [{} for _ in outputs])
    return Reply(status, outputs, parameters, None)


async def infer(session: Any, url: str, model: str, body: bytes, timeout: float = 120.0) -> Reply:
    import aiohttp

    async with session.post(f"{url}/v2/models/{model}/infer", data=body,
                            headers={"Content-Type": "application/msgpack"},
                            timeout=aiohttp.ClientTimeout(total=timeout)) as response:
        return decode(response.status, await response.read())
