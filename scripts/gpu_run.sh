#!/usr/bin/env bash
# The whole GPU check in one device call: the CUDA tests, then benchmarks/gpu_check.py.
#
# Here, before the call (from the project's root, on the commit to check):
#   ../shared/gpu/carry-wheels.sh pytest-timeout   # msgspec, orjson, pydantic, ... into .whl/
# Then one device call, timeout_s 600, carry [".whl"]:
#   GPU_RUN_COMMIT=<the commit's sha> bash scripts/gpu_run.sh
#
# The GPU machine has no .git, no console script and no tritonclient, opentelemetry or
# kubernetes-validate: the tests run by file (every file holding cuda-marked tests) and the
# server as `python3 -m tensorserve serve`. Each step has its own `timeout`, so that one hang
# cannot eat the lease; the steps' budgets (20 + 230 + 310 s) end inside the call's 600 s.
# Everything lands in $OUT (6 files; the device tool brings back 8 at most):
#   nvidia-smi.txt  env.txt  cuda_tests.xml  cuda_tests.log  gpu_check.json  gpu_check.log
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_run_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
status=0

echo "== nvidia-smi"
timeout 20 nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || echo "nvidia-smi failed" | tee -a "$OUT/nvidia-smi.txt"
head -20 "$OUT/nvidia-smi.txt"

echo "== the carried wheels"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "installing .whl/ failed"; exit 1; }
else
  echo "no .whl/: run ../shared/gpu/carry-wheels.sh here and carry .whl (msgspec, pydantic... are missing there)"
fi
export PYTHONPATH=$PWD:$PWD/clients/python:$PWD/bench:/tmp/site

echo "== the environment"
python3 - > "$OUT/env.txt" 2>&1 <<'EOF'
import importlib.util, platform, sys
import torch
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda)
print("cuda available:", torch.cuda.is_available(),
      "|", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
wanted = ["aiohttp", "msgpack", "numpy", "safetensors", "grpc", "google.protobuf", "prometheus_client",
          "psutil", "rich", "msgspec", "orjson", "pydantic", "pydantic_settings", "pytest",
          "pytest_asyncio", "pytest_aiohttp", "pytest_timeout", "httpx", "pynvml", "onnxruntime"]
missing = [name for name in wanted if importlib.util.find_spec(name) is None]
print("missing:", " ".join(missing) or "nothing")
import tensorserve.cli  # noqa: F401 - the server's imports, all of them
print("tensorserve.cli imports")
sys.exit(0 if torch.cuda.is_available() else 3)
EOF
env_rc=$?
cat "$OUT/env.txt"
if [ "$env_rc" -ne 0 ]; then echo "the environment is not usable (rc $env_rc): stopping"; exit 1; fi

echo "== the CUDA tests"
mapfile -t files < <(grep -l "pytest.mark.cuda" tests/test_*.py)
extra=()
if grep -q "^missing:.*pytest_timeout" "$OUT/env.txt"; then
  # pyproject's `timeout` option and the timeout marks are unknown without the plugin,
  # and filterwarnings = error would stop pytest at start-up.
  extra=(-W ignore::pytest.PytestConfigWarning -W ignore::pytest.PytestUnknownMarkWarning)
fi
timeout -k 5 230 python3 -m pytest -q -p no:cacheprovider -m cuda -rfEs "${extra[@]}" \
  --junitxml="$OUT/cuda_tests.xml" "${files[@]}" 2>&1 | tee "$OUT/cuda_tests.log"
tests_rc=${PIPESTATUS[0]}
echo "cuda tests: exit $tests_rc (124: timed out)"
[ "$tests_rc" -eq 0 ] || status=1

echo "== benchmarks/gpu_check.py"
timeout -k 5 310 python3 benchmarks/gpu_check.py --device cuda:0 --out "$OUT/gpu_check.json" \
  --commit "${GPU_RUN_COMMIT:-unknown}" 2>&1 | tee "$OUT/gpu_check.log"
check_rc=${PIPESTATUS[0]}
echo "gpu_check: exit $check_rc (124: timed out)"
[ "$check_rc" -eq 0 ] || status=1

echo "== done: cuda tests exit $tests_rc, gpu_check exit $check_rc"
exit "$status"
