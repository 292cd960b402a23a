# syntax=docker/dockerfile:1
#
# pe-serve with its bundled zoo.
#   GPU hosts (default base, torch comes with it):  docker build -t pe-serve .
#   CPU hosts:  docker build --build-arg BASE_IMAGE=python:3.11-slim -t pe-serve:cpu .
# torch from a local wheel (air-gapped, or to avoid PyPI's multi-GB CUDA build on a CPU image):
# put the wheel in the wheelhouse directory of the build context (build arg WHEELHOUSE, default
# `.whl/`); pip takes torch from it and looks there first for the other wheels too. Any
# pytorch/pytorch *-runtime tag with Python >= 3.11 works as the GPU base.

ARG BASE_IMAGE=pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime

FROM ${BASE_IMAGE} AS builder
ARG WHEELHOUSE=.whl
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
# --system-site-packages: on the PyTorch base the image's own CUDA torch satisfies the dependency.
RUN python3 -m venv --system-site-packages /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app

# Dependencies first, in their own layer, so editing the source does not reinstall them.
# The glob keeps the COPY valid when the build context has no wheelhouse. Versions are pyproject's.
COPY pyproject.toml ${WHEELHOUSE}* /tmp/wheelhouse/
# A torch wheel named on the command line is the torch pip installs: no other build is fetched.
# hadolint ignore=DL3013
RUN --mount=type=cache,target=/root/.cache/pip \
    set -eu; \
    python3 -c "import tomllib; print('\n'.join(tomllib.load(open('/tmp/wheelhouse/pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt; \
    torch_wheel="$(find /tmp/wheelhouse -maxdepth 1 -name 'torch-*.whl' | head -n 1)"; \
    pip install --find-links /tmp/wheelhouse -r /tmp/requirements.txt ${torch_wheel:+"$torch_wheel"}

# An editable install keeps the packages beside models/ under /app, where the bundled zoo is found.
COPY README.md pyproject.toml ./
COPY pe_runtime ./pe_runtime
COPY service ./service
COPY training ./training
COPY bench ./bench
RUN pip install --no-cache-dir --no-deps --find-links /tmp/wheelhouse -e . \
    && python3 -m compileall -q /app/pe_runtime /app/service
# World-readable: checkpoints written locally may be 0600, unreadable by the runtime user.
COPY models ./models
RUN chmod -R a+rX,go-w /app

FROM ${BASE_IMAGE} AS runtime
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PE_SERVE_HOST=0.0.0.0 \
    PE_SERVE_PORT=8000 \
    PE_SERVE_GRPC_PORT=50051
# A C compiler: with `--compile` the decode step builds its C kernels at start-up on a CPU
# (service/model/kernels/build.py, about a second), and torch.compile's inductor (C++ on a CPU) and
# Triton (on a GPU) build their code with one too. Without it the fast step is not available.
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc g++ libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 pe \
    && useradd --system --uid 10001 --gid pe --home-dir /app --shell /usr/sbin/nologin pe
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder /app /app
WORKDIR /app
USER 10001:10001
EXPOSE 8000 50051
# Ready (200) only once the models are loaded and warm; 503 while loading or draining. The probe
# reads the server's PE_SERVE_* variables: HTTPS when PE_SERVE_TLS_CERT is set, a client
# certificate (PE_SERVE_HEALTHCHECK_CERT/KEY) when PE_SERVE_TLS_CLIENT_CA is (service/healthcheck.py).
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python3", "-m", "service.healthcheck"]
STOPSIGNAL SIGTERM
CMD ["pe-serve"]
