#!/usr/bin/env bash
# The whole GPU run in one device call of at most ~10 minutes: first
# benchmarks/gpu_lone_caller.py (which thread and which step of a batch burn a lone
# caller's CPU, in one process, with the driver's blocking-sync flag as a variant), the CUDA tests,
# benchmarks/gpu_check.py (its checks; its load part is gpu_fill's job now), then
# benchmarks/gpu_fill.py (ceiling against perf_analyzer at the defaults, and at one
# caller the server's CPU per request by process and thread, with py-spy's stacks).
#
# Here, before the call (from the project's root, on the commit to check):
#   ../shared/gpu/carry-wheels.sh        # msgspec, orjson, pydantic, ... into .whl/
#   scripts/carry_perf_analyzer.sh       # perf_analyzer, CUDA 12 runtime, py-spy, libb64 into .whl/pa/
# Then one device call, timeout_s 600, carry [".whl"]:
#   GPU_RUN_COMMIT=<the commit's sha> bash scripts/gpu_run.sh
# A rerun of one part, on the machine still warm: GPU_RUN_STEPS="fill" (any of tests,
# lone, check, fill, packed, isolation, comma-separated; default lone,tests,check,fill). "packed" (issue #54:
# benchmarks/packed.py, padded tagger against packed_tagger on the GPU, ~150 s) is a second
# call of its own, timeout_s 240, when the lease has the time left:
#   GPU_RUN_STEPS=packed GPU_RUN_COMMIT=<sha> bash scripts/gpu_run.sh   ->  env.txt packed.json packed.log
# A short fill of some models (a second call's rerun): GPU_RUN_FILL_MODELS=tagger GPU_RUN_FILL_BUDGET=70.
# "isolation" (thread against process on the GPU: gpu_fill for the tagger and the embedder
# with every model in each, ~250 s) is another such call, timeout_s 300:
#   GPU_RUN_STEPS=isolation ...  ->  env.txt gpu_fill_thread.json gpu_fill_process.json gpu_fill_isolation.log
#
# The GPU machine has no .git, no console script and no tritonclient, opentelemetry or
# kubernetes-validate: the tests run by file (every file holding cuda-marked tests) and the
# server as `python3 -m tensorserve serve`. Each step has its own `timeout`, so that one hang
# cannot eat the lease: the step timeouts (20 + 100 + 110 + 150 + 195 s, and 5 s of grace
# each) add up to 595 s, plus the wheels' install (~10 s; the last full run took ~300 s
# in all), and gpu_fill stops adding points at 150 s of its own.
# Everything lands in $OUT (8 files; the device tool brings back 8 at most; the lone
# caller's printed table goes into env.txt):
#   env.txt  lone_caller.json  cuda_tests.log  gpu_check.json  gpu_check.log
#   gpu_fill.json  gpu_fill.log  gpu_fill_server.log
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_run_out}
STEPS=${GPU_RUN_STEPS:-lone,tests,check,fill}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
status=0
lone_rc=- tests_rc=- check_rc=- fill_rc=- packed_rc=- isolation_rc=

echo "== nvidia-smi"
timeout 20 nvidia-smi > "$OUT/env.txt" 2>&1 || echo "nvidia-smi failed" | tee -a "$OUT/env.txt"
head -20 "$OUT/env.txt"

echo "== the carried wheels"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "installing .whl/ failed"; exit 1; }
else
  echo "no .whl/: run ../shared/gpu/carry-wheels.sh here and carry .whl (msgspec, pydantic... are missing there)"
fi
export PYTHONPATH=$PWD:$PWD/clients/python:$PWD/bench:/tmp/site

# perf_analyzer and py-spy apart, in /tmp/pa: never on the server's PYTHONPATH (the CUDA 12
# runtime wheel's nvidia/__init__.py would hide the machine's own nvidia packages from torch).
if compgen -G ".whl/pa/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/pa .whl/pa/*.whl || echo "installing .whl/pa/ failed"
  for deb in .whl/pa/libb64-0d_*.deb; do [ -f "$deb" ] && dpkg -x "$deb" /tmp/b64; done
  export PERF_ANALYZER=/tmp/pa/bin/perf_analyzer
  # Its libraries for perf_analyzer alone (gpu_fill passes them on), not for torch.
  export PERF_ANALYZER_LIBRARY_PATH=/tmp/pa/nvidia/cuda_runtime/lib:/tmp/b64/usr/lib/x86_64-linux-gnu
  export PATH=$PATH:/tmp/pa/bin  # py-spy
  missing=$(LD_LIBRARY_PATH=$PERF_ANALYZER_LIBRARY_PATH ldd "$PERF_ANALYZER" 2>&1 | grep 'not found' || true)
  [ -z "$missing" ] || echo "perf_analyzer cannot load: $missing" | tee -a "$OUT/env.txt"
else
  echo "no .whl/pa/: run scripts/carry_perf_analyzer.sh here and carry .whl (gpu_fill needs perf_analyzer)" \
    | tee -a "$OUT/env.txt"
fi

