# A package's image plus what its tests need, never shipped: `nox -s tests-in-image` builds it
# on top of an image built by `nox -s images` and runs that package's tests in it, against the
# code installed in the image (the repository is mounted read-only for the tests alone).
#   docker build -f docker/test.Dockerfile --build-arg IMAGE=edge-infer -t edge-infer-test .
# The test tools come from uv.lock's dev group, installed by the uv of the image's build stage
# (tagged IMAGE-build by `nox -s images`); a compiler is added because the tests build the
# kernels (and llama.cpp's tools) into private folders.

ARG IMAGE=edge-infer

FROM ${IMAGE}-build AS tools
RUN /opt/uv/bin/uv export --frozen --only-group dev --no-emit-project -o /tmp/dev.txt

FROM ${IMAGE}
ENV DEBIAN_FRONTEND=noninteractive \
    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    PYTHONDONTWRITEBYTECODE=1
USER root
COPY docker/ca/ /usr/local/share/ca-certificates/build/
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates g++ python3-dev cmake make \
 && update-ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=tools /opt/uv /opt/uv
COPY --from=tools /tmp/dev.txt /tmp/dev.txt
# uv export writes every sha256 uv.lock holds: nothing installs without one
RUN /opt/uv/bin/uv pip install --no-cache --require-hashes --python /opt/venv/bin/python \
        -r /tmp/dev.txt
USER edge
WORKDIR /repo
ENTRYPOINT ["/opt/venv/bin/python", "-m", "pytest", "-p", "no:cacheprovider"]
