# edge-infer export image: ExecuTorch (XNNPACK lowering, the Qualcomm quantizer) and qai-hub.
#   docker build -f docker/export.Dockerfile -t edge-infer-export .
#   docker run -v "$PWD/out:/out" edge-infer-export export smollm2-135m --target xnnpack-8da4w --out /out
# QNN lowering needs Qualcomm's SDK (not redistributable): mount it and set QNN_SDK_ROOT.
# AI Hub jobs read qai-hub's own config: mount ~/.qai_hub read-only at /home/edge/.qai_hub.

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
    UV_LINK_MODE=copy
COPY docker/ca/ /usr/local/share/ca-certificates/build/
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && update-ca-certificates \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/uv && /opt/uv/bin/pip install --no-cache-dir "uv==${UV_VERSION}"
WORKDIR /src
COPY pyproject.toml uv.lock ./
COPY wheels/ wheels/
# the CPU torch wheel is checked against its pinned sha256 before uv installs it
COPY tools/torch_wheel.sha256 tools/
COPY packages/engine/pyproject.toml packages/engine/
COPY packages/harness/pyproject.toml packages/harness/
COPY packages/export/pyproject.toml packages/export/
RUN sha256sum --check --strict tools/torch_wheel.sha256 \
 && /opt/uv/bin/uv sync --frozen --no-dev --no-cache --no-install-workspace \
        --package edge-infer-export
COPY packages/engine/ packages/engine/
COPY packages/export/ packages/export/
# Our packages go to /opt/app, not into the venv: the venv (2 GB) and the final stage's copy of
# it then stay cached across code changes, so a rebuild writes megabytes, not gigabytes (a CI
# build once ran out of disk committing that copy). The final stage puts /opt/app on sys.path.
RUN /opt/uv/bin/uv pip install --no-cache --no-deps --python /opt/venv/bin/python \
        --target /opt/app ./packages/engine ./packages/export

FROM ${BASE_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 edge \
 && install -d -o edge -g edge /out
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/app /opt/app
RUN echo /opt/app > /opt/venv/lib/python3.11/site-packages/edge-infer-app.pth
ENV PATH=/opt/app/bin:/opt/venv/bin:$PATH \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    PYTHONUNBUFFERED=1
USER edge
WORKDIR /home/edge
HEALTHCHECK --interval=60s --timeout=20s CMD ["edge-infer", "export", "--help"]
ENTRYPOINT ["edge-infer"]
CMD ["export", "--help"]