echo "== the environment"
python3 - >> "$OUT/env.txt" 2>&1 <<'EOF'
import importlib.util, os, platform, shutil, sys
import torch
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda)
print("cuda available:", torch.cuda.is_available(),
      "|", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
wanted = ["aiohttp", "msgpack", "numpy", "safetensors", "grpc", "google.protobuf", "prometheus_client",
          "psutil", "rich", "msgspec", "orjson", "pydantic", "pydantic_settings", "pytest",
          "pytest_asyncio", "pytest_aiohttp", "pytest_timeout", "httpx", "pynvml", "onnxruntime",
          "tokenizers"]
missing = [name for name in wanted if importlib.util.find_spec(name) is None]
print("missing:", " ".join(missing) or "nothing")
print("perf_analyzer:", os.environ.get("PERF_ANALYZER", "-"), "| py-spy:", shutil.which("py-spy") or "-")
print("cores:", len(os.sched_getaffinity(0)))
import tensorserve.cli  # noqa: F401 - the server's imports, all of them
print("tensorserve.cli imports")
sys.exit(0 if torch.cuda.is_available() else 3)
EOF
env_rc=$?
cat "$OUT/env.txt"
if [ "$env_rc" -ne 0 ]; then echo "the environment is not usable (rc $env_rc): stopping"; exit 1; fi

if [[ ",$STEPS," == *",lone,"* ]]; then
  # First: the question the last run left open (issue #50, "explain the c=1 CPU burn").
  echo "== benchmarks/gpu_lone_caller.py"
  timeout -k 5 100 python3 benchmarks/gpu_lone_caller.py --device cuda:0 --budget-s 85 \
    --out "$OUT/lone_caller.json" --commit "${GPU_RUN_COMMIT:-unknown}" 2>&1 | tee -a "$OUT/env.txt"
  lone_rc=${PIPESTATUS[0]}
  echo "gpu_lone_caller: exit $lone_rc (124: timed out)"
  [ "$lone_rc" -eq 0 ] || status=1
fi

if [[ ",$STEPS," == *",tests,"* ]]; then
  echo "== the CUDA tests"
  mapfile -t files < <(grep -l "pytest.mark.cuda" tests/test_*.py)
  extra=()
  if grep -q "^missing:.*pytest_timeout" "$OUT/env.txt"; then
    # pyproject's `timeout` option and the timeout marks are unknown without the plugin,
    # and filterwarnings = error would stop pytest at start-up.
    extra=(-W ignore::pytest.PytestConfigWarning -W ignore::pytest.PytestUnknownMarkWarning)
  fi
  timeout -k 5 110 python3 -m pytest -q -p no:cacheprovider -m cuda -rfEs "${extra[@]}" \
    "${files[@]}" 2>&1 | tee "$OUT/cuda_tests.log"
  tests_rc=${PIPESTATUS[0]}
  echo "cuda tests: exit $tests_rc (124: timed out)"
  [ "$tests_rc" -eq 0 ] || status=1
fi

if [[ ",$STEPS," == *",check,"* ]]; then
  echo "== benchmarks/gpu_check.py"
  timeout -k 5 150 python3 benchmarks/gpu_check.py --device cuda:0 --no-load --out "$OUT/gpu_check.json" \
    --commit "${GPU_RUN_COMMIT:-unknown}" 2>&1 | tee "$OUT/gpu_check.log"
  check_rc=${PIPESTATUS[0]}
  echo "gpu_check: exit $check_rc (124: timed out)"
  [ "$check_rc" -eq 0 ] || status=1
fi

if [[ ",$STEPS," == *",fill,"* ]]; then
  echo "== benchmarks/gpu_fill.py"
  timeout -k 5 $(( ${GPU_RUN_FILL_BUDGET:-150} + 45 )) python3 benchmarks/gpu_fill.py --device cuda:0 \
    --budget-s "${GPU_RUN_FILL_BUDGET:-150}" --models "${GPU_RUN_FILL_MODELS:-tagger,embedder,text_tagger,bert_encoder}" \
    --out "$OUT/gpu_fill.json" --server-log "$OUT/gpu_fill_server.log" \
    --commit "${GPU_RUN_COMMIT:-unknown}" 2>&1 | tee "$OUT/gpu_fill.log"
  fill_rc=${PIPESTATUS[0]}
  echo "gpu_fill: exit $fill_rc (124: timed out)"
  [ "$fill_rc" -eq 0 ] || status=1
fi

if [[ ",$STEPS," == *",packed,"* ]]; then
  echo "== benchmarks/packed.py"
  timeout -k 5 200 python3 benchmarks/packed.py --duration 5 --warmup 2 --out "$OUT/packed.json" \
    2>&1 | tee "$OUT/packed.log"
  packed_rc=${PIPESTATUS[0]}
  echo "packed: exit $packed_rc (124: timed out)"
  [ "$packed_rc" -eq 0 ] || status=1
fi

if [[ ",$STEPS," == *",isolation,"* ]]; then
  # Thread against process on the GPU (issue #50: measure, decide, say why in
  # docs/threading.md): the tagger and the embedder with every model in each isolation.
  for isolation in thread process; do
    echo "== benchmarks/gpu_fill.py --isolation $isolation"
    timeout -k 5 140 python3 benchmarks/gpu_fill.py --device cuda:0 --budget-s 110 \
      --models tagger,embedder --isolation "$isolation" --out "$OUT/gpu_fill_$isolation.json" \
      --commit "${GPU_RUN_COMMIT:-unknown}" 2>&1 | tee -a "$OUT/gpu_fill_isolation.log"
    rc=${PIPESTATUS[0]}
    echo "gpu_fill --isolation $isolation: exit $rc (124: timed out)"
    isolation_rc="$isolation_rc $isolation:$rc"
    [ "$rc" -eq 0 ] || status=1
  done
fi

echo "== done: lone caller exit $lone_rc, cuda tests exit $tests_rc, gpu_check exit $check_rc, gpu_fill exit $fill_rc, packed exit $packed_rc, isolation exit${isolation_rc:- -}"
exit "$status"
