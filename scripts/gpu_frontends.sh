#!/usr/bin/env bash
# Many cores for one GPU, measured where there are many cores (the lent GPU machine: 16):
# the flat model (5 ms a batch of up to 64: it allows 12,800 items/s) at c=512, loaded by
# wrk, under `--frontends 1 2 4 8` (docs/performance.md, "Many cores"). Twice:
#   on the GPU (--flat-device cuda): the device busy 5 ms a batch, the host only queuing it,
#     so the executor overlaps two batches as it does for any CUDA model: what a GPU sees;
#   on the host (a 5 ms sleep, as on the 2-core VM) with --intra-op-threads 1: the CPU
#     model's torch.zeros would otherwise wake 15 intra-op threads that spin on 4-9 cores.
#
# Here, before the device call (from the project's root, on the commit to measure):
#   ../shared/gpu/carry-wheels.sh pytest-timeout   # the wheels the machine lacks, into .whl/
#   bash scripts/gpu_frontends.sh --prepare          # wrk and its libluajit, into .gpu-tools/
# Then in the device call (carry [".whl", ".gpu-tools"]), after or instead of gpu_run.sh:
#   GPU_RUN_COMMIT=<sha> bash scripts/gpu_run.sh; bash scripts/gpu_frontends.sh
# It needs ~4 minutes. Lands in $OUT: frontends_cuda.{json,log}, frontends_cpu.{json,log},
# and with --ceiling scheduler_ceiling_16.json: the scheduler process's CPU a request when a
# driver process keeps it busy (benchmarks/scheduler_ceiling.py), on cores no front end shares.
set -uo pipefail
cd "$(dirname "$0")/.."
TOOLS=.gpu-tools

if [ "${1:-}" = "--prepare" ]; then
  mkdir -p "$TOOLS"
  wrk=$(command -v wrk) || { echo "no wrk here: apt-get install wrk"; exit 1; }
  cp "$wrk" "$TOOLS/wrk"
  # Its libraries the GPU machine may lack (libssl and libc it has).
  ldd "$wrk" | awk '/luajit/ {print $3}' | xargs -r -I{} cp {} "$TOOLS/"
  ls -l "$TOOLS"
  exit 0
fi

OUT=${OUT:-/tmp/gpu_run_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# The wheels gpu_run.sh installs, unless it ran already or nothing is missing.
if compgen -G ".whl/*.whl" > /dev/null && [ ! -d /tmp/site ] \
    && ! python3 -c "import msgspec, pydantic_settings" 2> /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "installing .whl/ failed"; exit 1; }
fi
export PYTHONPATH=$PWD:$PWD/clients/python:$PWD/bench:/tmp/site
if [ -x "$TOOLS/wrk" ]; then
  export PATH=$PWD/$TOOLS:$PATH LD_LIBRARY_PATH=$PWD/$TOOLS:${LD_LIBRARY_PATH:-}
fi
command -v wrk > /dev/null || { echo "no wrk: run scripts/gpu_frontends.sh --prepare here and carry $TOOLS"; exit 1; }
echo "== $(nproc) CPUs; wrk: $(wrk -v 2>&1 | head -1)"
status=0
for device in cuda cpu; do
  flags=(--flat-device "$device")
  [ "$device" = cpu ] && flags+=(--server-arg=--intra-op-threads=1)
  timeout -k 5 170 python3 benchmarks/frontend.py --frontends 1 2 4 8 --cases flat --flat-c 512 \
    --isolation thread --repeats 1 --duration 8 --warmup 2 "${flags[@]}" \
    --output "$OUT/frontends_$device.json" 2>&1 | tee "$OUT/frontends_$device.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
if [ "${1:-}" = "--ceiling" ]; then
  timeout -k 5 60 python3 benchmarks/scheduler_ceiling.py --repeats 2 --duration 8 --warmup 3 \
    --output "$OUT/scheduler_ceiling_16.json" 2>&1 | tee -a "$OUT/frontends_cpu.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
exit $status
