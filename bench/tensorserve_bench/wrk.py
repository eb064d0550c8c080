"""Load from ``wrk``, an external C load generator, for the server's front-end
ceiling.

Our own load generator (``loadgen``, ``rawhttp``) is Python: on a small
machine it competes with the server for the same cores and the GIL-free C
client costs far less per request, so the server's ceiling shows instead of
the client's. ``wrk`` (Debian's package: ``apt-get install wrk``) sends
prebuilt requests as fast as ``-c`` keep-alive connections allow.

    folder = Path(tmp)
    script = write_script(folder, "/v2/models/m/infer", "application/json", bodies)
    window = measure(server, server.url, script, connections=64, duration=5, warmup=2)
    window.result.requests_per_s, window.server_cpu_us_per_request
    window.roles.scheduler_s, window.roles.frontend_s      # the server's CPU by role

``write_model_scripts`` writes, per protocol, a script of one-item requests
for a served model (its inputs as the server describes them);
``write_script`` writes each body to a file of its own and a Lua script that
reads them back in binary (so msgpack bodies survive), formats one request per
body with ``wrk.format`` once, in ``init``, and cycles through them in
``request()``. ``run_wrk`` runs ``wrk -t1 -cC -dD --latency`` and
``parse_wrk_output`` reads its report. ``measure`` adds a warm-up run and
the CPU seconds the server's process tree (``ChildServer.usage``) and wrk
itself spent over the measured window, and the server's split by role
(``proctree``: its own process, its front ends, its other children).
"""

from __future__ import annotations

import asyncio
import re
import resource
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tensorserve_bench.items import ItemFactory, vocab_limit
from tensorserve_bench.lengths import LengthDistribution
from tensorserve_bench.proctree import CpuSplit, sample_tree, split_cpu
from tensorserve_bench.server import ChildServer
from tensorserve_bench.targets import HttpTarget

# wrk's time units (units.c: us, ms, s, then m and h for long times).
_SECONDS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_TIME = r"([\d.]+)(us|ms|s|m|h)"


class WrkNotInstalled(RuntimeError):
    """No ``wrk`` on the PATH."""


class WrkFailed(RuntimeError):
    """wrk exited with an error, or its report could not be read."""


@dataclass(frozen=True)
class WrkResult:
    """What one wrk run reports (wrk counts a request when its response is read)."""

    requests: int
    duration_s: float
    requests_per_s: float
    non_2xx: int  # wrk's "Non-2xx or 3xx responses": statuses >= 400
    socket_errors: dict[str, int] = field(default_factory=dict)  # connect/read/write/timeout
    latency_ms: dict[str, float] = field(default_factory=dict)  # "p50", "p75", "p90", "p99"

    @property
    def ok_requests(self) -> int:
        return self.requests - self.non_2xx

    @property
    def ok_per_s(self) -> float:
        # From wrk's own rate: its printed duration is rounded to 10 ms.
        return self.requests_per_s * self.ok_requests / self.requests if self.requests else 0.0

    @property
    def errors(self) -> int:
        return self.non_2xx + sum(self.socket_errors.values())


@dataclass(frozen=True)
class WrkWindow:
    """A measured wrk run with what the server and wrk spent on it."""

    result: WrkResult
    server_cpu_s: float | None  # the server tree's CPU seconds over the run; None: no server
    wrk_cpu_s: float  # wrk's own user + system seconds
    # The server's CPU seconds by role over the run, from /proc; None: no server.
    roles: CpuSplit | None = None

    @property
    def server_cpu_us_per_request(self) -> float | None:
        if self.server_cpu_s is None or not self.result.requests:
            return None
        return 1e6 * self.server_cpu_s / self.result.requests

    @property
    def wrk_cpu_us_per_request(self) -> float | None:
        return 1e6 * self.wrk_cpu_s / self.result.requests if self.result.requests else None


