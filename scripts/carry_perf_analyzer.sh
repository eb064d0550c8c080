#!/usr/bin/env bash
# What scripts/gpu_run.sh needs on a GPU machine that cannot download, for
# perf_analyzer and py-spy, fetched here into .whl/pa/ (ignored by git):
#
#   tritonclient 2.50.0's manylinux wheel   bin/perf_analyzer (later wheels need glibc 2.38)
#   nvidia-cuda-runtime-cu12 12.6.77        libcudart.so.12, which perf_analyzer links
#   py-spy                                  the server's busiest stacks at one caller
#   libb64-0d's .deb (Debian, not a wheel)  libb64.so.0d, which perf_analyzer links
#
# Run from the project's root, after the project's own wheels are in .whl/:
#   scripts/carry_perf_analyzer.sh
# Then the device call carries [".whl"]; gpu_run.sh installs .whl/*.whl into
# /tmp/site and .whl/pa/ into /tmp/pa apart, never on the server's PYTHONPATH:
# the CUDA 12 runtime wheel ships an nvidia/__init__.py that would hide the
# nvidia namespace of the machine's own torch.
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)  # a worktree's .git is a file
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
mkdir -p .whl/pa
for spec in "tritonclient==2.50.0" "nvidia-cuda-runtime-cu12==12.6.77" "py-spy==0.4.3"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .whl/pa "$spec"
done
if ! compgen -G ".whl/pa/libb64-0d_*.deb" > /dev/null; then
  (cd .whl/pa && apt-get download libb64-0d 2>&1 | grep -v '^W: Download is performed unsandboxed' || true)
fi
compgen -G ".whl/pa/libb64-0d_*.deb" > /dev/null || { echo "no libb64-0d .deb: apt-get download failed" >&2; exit 1; }
ls -1 .whl/pa
# The device call carries 64 MiB at most, the working tree included.
du -sh .whl
