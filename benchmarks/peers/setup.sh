#!/usr/bin/env bash
# Create one virtualenv per peer under benchmarks/peers/.venvs/<peer>.
#
#   bash benchmarks/peers/setup.sh                 # all peers
#   bash benchmarks/peers/setup.sh litserve batched  # only these
#
# Idempotent: a venv whose marker file matches its package spec is skipped.
# torch==2.13.0 is always installed FIRST (the CPU wheel), and every later
# install is constrained to it so no peer can drag in another torch build
# (any other version pulls gigabytes of CUDA wheels).
# None of these packages is a dependency of tensorserve itself. The runner,
# the load generator and tensorserve run in the interpreter that has
# tensorserve and tensorserve-bench installed (pip install -e . -e bench), not in a venv of here.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENVS="$HERE/.venvs"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="torch==2.13.0"

# Common runtime bits every peer server needs to load the shared weights.
COMMON="numpy safetensors"

declare -A SPECS=(
  # NVIDIA Triton Inference Server driven from Python
  [pytriton]="$COMMON nvidia-pytriton==0.7.0"
  # Seldon MLServer; 1.7 breaks with uvloop>=0.22
  [mlserver]="$COMMON mlserver==1.7.1 uvloop<0.22"
  # Lightning LitServe
  [litserve]="$COMMON litserve==0.2.19"
  # `batched` (in-process dynamic batching) behind a minimal aiohttp handler
  [batched]="$COMMON batched==0.1.5 aiohttp msgpack"
)
ORDER=(pytriton mlserver litserve batched)

if [[ $# -gt 0 ]]; then
  WANT=("$@")
else
  WANT=("${ORDER[@]}")
fi

# pip, minus the noise of this machine's file:// extra indexes
pipq() {
  local venv="$1"; shift
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
  return "${PIPESTATUS[0]}"
}

mkdir -p "$VENVS"
CONSTRAINTS="$VENVS/constraints.txt"
echo "$TORCH_SPEC" > "$CONSTRAINTS"

for peer in "${WANT[@]}"; do
  spec="${SPECS[$peer]:-}"
  if [[ -z "$spec" ]]; then
    echo "setup.sh: unknown peer '$peer' (known: ${ORDER[*]})" >&2
    exit 2
  fi
  venv="$VENVS/$peer"
  marker="$venv/.peer-spec"
  want="$TORCH_SPEC $spec"
  if [[ -f "$marker" && "$(cat "$marker")" == "$want" && -x "$venv/bin/python" ]]; then
    echo "[setup] $peer: up to date"
    continue
  fi
  if [[ -x "$venv/bin/python" ]]; then
    echo "[setup] $peer: updating $venv"
  else
    echo "[setup] $peer: creating $venv"
    "$PYTHON" -m venv "$venv"
    pipq "$venv" --upgrade pip
  fi
  pipq "$venv" "$TORCH_SPEC"
  # shellcheck disable=SC2086
  pipq "$venv" -c "$CONSTRAINTS" $spec
  "$venv/bin/python" -c \
    "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
  echo "$want" > "$marker"
  echo "[setup] $peer: ok"
done
