#!/usr/bin/env bash
# Installs Triton's perf_analyzer in a venv of its own and prints how to run
# it. Idempotent: a second run only checks and prints.
#
#   scripts/install_perf_analyzer.sh            # -> benchmarks/.cache/perf_analyzer
#   PERF_ANALYZER_HOME=/some/dir scripts/install_perf_analyzer.sh
#
# The manylinux wheel of tritonclient 2.50.0 ships bin/perf_analyzer (later
# wheels need glibc 2.38). The binary links libb64.so.0d (Debian libb64-0d,
# installed with apt-get when missing) and libcudart.so.12 (PyPI
# nvidia-cuda-runtime-cu12; it loads without a GPU), so its lib/ goes on
# LD_LIBRARY_PATH. The last lines of output are shell assignments:
#
#   PERF_ANALYZER=/abs/path/to/bin/perf_analyzer
#   LD_LIBRARY_PATH=/abs/path/to/nvidia/cuda_runtime/lib
set -euo pipefail
cd "$(dirname "$0")/.."
home="${PERF_ANALYZER_HOME:-$PWD/benchmarks/.cache/perf_analyzer}"
venv="$home/venv"
tritonclient="tritonclient[http]==2.50.0"
cudart="nvidia-cuda-runtime-cu12==12.6.77"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/perf_analyzer" ] || [ ! -f "$venv/.installed" ]; then
  mkdir -p "$home"
  # A venv of its own: tritonclient's pins never meet the project's.
  "$python" -m venv --clear "$venv" >&2
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "$tritonclient" "$cudart" >&2
  touch "$venv/.installed"
fi

cudart_lib=$("$venv/bin/python" - <<'EOF'
import pathlib, nvidia.cuda_runtime as m
print(pathlib.Path(list(m.__path__)[0], "lib"))
EOF
)

ldconfig=$(command -v ldconfig || echo /sbin/ldconfig)
if ! "$ldconfig" -p 2>/dev/null | grep -q 'libb64\.so\.0d'; then
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  echo "installing libb64-0d (perf_analyzer links libb64.so.0d)" >&2
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    libb64-0d >&2
fi

# Every library resolves, or say which one does not.
missing=$(LD_LIBRARY_PATH="$cudart_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  ldd "$venv/bin/perf_analyzer" | grep 'not found' || true)
if [ -n "$missing" ]; then
  echo "perf_analyzer cannot load its libraries:" >&2
  echo "$missing" >&2
  exit 1
fi
echo "PERF_ANALYZER=$venv/bin/perf_analyzer"
echo "LD_LIBRARY_PATH=$cudart_lib"
