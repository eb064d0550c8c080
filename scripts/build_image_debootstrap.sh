#!/usr/bin/env bash
# Build the CPU image for real on a machine that cannot pull registry images,
# then check it inside the container: readiness (the image's own HEALTHCHECK),
# one inference request, and a clean exit 0 on SIGTERM within the stop timeout.
#
# The base image is Debian bookworm made by debootstrap from Debian's
# packages (python3 3.11, like the default python:3.11-slim-bookworm base),
# imported into podman; the Dockerfile is built on it unchanged, with
# --build-arg BASE_IMAGE. Needs root and Debian's podman, runc and debootstrap:
#   apt-get install -y podman runc debootstrap
#
#   scripts/build_image_debootstrap.sh [WORKDIR]      (default /tmp/tensorserve-image)
#
# TORCH_WHEELS (default /opt/wheels, if present) is a folder of wheels that
# the build's pip may take torch from (mounted read-only during the build);
# HOST_CA (default this host's CA bundle) is the CA bundle the build's pip trusts.
# docs/deployment.md says why runc and the ulimit and cgroup flags are needed.
set -euo pipefail
cd "$(dirname "$0")/.."

work=${1:-/tmp/tensorserve-image}
base=localhost/tensorserve-base:bookworm
image=localhost/tensorserve:cpu
name=tensorserve-check
port=${PORT:-18000}
wheels=${TORCH_WHEELS:-/opt/wheels}
host_ca=${HOST_CA:-/etc/ssl/certs/ca-certificates.crt}
stop_timeout=30
# runc: crun refuses this kernel's hybrid cgroup v1/v2 layout. Explicit
# ulimits below the host's: the sandbox refuses to raise (or even re-set) them.
engine=(podman --runtime runc)
limits=(--ulimit nofile=16384:16384 --ulimit nproc=16384:16384)

mkdir -p "$work"
if [ ! -x "$work/rootfs/usr/bin/python3" ]; then
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,passwd \
    bookworm "$work/rootfs" http://deb.debian.org/debian
fi
# The build's pip: torch from the local wheels when given, and this host's CA
# bundle (a TLS-intercepting proxy's CA is in the host's, not in Debian's).
volumes=()
{
  echo '[global]'
  if [ -f "$host_ca" ]; then
    cp "$host_ca" "$work/rootfs/etc/ssl/host-ca.crt"
    echo 'cert = /etc/ssl/host-ca.crt'
  fi
  if [ -d "$wheels" ]; then
    echo "find-links = $wheels"
    volumes=(-v "$wheels:$wheels:ro")
  fi
} > "$work/rootfs/etc/pip.conf"
tar -C "$work/rootfs" -c . | "${engine[@]}" import - "$base"

# --format docker keeps HEALTHCHECK (the OCI image format has no such field).
"${engine[@]}" build --format docker --network host "${limits[@]}" "${volumes[@]}" \
  --build-arg BASE_IMAGE="$base" --build-arg DEVICE=cpu -t "$image" .

"${engine[@]}" rm -f "$name" >/dev/null 2>&1 || true
"${engine[@]}" run -d --name "$name" --network host "${limits[@]}" \
  --stop-timeout "$stop_timeout" -e TENSORSERVE_PORT="$port" "$image"
trap '"${engine[@]}" rm -f "$name" >/dev/null 2>&1 || true' EXIT

echo "waiting for readiness (the image's HEALTHCHECK)"
deadline=$((SECONDS + 300))
until "${engine[@]}" healthcheck run "$name" >/dev/null 2>&1; do
  if [ "$("${engine[@]}" inspect -f '{{.State.Running}}' "$name")" != true ]; then
    "${engine[@]}" logs "$name"; echo "the server exited before it was ready" >&2; exit 1
  fi
  [ $SECONDS -lt $deadline ] || { "${engine[@]}" logs "$name"; echo "not ready in 300 s" >&2; exit 1; }
  sleep 2
done
echo "ready; user: $("${engine[@]}" exec "$name" id -u)"

"${engine[@]}" exec "$name" python3 -c "
import json, urllib.request
body = {'inputs': [{'name': 'input_ids', 'datatype': 'INT64', 'shape': [1, 4], 'data': [101, 7, 8, 102]},
                   {'name': 'attention_mask', 'datatype': 'INT64', 'shape': [1, 4], 'data': [1, 1, 1, 1]}]}
request = urllib.request.Request('http://127.0.0.1:$port/v2/models/tagger/infer', json.dumps(body).encode(),
                                 {'Content-Type': 'application/json'})
reply = json.load(urllib.request.urlopen(request, timeout=30))
print('infer:', [(o['name'], o['shape']) for o in reply['outputs']])
assert reply['outputs'][0]['shape'][:2] == [1, 4], reply
"

started=$SECONDS
"${engine[@]}" stop -t "$stop_timeout" "$name" >/dev/null
code=$("${engine[@]}" inspect -f '{{.State.ExitCode}}' "$name")
echo "stopped in $((SECONDS - started)) s with exit code $code (SIGTERM, drain, exit)"
"${engine[@]}" logs "$name" 2>&1 | tail -n 5
[ "$code" = 0 ] || { echo "unclean stop: exit code $code" >&2; exit 1; }
echo "image $image: built, ready, answered, stopped cleanly"
