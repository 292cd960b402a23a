"""deploy/ray live: a local Ray instance on 127.0.0.1 runs the Serve app with 2 replicas.

Checks that mixed `pe` / `pe_scaling` traffic spreads over both replicas and answers exactly what a
single pe-serve gives for the same seeds; that killing one replica's actor mid-run loses no
request (the SDK retries what the proxy answers 502, and resumes on a live replica the streams
the proxy ends with a typed `replica_lost` event, each then equal to the same generation asked
again), Serve starts a new replica and later requests succeed; and that everything stops
cleanly. Wall time and peak memory (the test process and all its descendants, Ray's
included) are printed at the end of the module.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import ipaddress
import os
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
import yaml
from pe_client import APIError, APIStreamError, AsyncPEClient
from ray import serve
from ray._private import ray_constants
from ray.serve._private.http_util import validate_http_proxy_callback_return
from ray.serve._private.utils import call_function_from_import_path
from ray.serve.schema import ServeDeploySchema

from deploy.ray.app import REPLICA_HEADER, ReplicaOptions, build_app, replica_settings
from deploy.ray.proxy import CALLBACK_ENV, CALLBACK_PATH, ReplicaLossGuard
from deploy.ray.proxy import ERROR_TYPE as PROXY_ERROR_TYPE
from service.model.config import SCHEMES
from tests.deploy import netns
from tests.live_server import OptionValue, free_port, live_server

pytestmark = pytest.mark.slow

SERVE_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "ray" / "serve-config.yaml"
APP_NAME = "pe-serve"
REPLICAS = 2
CONCURRENT = 32
SETTINGS: dict[str, OptionValue] = {"device": "cpu", "dtype": "float32", "max_context": 512}
# Requests to the schemes with RoPE take these in turn (then none); the other schemes run unscaled.
ROPE_FAMILY = ("rope", "rope_alibi")
SCALINGS: tuple[dict[str, Any] | None, ...] = (
    {"type": "linear", "factor": 4.0},
    {"type": "ntk", "factor": 4.0},
    {"type": "dynamic", "factor": 4.0},
    {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"type": "llama3", "factor": 4.0, "original_max_position_embeddings": 64},
    None,
)
# What a response must agree on across servers (ids and timings differ by nature).
COMPARED = ("model", "text", "tokens", "finish_reason", "usage", "pe")
READY_TIMEOUT_S = 180.0
# The replica-kill run kills once this many streams are under way, so that it cuts some.
STREAMS_AT_THE_KILL = 4
STREAM_TOKENS = 160
_SAMPLE_INTERVAL_S = 0.25


# -- memory of this process tree ------------------------------------------------------------------


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found: set[int] = set()
    pending = [root]
    while pending:
        for child in children.get(pending.pop(), []):
            if child not in found:
                found.add(child)
                pending.append(child)
    return found


def _rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass
class NewProcesses:
    """This process's descendants started after `earlier` was taken: Ray's, and the test's own.

    Servers that other test modules keep for the whole session are descendants too, and are not
    counted.
    """

    earlier: set[int] = field(default_factory=lambda: _descendants(os.getpid()))

    def pids(self) -> set[int]:
        return _descendants(os.getpid()) - self.earlier


@dataclass
class TreeMemory:
    """Samples the resident memory of this process and the new processes; keeps the peak."""

    processes: NewProcesses
    peak_bytes: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self._stop.is_set():
            total = sum(_rss_bytes(pid) for pid in {os.getpid(), *self.processes.pids()})
            self.peak_bytes = max(self.peak_bytes, total)
            self._stop.wait(_SAMPLE_INTERVAL_S)

    def stop(self) -> None:
        self._stop.set()


def report(config: pytest.Config, line: str) -> None:
    """A line in pytest's own output (not captured), so `make test` shows the figures."""
    capture = config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\n{line}", flush=True)


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:[") : -1])
    except OSError:
        pass
    return inodes


def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp's hex form: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(words)
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return mapped or address


def listening_addresses(pids: set[int]) -> set[str]:
    """host:port of every TCP socket in LISTEN state that one of `pids` holds."""
    owned = set().union(*(_socket_inodes(pid) for pid in pids))
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in owned:
                host, port = local.split(":")
                found.add(f"{_address(host)}:{int(port, 16)}")
    return found


# -- the Serve deployment -------------------------------------------------------------------------


@dataclass
class RayApp:
    base_url: str
    model_dirs: list[Path]
    processes: NewProcesses


def serve_config() -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(SERVE_CONFIG.read_text())
    return config


def environment_of(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)


def proxy_pids(processes: NewProcesses) -> list[int]:
    """Serve's HTTP proxy processes (Ray titles an actor's process `ray::<class>`)."""
    pids = []
    for pid in processes.pids():
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::ProxyActor"):
                pids.append(pid)
    return pids


def replica_actors() -> dict[str, Any]:
    """Replica id -> actor handle of the app's live replicas."""
    actors = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if name.startswith("SERVE_REPLICA::") and f"{APP_NAME}#" in name:
            actors[name.rsplit("#", 1)[1]] = ray.get_actor(name, namespace=entry["namespace"])
    return actors


def running_replicas() -> int:
    status = serve.status().applications.get(APP_NAME)
    if status is None:
        return 0
    states = status.deployments[APP_NAME].replica_states
    return sum(count for state, count in states.items() if state == "RUNNING")


def wait_for(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not {what} after {timeout_s:.0f} s")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def ray_app(tiny_checkpoints: dict[str, Path], pytestconfig: pytest.Config) -> Iterator[RayApp]:
    if not netns.available():
        pytest.skip("needs root and iproute2 for a loopback-only network namespace (tests/deploy/netns.py)")
    started = time.monotonic()
    processes = NewProcesses()
    memory = TreeMemory(processes)
    sampler = threading.Thread(target=memory.run, daemon=True)
    sampler.start()
    temp_dir = tempfile.mkdtemp(prefix="ray-")
    with netns.loopback_only(), pytest.MonkeyPatch.context() as patch:
        # The node's address is then the loopback one: the variable for Ray's processes, the
        # constant it read at import for this one.
        patch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        patch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
        patch.setenv("RAY_USAGE_STATS_ENABLED", "0")
        # The proxy callback must come from the config file, not from a variable of this shell.
        patch.delenv(CALLBACK_ENV, raising=False)
        ray.init(
            address="local",
            num_cpus=REPLICAS,
            include_dashboard=False,
            object_store_memory=100 * 1024 * 1024,
            _temp_dir=temp_dir,
            log_to_driver=False,
        )
        try:
            port = free_port()
            # The config file's controller options, which give Serve's proxies the callback that
            # answers a replica's death with a 502 to retry or a typed end of stream.
            serve.start(
                http_options={"host": "127.0.0.1", "port": port},
                controller_options=serve_config()["controller_options"],
            )
            model_dirs = list(tiny_checkpoints.values())
            args = {
                "num_replicas": REPLICAS,
                "model_dir": os.pathsep.join(map(str, model_dirs)),
                **SETTINGS,
            }
            serve.run(build_app(args), name=APP_NAME, route_prefix="/")
            yield RayApp(base_url=f"http://127.0.0.1:{port}", model_dirs=model_dirs, processes=processes)
        finally:
            serve.shutdown()
            ray.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)

    def all_stopped() -> bool:
        """No process of Ray's left: zombies (no resident memory) are not running anything."""
        return not any(_rss_bytes(pid) for pid in processes.pids())

    wait_for(all_stopped, 30.0, "every Ray process stopped")
    memory.stop()
    sampler.join()
    report(
        pytestconfig,
        f"deploy/ray live test: wall {time.monotonic() - started:.1f} s, "
        f"peak memory of the process tree {memory.peak_bytes / 2**30:.2f} GiB",
    )
    assert memory.peak_bytes < 24 * 2**30


def request_body(index: int) -> dict[str, Any]:
    """Request `index` of a mixed workload: every scheme, and every RoPE scaling on the RoPE schemes."""
    scheme = SCHEMES[index % len(SCHEMES)]
    body: dict[str, Any] = {
        "prompt": f"def f{index}(x):\n    return",
        "pe": scheme,
        "max_new_tokens": 12,
        "temperature": 0.8,
        "seed": 1000 + index,
    }
    turn = sum(SCHEMES[earlier % len(SCHEMES)] in ROPE_FAMILY for earlier in range(index))
    scaling = SCALINGS[turn % len(SCALINGS)]
    if scheme in ROPE_FAMILY and scaling is not None:
        body["pe_scaling"] = scaling
    return body


@dataclass
class Outcome:
    status: int | None
    body: dict[str, Any] | None
    replica: str | None


async def _send(client: httpx.AsyncClient, body: Mapping[str, Any]) -> Outcome:
    try:
        response = await client.post("/generate", json=body)
    except httpx.TransportError:
        return Outcome(status=None, body=None, replica=None)
    payload = response.json() if response.status_code == 200 else None
    return Outcome(status=response.status_code, body=payload, replica=response.headers.get(REPLICA_HEADER))


def send_all(base_url: str, bodies: list[dict[str, Any]], concurrency: int) -> list[Outcome]:
    async def run() -> list[Outcome]:
        gate = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(base_url=base_url, timeout=120.0) as client:

            async def one(body: dict[str, Any]) -> Outcome:
                async with gate:
                    return await _send(client, body)

            return await asyncio.gather(*(one(body) for body in bodies))

    return asyncio.run(run())


def compared(body: Mapping[str, Any]) -> dict[str, Any]:
    return {key: body[key] for key in COMPARED}


# -- the live checks ------------------------------------------------------------------------------


def test_ray_listens_only_where_nothing_but_loopback_reaches(ray_app: RayApp) -> None:
    """Serve's proxy on 127.0.0.1; the rest in a namespace whose only interface is `lo`."""
    assert netns.interfaces() == {"lo"}
    listening = listening_addresses(ray_app.processes.pids())
    assert f"127.0.0.1:{ray_app.base_url.rsplit(':', 1)[1]}" in listening


def test_the_proxy_gets_its_callback_from_the_config_file(ray_app: RayApp) -> None:
    """Not from this process's environment: the config's controller options reach the proxy."""
    assert CALLBACK_ENV not in os.environ
    pids = proxy_pids(ray_app.processes)
    assert pids, "no Serve proxy process found"
    assert all(environment_of(pid).get(CALLBACK_ENV) == CALLBACK_PATH for pid in pids)


def test_mixed_traffic_spreads_over_both_replicas_and_equals_a_single_server(
    ray_app: RayApp, pytestconfig: pytest.Config
) -> None:
    bodies = [request_body(index) for index in range(CONCURRENT)]
    assert {body["pe"] for body in bodies} == set(SCHEMES)
    assert {body["pe_scaling"]["type"] for body in bodies if "pe_scaling" in body} == {
        "linear",
        "ntk",
        "dynamic",
        "yarn",
        "llama3",
    }
    outcomes = send_all(ray_app.base_url, bodies, concurrency=CONCURRENT)
    assert [outcome.status for outcome in outcomes] == [200] * CONCURRENT
    served = Counter(outcome.replica for outcome in outcomes)
    assert len(served) == REPLICAS and None not in served, served
    with live_server(ray_app.model_dirs, options=SETTINGS, env={"OMP_NUM_THREADS": "1"}) as single:
        reference = send_all(single.base_url, bodies, concurrency=8)
    assert [outcome.status for outcome in reference] == [200] * CONCURRENT
    for outcome, expected in zip(outcomes, reference, strict=True):
        assert outcome.body is not None and expected.body is not None
        assert compared(outcome.body) == compared(expected.body)
    report(
        pytestconfig,
        f"deploy/ray mixed traffic: {CONCURRENT}/{CONCURRENT} succeeded, by replica {dict(served)}, "
        "each equal to a single server's answer",
    )


class Fate(enum.Enum):
    """How one request of the replica-kill run ended, as the SDK's caller sees it."""

    ANSWERED = "answered"
    RESUMED = "stream cut and resumed, answered"
    CUT_WITH_TYPED_ERROR = "stream cut, typed error event"
    LOST = "lost"


@dataclass
class SdkOutcome:
    fate: Fate
    tokens: list[int] | None = None  # what the caller received
    error: str | None = None


@dataclass
class StreamsInFlight:
    """Streams between their first event and their end; `enough` is set once `wanted` are."""

    wanted: int
    count: int = 0
    enough: threading.Event = field(default_factory=threading.Event)

    def started(self) -> None:
        self.count += 1
        if self.count >= self.wanted:
            self.enough.set()

    def ended(self) -> None:
        self.count -= 1


def sdk_outcomes(
    base_url: str,
    bodies: list[dict[str, Any]],
    streamed: set[int],
    concurrency: int,
    attempts: Counter[int],
    in_flight: StreamsInFlight,
) -> list[SdkOutcome]:
    """Each body sent through the SDK (its default retries and resumes), the ones in `streamed` as
    streams; `attempts` counts the statuses of every attempt, retries and resumes included."""

    async def run() -> list[SdkOutcome]:
        gate = asyncio.Semaphore(concurrency)

        async def count(response: httpx.Response) -> None:
            attempts[response.status_code] += 1

        http = httpx.AsyncClient(event_hooks={"response": [count]})
        async with http, AsyncPEClient(base_url, timeout=120.0, http_client=http) as client:

            async def one(index: int) -> SdkOutcome:
                async with gate:
                    try:
                        if index not in streamed:
                            return SdkOutcome(Fate.ANSWERED, (await client.generate(**bodies[index])).tokens)
                        async with client.generate_stream(**bodies[index]) as stream:
                            async for _ in stream:
                                if len(stream.tokens) == 1:
                                    in_flight.started()
                        in_flight.ended()
                        return SdkOutcome(Fate.RESUMED if stream.resumes else Fate.ANSWERED, stream.tokens)
                    except APIStreamError as error:
                        cut = error.type == PROXY_ERROR_TYPE
                        return SdkOutcome(Fate.CUT_WITH_TYPED_ERROR if cut else Fate.LOST, error=repr(error))
                    except APIError as error:
                        return SdkOutcome(Fate.LOST, error=repr(error))

            return await asyncio.gather(*(one(index) for index in range(len(bodies))))

    return asyncio.run(run())


def kill_run_body(index: int, *, streamed: bool) -> dict[str, Any]:
    """Request `index` of the replica-kill run: 32 new tokens, or `STREAM_TOKENS` for a stream, so
    that streams are under way when the kill comes (the learned table is stretched to hold them)."""
    body = request_body(index) | {"max_new_tokens": STREAM_TOKENS if streamed else 32}
    if streamed and body["pe"] == "learned":
        body["pe_scaling"] = {"type": "linear", "factor": 4.0}
    return body


def test_a_killed_replica_loses_no_request_streams_included_and_is_replaced(
    ray_app: RayApp, pytestconfig: pytest.Config
) -> None:
    """96 requests through the SDK, one in four streamed (longer), one replica killed while streams
    run.

    None is lost. A request that had not started streaming is answered, by retry if need be:
    Serve's proxy answers 502 for it (`deploy/ray/proxy.py`) and the SDK sends it again under the
    same request id. A stream the dead replica was writing gets a typed `replica_lost` event from
    the proxy, and the SDK resumes it on a live replica from the tokens it had (`resume_from`):
    its caller reads one stream, the same tokens as the generation asked for again afterwards
    (the bodies are seeded).
    """
    before = replica_actors()
    assert len(before) == REPLICAS
    victim_id, victim = next(iter(before.items()))
    streamed = set(range(0, 96, 4))
    bodies = [kill_run_body(index, streamed=index in streamed) for index in range(96)]
    killed = threading.Event()
    in_flight = StreamsInFlight(wanted=STREAMS_AT_THE_KILL)
    killed_at: list[float] = []

    def kill_once_traffic_flows() -> None:
        in_flight.enough.wait(timeout=60.0)
        ray.kill(victim, no_restart=True)
        killed_at.append(time.monotonic())
        killed.set()

    killer = threading.Thread(target=kill_once_traffic_flows)
    killer.start()
    attempts: Counter[int] = Counter()
    outcomes = sdk_outcomes(ray_app.base_url, bodies, streamed, 8, attempts, in_flight)
    killer.join()
    assert killed.is_set()
    plain = Counter(outcome.fate for index, outcome in enumerate(outcomes) if index not in streamed)
    streams = Counter(outcome.fate for index, outcome in enumerate(outcomes) if index in streamed)
    assert plain == {Fate.ANSWERED: len(bodies) - len(streamed)}, plain
    assert set(streams) <= {Fate.ANSWERED, Fate.RESUMED}, [outcome.error for outcome in outcomes]

    def replaced() -> bool:
        current = replica_actors()
        return victim_id not in current and len(current) == REPLICAS and running_replicas() == REPLICAS

    wait_for(replaced, READY_TIMEOUT_S, "a replacement replica running")
    replaced_after_s = time.monotonic() - killed_at[0]
    newcomer = (set(replica_actors()) - set(before)).pop()
    after = send_all(ray_app.base_url, [request_body(index) for index in range(CONCURRENT)], CONCURRENT)
    assert [outcome.status for outcome in after] == [200] * CONCURRENT
    served_after = Counter(outcome.replica for outcome in after)
    assert newcomer in served_after, served_after
    again = send_all(ray_app.base_url, [bodies[index] for index in sorted(streamed)], CONCURRENT)
    for index, answer in zip(sorted(streamed), again, strict=True):
        assert answer.body is not None and outcomes[index].tokens == answer.body["tokens"], index
    report(
        pytestconfig,
        f"deploy/ray replica kill: {len(bodies) - len(streamed)} plain requests: "
        f"{plain[Fate.ANSWERED]} answered, {plain[Fate.LOST]} lost; {len(streamed)} streams: "
        f"{streams[Fate.ANSWERED] + streams[Fate.RESUMED]} answered ({streams[Fate.RESUMED]} of them "
        f"resumed after a cut, each equal to the generation asked again), "
        f"{streams[Fate.CUT_WITH_TYPED_ERROR]} cut with a typed error, "
        f"{streams[Fate.LOST]} lost; attempts by status {dict(attempts)}; "
        f"after the restart {CONCURRENT}/{CONCURRENT} succeeded, "
        f"by replica {dict(served_after)}; replacement running {replaced_after_s:.1f} s after the kill",
    )


# -- options and the config file (no cluster needed) ----------------------------------------------


def test_replica_options_map_onto_serve_deployment_options() -> None:
    settings = replica_settings({"max_batch_size": 8, "max_queue": 24, "drain_timeout_s": 12})
    assert settings.engine_mode == "thread"
    fixed = ReplicaOptions(num_replicas=3, num_gpus=0.5).deployment_options(settings)
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 0.5}
    assert fixed["max_ongoing_requests"] == 32
    assert fixed["graceful_shutdown_timeout_s"] == 12
    assert fixed["health_check_period_s"] < fixed["health_check_timeout_s"]
    scaled = ReplicaOptions(min_replicas=1, max_replicas=4).deployment_options(settings)
    assert scaled["autoscaling_config"]["max_replicas"] == 4 and "num_replicas" not in scaled
    with pytest.raises(ValueError):
        ReplicaOptions(min_replicas=5, max_replicas=2)


def test_a_misspelt_setting_fails_on_the_driver() -> None:
    with pytest.raises(ValueError, match="max_batch"):
        build_app({"max_batch": 8})


def test_the_serve_config_file_is_valid_and_its_args_build() -> None:
    schema = ServeDeploySchema.model_validate(serve_config())
    (application,) = schema.applications
    assert application.import_path == "deploy.ray.app:build_app"
    build_app(application.args)


def test_the_serve_config_file_starts_the_proxies_with_the_replica_loss_callback() -> None:
    """Set by default, where Serve's proxies inherit it (the controller's runtime_env), and loadable."""
    schema = ServeDeploySchema.model_validate(serve_config())
    assert schema.controller_options is not None and schema.controller_options.runtime_env is not None
    assert schema.controller_options.runtime_env["env_vars"][CALLBACK_ENV] == CALLBACK_PATH
    middlewares = validate_http_proxy_callback_return(call_function_from_import_path(CALLBACK_PATH))
    assert [middleware.cls for middleware in middlewares] == [ReplicaLossGuard]
