# tensorserve GPU image: CUDA-enabled torch from PyPI (its wheels bundle the
# CUDA runtime; the host needs only the NVIDIA driver + container toolkit).
# Build:  docker build -t tensorserve .
# Run:    docker run --gpus all -p 8000:8000 -v $PWD/model_repository:/models tensorserve
FROM python:3.11-slim-bookworm

ARG TORCH_VERSION=2.13.0

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TENSORSERVE_HOST=0.0.0.0 \
    TENSORSERVE_PORT=8000 \
    TENSORSERVE_MODEL_REPOSITORY=/models

# torch first, in its own layer: it is by far the largest and changes least.
RUN pip install "torch==${TORCH_VERSION}"

WORKDIR /opt/tensorserve
COPY pyproject.toml README.md ./
COPY tensorserve ./tensorserve
COPY clients/python ./clients/python
# Local paths, not registry names: their dependency ranges live in pyproject.toml.
# hadolint ignore=DL3013
RUN pip install . ./clients/python

COPY model_repository /models

RUN useradd --create-home --uid 10001 tensorserve
USER 10001

EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/v2/health/ready', timeout=2).status == 200 else 1)"]

# exec form: tensorserve is PID 1 and gets SIGTERM, so queued requests drain on stop.
CMD ["tensorserve", "serve"]