def find_wrk() -> str:
    """The wrk executable, or ``WrkNotInstalled`` saying how to get it."""
    path = shutil.which("wrk")
    if path is None:
        raise WrkNotInstalled(
            "wrk is not installed (not on the PATH): install it with `apt-get install wrk` "
            "(Debian/Ubuntu) or build it from https://github.com/wg/wrk"
        )
    return path


def wrk_version() -> str:
    """wrk's first line of ``-v`` (it exits 1 after printing it)."""
    completed = subprocess.run([find_wrk(), "-v"], capture_output=True, text=True, check=False)
    return (completed.stdout or completed.stderr).splitlines()[0].strip()


# ---------------------------------------------------------------------- the script
def lua_string(text: str) -> str:
    """``text`` as a Lua string literal. Every byte outside printable ASCII is a
    decimal escape, which Lua 5.1 and LuaJIT both read (no ``\\u``)."""
    out = []
    for byte in text.encode():
        if 32 <= byte < 127 and byte not in (34, 92):  # not '"' or '\'
            out.append(chr(byte))
        else:
            out.append(f"\\{byte:03d}")
    return '"' + "".join(out) + '"'


SCRIPT = """\
-- Written by tensorserve_bench.wrk: POST {count} prebuilt bodies in turn.
local path = {path}
local content_type = {content_type}
local files = {{
{files}
}}
local requests = {{}}
local index = 0

-- Each wrk thread runs init in its own Lua state. The requests are formatted
-- here, once, so request() costs wrk a table lookup, not a string build.
function init(args)
  for i, name in ipairs(files) do
    local file = assert(io.open(name, "rb"))  -- binary: msgpack bodies hold any byte
    local body = file:read("*a")
    file:close()
    -- wrk.format adds Host and Content-Length to the table it is given: a fresh one each time.
    requests[i] = wrk.format("POST", path, {{["Content-Type"] = content_type}}, body)
  end
end

function request()
  index = index % #requests + 1
  return requests[index]
end
"""


def write_bodies(folder: str | Path, bodies: Sequence[bytes]) -> list[Path]:
    """Each body as ``folder/body_NNNN.bin``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for index, body in enumerate(bodies):
        path = folder / f"body_{index:04d}.bin"
        path.write_bytes(body)
        paths.append(path)
    return paths


def write_script(folder: str | Path, path: str, content_type: str, bodies: Sequence[bytes]) -> Path:
    """The bodies as files in ``folder`` and ``folder/requests.lua``, which POSTs
    them to ``path`` in turn (request i takes body i mod len(bodies))."""
    if not bodies:
        raise ValueError("wrk needs at least one request body")
    files = write_bodies(folder, bodies)
    script = Path(folder) / "requests.lua"
    script.write_text(
        SCRIPT.format(
            count=len(files),
            path=lua_string(path),
            content_type=lua_string(content_type),
            files=",\n".join(f"  {lua_string(str(p.resolve()))}" for p in files),
        )
    )
    return script


def write_model_scripts(
    url: str,
    model: str,
    protocols: Sequence[str],
    folder: Path,
    *,
    count: int,
    lengths: LengthDistribution,
    seed: int,
) -> dict[str, Path]:
    """Per protocol, a wrk script over ``count`` one-item requests for ``model``
    at ``url``: the same items (from its inputs, as the server describes
    them) on each, in ``folder/{model}-{protocol}``."""

    async def bodies(protocol: str) -> tuple[str, str, list[bytes]]:
        target = HttpTarget(url, model, protocol=protocol)
        await target.open()  # discovers the inputs and parameters
        try:
            factory = ItemFactory(
                target.specs, lengths, seed=seed,
                id_range=(1, vocab_limit(target.parameters, 1000)),
            )  # fmt: skip
            items, _ = factory.make(count)
            encoded = [target.encode_body([item])[0] for item in items]
            return target.infer_path, target.content_type, encoded
        finally:
            await target.aclose()

    scripts = {}
    for protocol in protocols:
        path, content_type, encoded = asyncio.run(bodies(protocol))
        scripts[protocol] = write_script(
            folder / f"{model}-{protocol}", path, content_type, encoded
        )
    return scripts


# ---------------------------------------------------------------------- running and reading
def parse_wrk_output(text: str) -> WrkResult:
    """wrk's report (with ``--latency``) as numbers; latencies in ms."""
    total = re.search(r"(\d+) requests in " + _TIME, text)
    rate = re.search(r"Requests/sec:\s+([\d.]+)", text)
    if total is None or rate is None:
        raise WrkFailed(f"not a wrk report:\n{text}")
    non_2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    sockets = re.search(
        r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text
    )
    latency: dict[str, float] = {}
    distribution = text.partition("Latency Distribution")[2]
    for percent, value, unit in re.findall(r"^\s+([\d.]+)%\s+" + _TIME, distribution, re.MULTILINE):
        latency[f"p{float(percent):g}"] = float(value) * _SECONDS[unit] * 1e3
    return WrkResult(
        requests=int(total[1]),
        duration_s=float(total[2]) * _SECONDS[total[3]],
        requests_per_s=float(rate[1]),
        non_2xx=int(non_2xx[1]) if non_2xx else 0,
        socket_errors=dict(zip(("connect", "read", "write", "timeout"), map(int, sockets.groups())))
        if sockets
        else {},
        latency_ms=latency,
    )


