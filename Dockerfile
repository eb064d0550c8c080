# tensorserve images, two variants from one file (docs/deployment.md):
#
#   GPU (default): torch's CUDA 12.6 build, which bundles the CUDA runtime, so
#   the host needs only an NVIDIA driver >= 525 (docs/deployment.md has the
#   table) and the NVIDIA container toolkit (docker run --gpus all, or
#   nvidia.com/gpu on Kubernetes). TENSORSERVE_DEVICE=cuda: without CUDA its
#   models are FAILED with the reason, never quietly served on the CPU. With a
#   GPU visible it starts --frontends auto's front ends (the CPUs less one);
#   the CPU variant (DEVICE=cpu) one process. TENSORSERVE_FRONTENDS overrides.
#     docker build -t tensorserve:gpu .
#   CPU: torch's CPU build (no CUDA libraries: a far smaller image).
#     docker build -t tensorserve:cpu --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu --build-arg DEVICE=cpu .
#
#   docker run --stop-timeout 30 -p 8000:8000 -v "$PWD/model_repository:/models:ro" tensorserve:cpu
#
# Every server setting is an environment variable TENSORSERVE_<NAME>
# (docs/configuration.md). On SIGTERM the server drains: readiness turns 503
# for TENSORSERVE_DRAIN_DELAY_S, then queued and running requests get up to
# TENSORSERVE_SHUTDOWN_GRACE_S to finish. The engine's stop timeout (docker
# --stop-timeout, Kubernetes terminationGracePeriodSeconds) must exceed their
# sum, 25 s here; docs and manifests use 30 s.

ARG BASE_IMAGE=python:3.11-slim-bookworm

# ---- build: a virtual environment with torch and tensorserve -------------
FROM ${BASE_IMAGE} AS build

ARG TORCH_VERSION=2.13.0
# PyTorch's CUDA 12.6 index: its builds run on drivers >= 525, which most
# clusters have (PyPI's default build may need a newer one).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH

# torch first, in its own layer: by far the largest, and it changes least.
# (An extra index: the other dependencies still come from PyPI; a local build
# such as torch's "+cpu" sorts above the plain version, so it is preferred.)
RUN python3 -m venv /opt/venv \
    && pip install --extra-index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY tensorserve ./tensorserve
COPY clients/python ./clients/python
# No extras, in both variants: the server's own dependencies (gRPC's included)
# serve every model of model_repository. ONNX models (examples/model_repository)
# need onnxruntime-gpu here, or onnxruntime in the CPU variant.
# DL3013 (pin versions): these are local paths, not registry names; their
# dependency ranges live in pyproject.toml.
# hadolint ignore=DL3013
RUN pip install . ./clients/python

# ---- runtime: the environment and the models, no build tools -------------
FROM ${BASE_IMAGE}

# cuda for the GPU variant; cpu for the CPU one (auto: CUDA if found, else
# the CPU with a warning).
ARG DEVICE=cuda
# NVIDIA_DRIVER_CAPABILITIES "utility" mounts NVML (libnvidia-ml.so.1): the
# server counts the GPUs through it, without CUDA, to decide its front ends.

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    TENSORSERVE_HOST=0.0.0.0 \
    TENSORSERVE_PORT=8000 \
    TENSORSERVE_MODEL_REPOSITORY=/models \
    TENSORSERVE_LOG_FORMAT=json \
    TENSORSERVE_DEVICE=${DEVICE} \
    TENSORSERVE_DRAIN_DELAY_S=5 \
    TENSORSERVE_SHUTDOWN_GRACE_S=20

RUN useradd --create-home --uid 10001 tensorserve

COPY --from=build /opt/venv /opt/venv
# The bundled example models; mount a repository over /models to serve yours.
COPY model_repository /models

USER 10001
WORKDIR /home/tensorserve

EXPOSE 8000
# Ready = every model loaded and warmed up, and not draining.
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
    CMD ["python3", "-c", "import os, sys, urllib.request; url = 'http://127.0.0.1:%s/v2/health/ready' % os.environ.get('TENSORSERVE_PORT', '8000'); sys.exit(0 if urllib.request.urlopen(url, timeout=2).status == 200 else 1)"]

# tensorserve is PID 1 (exec form) and drains on SIGTERM.
STOPSIGNAL SIGTERM
ENTRYPOINT ["tensorserve"]
CMD ["serve"]
