# The reducer image: `reduction-server serve`, which reads its place from CLUSTER_SPEC (task
# type workerpool2) or TF_CONFIG (task type ps), or from RS_REDUCER_INDEX + RS_REDUCERS.
# See docs/deployment.md.
#
#   docker build -t reduction-server .
#   docker build --build-arg BASE_IMAGE=python:3.11-slim-bookworm -t reduction-server .
#
# BASE_IMAGE must be Debian-based (apt-get) with python3 and its venv module: the official
# python:*-slim images are. Both stages use it, so the virtual environment built in the first
# one runs on the same interpreter in the second.
ARG BASE_IMAGE=python:3.12-slim-bookworm

# ---------------------------------------------------------------------------------------------
# Stage 1: compile the Cython extension and install the package into /opt/venv.
FROM ${BASE_IMAGE} AS build

# What the compiler needs; python3-dev only where the base's Python is Debian's own (the
# official python images ship their headers). Override to add anything else.
ARG BUILD_PACKAGES="gcc libc6-dev"
# Optional: a CA bundle inside the build context for pip (PIP_CERT=/src/<file>) where HTTPS
# goes through an intercepting proxy. Unset by default.
ARG PIP_CERT
ARG PIP_INDEX_URL

# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ${BUILD_PACKAGES} \
    && rm -rf /var/lib/apt/lists/*

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python3 -m venv /opt/venv

WORKDIR /src
COPY . /src
# A regular (non-editable) install: the build requirements (Cython, numpy, setuptools) live
# only in pip's isolated build environment and never reach /opt/venv.
# hadolint ignore=DL3013
RUN /opt/venv/bin/pip install --upgrade pip \
    && /opt/venv/bin/pip install /src \
    && /opt/venv/bin/python -I -c "import reduction_server._native, reduction_server.cli" \
    && find /opt/venv -depth \( -name '__pycache__' -o -name 'tests' \) \
         -path '*/site-packages/*' -exec rm -rf {} + \
    && rm -rf /opt/venv/lib/python3*/site-packages/pip /opt/venv/lib/python3*/site-packages/pip-* \
              /opt/venv/bin/pip /opt/venv/bin/pip3*

# ---------------------------------------------------------------------------------------------
# Stage 2: only what runs: the base's Python and the virtual environment, as a non-root user.
FROM ${BASE_IMAGE} AS runtime

LABEL org.opencontainers.image.title="reduction-server" \
      org.opencontainers.image.description="A reducer of the open-source Reduction Server (reduction-server serve)" \
      org.opencontainers.image.licenses="Apache-2.0"

RUN groupadd --system --gid 10001 reducer \
    && useradd --system --uid 10001 --gid reducer --no-create-home --home-dir /nonexistent \
         --shell /usr/sbin/nologin reducer

COPY --from=build /opt/venv /opt/venv

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    RS_LOG_LEVEL=INFO

USER 10001:10001
WORKDIR /tmp

# Vertex AI's reducer pool listens on the port in CLUSTER_SPEC (2222 there), and metrics are
# served where RS_METRICS_PORT (or --metrics-port) says (9100 in examples/k8s); documented only.
EXPOSE 2222 9100

# Healthy while the reducer accepts TCP connections on its port: the port `serve` found (its
# discovered place, or its own entry in RS_REDUCERS), or RS_HEALTHCHECK_PORT when the port was
# given on the command line.
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python3", "-c", "import os, socket; from reduction_server.reducer.options import listening_address as a; h, p = a(); p = os.environ.get('RS_HEALTHCHECK_PORT') or p; h = '127.0.0.1' if h in ('0.0.0.0', '*') else ('::1' if h == '::' else h); socket.create_connection((h, int(p)), 3).close()"]

# SIGTERM (docker stop, Kubernetes, Vertex AI) stops the reducer cleanly: `serve` handles it.
ENTRYPOINT ["reduction-server", "serve"]
CMD []