def wrk_command(
    url: str, script: str | Path, connections: int, duration: int, *, timeout_s: int = 10
) -> list[str]:
    """One wrk thread: on a small machine a second would take a core from the server."""
    return [
        find_wrk(), "-t1", f"-c{connections}", f"-d{duration}s", "--latency",
        "--timeout", f"{timeout_s}s", "-s", str(script), url,
    ]  # fmt: skip


def run_wrk(
    url: str, script: str | Path, connections: int, duration: int, *, timeout_s: int = 10
) -> tuple[WrkResult, float]:
    """One wrk run (``duration`` whole seconds: wrk reads no fractions) and the
    CPU seconds wrk spent (from this process's reaped children)."""
    if duration < 1:
        raise ValueError(f"wrk runs for whole seconds, at least 1, not {duration}")
    command = wrk_command(url, script, connections, duration, timeout_s=timeout_s)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    completed = subprocess.run(
        command, capture_output=True, text=True, check=False, timeout=duration + timeout_s + 30
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if completed.returncode != 0:
        raise WrkFailed(
            f"{' '.join(command)} exited with {completed.returncode}:\n"
            f"{completed.stdout}{completed.stderr}"
        )
    wrk_cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return parse_wrk_output(completed.stdout), wrk_cpu


def measure(
    server: ChildServer | None,
    url: str,
    script: str | Path,
    *,
    connections: int,
    duration: int,
    warmup: int = 2,
    timeout_s: int = 10,
) -> WrkWindow:
    """A ``warmup``-second run (0: none), then the measured one, with the
    server tree's CPU seconds read just before and after it. The CPU delta
    also covers wrk's connecting and the requests still in flight when wrk
    stops (at most ``connections``), so keep windows long enough that
    ``connections`` is small against the requests counted."""
    if warmup > 0:
        run_wrk(url, script, connections, warmup, timeout_s=timeout_s)
    pid = server.process.pid if server is not None and server.process is not None else None
    roles_before = sample_tree(pid) if pid is not None else {}
    before = server.usage().cpu_s if server is not None else None
    result, wrk_cpu = run_wrk(url, script, connections, duration, timeout_s=timeout_s)
    after = server.usage().cpu_s if server is not None else None
    roles = split_cpu(roles_before, sample_tree(pid), pid) if pid is not None else None
    server_cpu = after - before if before is not None and after is not None else None
    return WrkWindow(result, server_cpu, wrk_cpu, roles)
