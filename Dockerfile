# rtvideo server image.
#   CPU:  docker build --build-arg VARIANT=cpu -t rtvideo:cpu .
#   GPU:  docker build --build-arg VARIANT=cuda -t rtvideo:cuda .
# The model directory is a volume (mount it and set RTVIDEO_MODEL=/models/...);
# /v1/videos jobs live in the volume /data (RTVIDEO_DATA_DIR): mount one there for
# finished jobs and their videos to outlast the container;
# nothing but the 6 MB demo model (the default) is baked in, and nothing is downloaded at start. Give `docker stop` more
# time than RTVIDEO_SHUTDOWN_GRACE_S (e.g. --stop-timeout 45): SIGTERM drains.
ARG VARIANT=cpu

FROM python:3.11-slim-bookworm AS base-cpu
# Installs requirements-cpu.lock, which pins torch==2.13.0+cpu by its hash: pass
# --build-arg PIP_EXTRA_INDEX_URL=<an index serving torch's CPU builds>.
ARG PIP_EXTRA_INDEX_URL=""
ENV PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL} \
    RTVIDEO_LOCK=cpu

FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 AS base-cuda
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv python3-dev make \
 && rm -rf /var/lib/apt/lists/*
# The build has no driver to detect: name the lock. requirements-cuda.lock pins
# torch 2.13.0's default build, which brings its own CUDA 13 libraries (the host
# needs a driver that supports CUDA 13).
ENV RTVIDEO_LOCK=cuda

FROM base-${VARIANT}
RUN (command -v make >/dev/null || (apt-get update && apt-get install -y --no-install-recommends make && rm -rf /var/lib/apt/lists/*)) \
 && useradd --create-home --uid 10001 rtvideo
WORKDIR /app
COPY pyproject.toml README.md Makefile ./
COPY scripts ./scripts
COPY requirements-cpu.lock requirements-cuda.lock ./
COPY rtvideo ./rtvideo
RUN make install && chown -R rtvideo:rtvideo /app \
 && mkdir /data && chown rtvideo:rtvideo /data
USER rtvideo
ENV RTVIDEO_HOST=0.0.0.0 \
    RTVIDEO_PORT=8000 \
    RTVIDEO_SHUTDOWN_GRACE_S=30 \
    RTVIDEO_DATA_DIR=/data \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1
EXPOSE 8000
VOLUME ["/models", "/data"]
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
  CMD ["/app/.venv/bin/python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)"]
# What the README's `make serve` runs, called directly (exec form) so SIGTERM
# reaches rtvideo itself rather than make.
ENTRYPOINT ["/app/.venv/bin/rtvideo", "serve"]
