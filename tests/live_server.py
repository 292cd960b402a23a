"""A real `pe-serve` process on a free loopback port, for tests that talk HTTP to it.

Used by the service's own tests and by the SDK's live tests, so its interface is kept stable:

    from tests.live_server import live_server

    with live_server([checkpoint_dir], options={"max_queue": 4, "api_key": "secret"}) as server:
        httpx.get(server.url("/models"), headers={"Authorization": "Bearer secret"})

`live_server(model_dirs, options=...)` runs `python -m service --host 127.0.0.1 --port <free>
--model-dir ... --<option> <value> ...` (option names are the CLI's flags with `_` for `-`;
`True` passes a bare flag, e.g. `{"no_warmup": True}`; a list repeats the flag), waits until
`/readyz` answers 200, yields a `LiveServer`, and stops the process on exit (SIGTERM, then SIGKILL
if it does not exit in time). An empty `model_dirs` serves the bundled zoo. The server's log (JSON
lines) goes to a file, read with `server.logs()`; it is included in the error when the server fails
to start.
The gRPC API listens on another free port, `server.grpc_target` ("127.0.0.1:<port>"), unless
the options set `grpc_port` themselves (0: none, and `grpc_target` is None).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
_POLL_INTERVAL_S = 0.1
_PORT_ATTEMPTS = 3

OptionValue = str | int | float | bool | list[str]


def free_port() -> int:
    """A port the OS just handed out on 127.0.0.1 (free now; a tiny race remains until the bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def cli_args(model_dirs: Sequence[Path | str], options: Mapping[str, OptionValue]) -> list[str]:
    """`--model-dir A B --max-queue 4 --no-warmup` from `[A, B]` and `{"max_queue": 4, "no_warmup": True}`;
    a list repeats its flag (`{"alias": ["a=M", "b=M"]}`: `--alias a=M --alias b=M`)."""
    args = ["--model-dir", *map(str, model_dirs)] if model_dirs else []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, list):
            args.extend(part for item in value for part in (flag, item))
        elif value is True:
            args.append(flag)
        elif value is not False:
            args.extend([flag, str(value)])
    return args


@dataclass
class LiveServer:
    """A running server process and how to reach it."""

    process: subprocess.Popen[bytes]
    base_url: str
    log_path: Path
    grpc_target: str | None = None

    def url(self, path: str) -> str:
        return self.base_url + path

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def engine_pid(self) -> int:
        """The engine process: the server's child started by multiprocessing's spawn (its resource
        tracker is another child)."""
        tasks = Path(f"/proc/{self.process.pid}/task")
        children = {int(pid) for task in tasks.iterdir() for pid in (task / "children").read_text().split()}
        engines = [pid for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        if len(engines) != 1:
            raise RuntimeError(f"expected one engine process among the server's children {children}")
        return engines[0]

    def send_signal(self, sig: int = signal.SIGTERM) -> None:
        self.process.send_signal(sig)

    def wait(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """Exit status once the process has ended (negative: killed by that signal)."""
        return self.process.wait(timeout=timeout)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM (a graceful drain), then SIGKILL if it is still running after `timeout`."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()


class PortTakenError(RuntimeError):
    """Another process bound the port between `free_port()` and the server's own bind."""


def _wait_until_ready(server: LiveServer, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                logs = server.logs()
                failure = PortTakenError if "address already in use" in logs else RuntimeError
                raise failure(f"pe-serve exited with {server.process.returncode}:\n{logs}")
            with contextlib.suppress(httpx.TransportError):
                if client.get(server.url("/readyz")).status_code == 200:
                    return
            time.sleep(_POLL_INTERVAL_S)
    raise TimeoutError(f"pe-serve not ready after {timeout:.0f} s:\n{server.logs()}")


def _launch(arguments: Sequence[str], env: Mapping[str, str] | None, launcher: Sequence[str]) -> LiveServer:
    port = free_port()
    server = [sys.executable, "-m", "service", "--host", "127.0.0.1", "--port", str(port), *arguments]
    grpc_port = _grpc_port(arguments)
    if "--grpc-port" not in arguments:
        server += ["--grpc-port", str(grpc_port)]
    command = [*launcher, *server]
    log_file = tempfile.NamedTemporaryFile(prefix="pe-serve-", suffix=".log", delete=False)  # noqa: SIM115
    environment = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    process = subprocess.Popen(
        command, cwd=REPO_ROOT, env=environment, stdout=log_file, stderr=subprocess.STDOUT
    )
    log_file.close()
    grpc_target = f"127.0.0.1:{grpc_port}" if grpc_port else None
    return LiveServer(
        process=process,
        base_url=f"http://127.0.0.1:{port}",
        log_path=Path(log_file.name),
        grpc_target=grpc_target,
    )


def _grpc_port(arguments: Sequence[str]) -> int:
    """The port the arguments name for gRPC, else a fresh free one."""
    if "--grpc-port" in arguments:
        return int(arguments[arguments.index("--grpc-port") + 1])
    return free_port()


def launch_server(
    model_dirs: Sequence[Path | str] = (),
    *,
    options: Mapping[str, OptionValue] | None = None,
    env: Mapping[str, str] | None = None,
) -> LiveServer:
    """Start a server without waiting for it (to watch it load); the caller stops it."""
    return _launch(cli_args(model_dirs, options or {}), env, ())


def start_server(
    model_dirs: Sequence[Path | str] = (),
    *,
    options: Mapping[str, OptionValue] | None = None,
    env: Mapping[str, str] | None = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
    launcher: Sequence[str] = (),
) -> LiveServer:
    """Start a server and wait until it is ready; the caller stops it (prefer `live_server`).

    `launcher` is a command the server's command line is appended to (a sandbox, say), e.g.
    `["unshare", "--mount", "sh", "-c", 'mount ...; exec "$@"', "sh"]`.

    A port taken by someone else in the instant between choosing and binding it is retried on
    another port, a few times, since tests of several packages may start servers at once.
    """
    arguments = cli_args(model_dirs, options or {})
    for _ in range(_PORT_ATTEMPTS - 1):
        with contextlib.suppress(PortTakenError):
            return _start_once(arguments, env, ready_timeout_s, launcher)
    return _start_once(arguments, env, ready_timeout_s, launcher)


def _start_once(
    arguments: Sequence[str], env: Mapping[str, str] | None, ready_timeout_s: float, launcher: Sequence[str]
) -> LiveServer:
    server = _launch(arguments, env, launcher)
    try:
        _wait_until_ready(server, ready_timeout_s)
    except BaseException:
        server.stop(timeout=5.0)
        raise
    return server


@contextlib.contextmanager
def live_server(
    model_dirs: Sequence[Path | str] = (),
    *,
    options: Mapping[str, OptionValue] | None = None,
    env: Mapping[str, str] | None = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
    launcher: Sequence[str] = (),
) -> Iterator[LiveServer]:
    """A ready server for the duration of the block; stopped (and its log file removed) afterwards."""
    server = start_server(
        model_dirs, options=options, env=env, ready_timeout_s=ready_timeout_s, launcher=launcher
    )
    try:
        yield server
    finally:
        server.stop()
        server.log_path.unlink(missing_ok=True)
