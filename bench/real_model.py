"""SmolLM2-135M-Instruct served by pe-serve against what a CPU user would otherwise run.

Every side is a real server on a loopback port in its own default configuration, on the same
machine, driven by the same OpenAI `/v1/completions` requests (token ids, greedy, `ignore_eos`):

- pe-serve started with its default flags (plus `--weights` for the packed formats);
- llama.cpp's `llama-server` (built by `scripts/build_llama_server.sh`) with every core
  (`-t`), 16 slots (`-np 16`) and its prompt cache (on by default), on the F32 GGUF for equal
  numerics and on the Q4_1 file users run;
- transformers `generate()` with its default threads, on the same weights (loaded from the GGUF).

Workloads: 1 client (requests one after another) and 16 concurrent clients, each request 32
prompt tokens and 64 new ones; a 3,298-token English prompt (`pydoc_data.topics`, what every
Python has) with 16 new tokens, the first time and the same prompt again (the prompt cache).
The sides take turns within every repeat, and ratios are medians of per-repeat ratios, so drifting
load hits both sides alike. During a side's turn the other servers are paused (SIGSTOP to their
process groups; SIGCONT for their own turn), so that each has the machine to itself, as a user's
one server does, and keeps its caches between turns: idle, two llama-servers cost a pe-serve
server 8% of its 16-client rate in a probe (398 tok/s against 430-434 with only pe-serve servers
beside it). Each pe-serve server's CPU time is split between its API process and its engine
process over the 16-client run.

    python -m bench.real_model [--repeats 3] [--output bench/results/real_model.md] [--quick]

`make bench-real` builds llama-server if needed and runs this. `--quick` shrinks every size to
smoke-test the script; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench.real_checkpoints import english_text
from bench.serving import code_revision, free_port, http_client, log_tail
from bench.throughput import scaling_specs

REPO_ROOT = Path(__file__).resolve().parents[1]
LLAMA_SERVER = Path.home() / ".cache/pe-serve/llama-cpp/bin/llama-server"
F32_CACHE = Path.home() / ".cache/pe-serve/models/SmolLM2-135M-Instruct.F32.gguf"
READY_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 1800.0
SLOTS = 16
SLOT_CONTEXT = 4096  # pe-serve's default --max-context, and each llama-server slot's
# One of every type (none, linear, ntk, dynamic, yarn, llama3), each extending SmolLM2's 8,192
# native positions 4x.
MIXED_SCALINGS = scaling_specs(8192)


@dataclass(frozen=True)
class Sizes:
    short_prompt: int = 32
    new_tokens: int = 64
    clients: int = 16
    sequential: int = 2  # requests the single client sends one after another
    long_prompt: int = 3298
    long_new_tokens: int = 16

    @classmethod
    def quick(cls) -> Sizes:
        return cls(short_prompt=8, new_tokens=8, clients=4, sequential=1, long_prompt=300, long_new_tokens=4)


# -- the weights ---------------------------------------------------------------------------------


def smollm2_q4_1() -> Path:
    from service.model.bundled import bundled_model

    return bundled_model("smollm2")


def f32_gguf(source: Path, target: Path = F32_CACHE) -> Path:
    """`source` with every tensor dequantized to float32 (metadata kept), written once and cached.

    llama-server reads GGUF only, so equal numerics need the same weights as an F32 file.
    """
    if target.is_file():
        return target
    import gguf

    reader = gguf.GGUFReader(str(source))
    architecture = str(reader.fields["general.architecture"].contents())
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(partial), architecture)
    for name, entry in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = entry.contents()
        if name == "general.file_type":
            value = int(gguf.LlamaFileType.ALL_F32)
        sub_type = entry.types[1] if len(entry.types) > 1 else None
        writer.add_key_value(name, value, entry.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, gguf.quants.dequantize(tensor.data, tensor.tensor_type))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(target)
    return target


def english_tokens(q4_1: Path) -> list[int]:
    """`pydoc_data.topics` through SmolLM2's own tokenizer (the GGUF's)."""
    from service.model.gguf_file import read_gguf
    from service.tokenizers import HFTokenizer

    tokenizer = HFTokenizer(json_text=read_gguf(q4_1).tokenizer_json)
    return tokenizer.encode(english_text(), add_special_tokens=False)


# -- the servers ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Peer:
    name: str
    command: Callable[[int], list[str]]  # the command line, given its port
    environment: dict[str, str] = field(default_factory=dict)
    is_pe_serve: bool = False


def pe_serve(name: str, model: Path, *flags: str) -> Peer:
    def command(port: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "service",
            "--port",
            str(port),
            "--grpc-port",
            "0",
            "--model-dir",
            str(model),
            *flags,
        ]

    return Peer(name, command, {"PYTHONUNBUFFERED": "1"}, is_pe_serve=True)


def llama_server(name: str, model: Path) -> Peer:
    threads = str(os.cpu_count() or 1)

    def command(port: int) -> list[str]:
        return [
            str(LLAMA_SERVER),
            *("-m", str(model), "--host", "127.0.0.1", "--port", str(port)),
            *("-t", threads, "-np", str(SLOTS), "-c", str(SLOTS * SLOT_CONTEXT)),
        ]

    return Peer(name, command)


@dataclass
class Running:
    peer: Peer
    process: subprocess.Popen[bytes]
    base_url: str
    log_path: Path
    model: str = ""


@contextlib.contextmanager
def started(peers: Sequence[Peer], logs: Path) -> Iterator[list[Running]]:
    """Every peer's server, each on its own port, ready; all stopped afterwards."""
    running: list[Running] = []
    try:
        for peer in peers:
            port = free_port()
            log_path = logs / f"{peer.name.replace(' ', '_')}.log"
            with log_path.open("wb") as log:
                process = subprocess.Popen(
                    peer.command(port),
                    cwd=REPO_ROOT,
                    env={**os.environ, **peer.environment},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # a process group of its own, paused whole (`turn`)
                )
            running.append(Running(peer, process, f"http://127.0.0.1:{port}", log_path))
        for server in running:
            server.model = wait_ready(server)
        yield running
    finally:
        for server in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.process.pid, signal.SIGCONT)  # a paused server could not stop
            server.process.terminate()
        for server in running:
            try:
                server.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.process.kill()
                server.process.wait()


@contextlib.contextmanager
def turn(server: Running, servers: Sequence[Running]) -> Iterator[Running]:
    """`server` running with every other server paused; they resume afterwards."""
    others = [other for other in servers if other is not server]
    for other in others:
        os.killpg(other.process.pid, signal.SIGSTOP)
    try:
        yield server
    finally:
        for other in others:
            os.killpg(other.process.pid, signal.SIGCONT)


def wait_ready(server: Running) -> str:
    """Poll `/v1/models` until it answers (both servers have it); the served model's id."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                raise RuntimeError(f"{server.peer.name} exited:\n{log_tail(server.log_path)}")
            with contextlib.suppress(httpx.TransportError):
                ready = client.get(server.base_url + ("/readyz" if server.peer.is_pe_serve else "/health"))
                if ready.status_code == 200:
                    return str(client.get(server.base_url + "/v1/models").json()["data"][0]["id"])
            time.sleep(0.5)
    raise TimeoutError(f"{server.peer.name} not ready:\n{log_tail(server.log_path)}")


# -- the workloads -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    generated: int
    wall_s: float
    cached_tokens: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.wall_s


async def complete(
    client: httpx.AsyncClient,
    model: str,
    prompt: list[int],
    new_tokens: int,
    scaling: dict[str, Any] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": new_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    if scaling is not None:
        body["pe_scaling"] = scaling
    response = await client.post("/v1/completions", json=body)
    if response.status_code != 200:
        raise RuntimeError(f"/v1/completions answered {response.status_code}: {response.text[:300]}")
    reply: dict[str, Any] = response.json()
    generated = int(reply["usage"]["completion_tokens"])
    if generated != new_tokens:
        raise RuntimeError(f"asked for {new_tokens} tokens, got {generated}")
    return reply


def cached_of(reply: dict[str, Any]) -> int:
    details = reply["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def run_clients(
    server: Running,
    prompts: Sequence[list[int]],
    new_tokens: int,
    sequential: int,
    scalings: Sequence[dict[str, Any] | None] | None = None,
) -> Outcome:
    """`len(prompts)` clients at once, each sending `sequential` requests one after another,
    client i with `scalings[i]` as its `pe_scaling` (pe-serve only) where given."""
    per_client = list(scalings) if scalings is not None else [None] * len(prompts)

    async def run() -> Outcome:
        async with http_client(server.base_url, REQUEST_TIMEOUT_S) as client:

            async def one_client(prompt: list[int], scaling: dict[str, Any] | None) -> int:
                for _ in range(sequential):
                    await complete(client, server.model, prompt, new_tokens, scaling)
                return sequential * new_tokens

            start = time.perf_counter()
            counts = await asyncio.gather(
                *(one_client(prompt, scaling) for prompt, scaling in zip(prompts, per_client, strict=True))
            )
            return Outcome(sum(counts), time.perf_counter() - start)

    return asyncio.run(run())


def run_prompt(server: Running, prompt: list[int], new_tokens: int) -> Outcome:
    async def run() -> Outcome:
        async with http_client(server.base_url, REQUEST_TIMEOUT_S) as client:
            start = time.perf_counter()
            reply = await complete(client, server.model, prompt, new_tokens)
            return Outcome(new_tokens, time.perf_counter() - start, cached_of(reply))

    return asyncio.run(run())


def cpu_seconds(pid: int) -> dict[str, float]:
    """User + system CPU seconds of `pid` ("api") and of its child processes ("engine")."""
    tick = os.sysconf("SC_CLK_TCK")

    def stat(process: Path) -> list[str]:
        return (process / "stat").read_text().rpartition(")")[2].split()  # fields from the 3rd on

    def seconds(fields: list[str]) -> float:
        return (int(fields[11]) + int(fields[12])) / tick

    children = []
    for process in Path("/proc").iterdir():
        if process.name.isdigit():
            with contextlib.suppress(OSError):
                if int((fields := stat(process))[1]) == pid:
                    children.append(seconds(fields))
    return {"api": seconds(stat(Path(f"/proc/{pid}"))), "engine": sum(children)}


# -- transformers generate() ---------------------------------------------------------------------


def generate_rates(q4_1: Path, prompts: Sequence[list[int]], sizes: Sizes) -> dict[str, float]:
    """`generate()` with its default threads: one prompt alone, and all of them as one batch."""
    import torch
    import transformers

    model: Any = transformers.AutoModelForCausalLM.from_pretrained(
        str(q4_1.parent), gguf_file=q4_1.name, dtype=torch.float32
    )
    model.eval()
    options = {"do_sample": False, "min_new_tokens": sizes.new_tokens, "max_new_tokens": sizes.new_tokens}

    def rate(batch: Sequence[list[int]]) -> float:
        ids = torch.tensor(batch)
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), **options)
        return len(batch) * sizes.new_tokens / (time.perf_counter() - start)

    return {"1 client": rate(prompts[:1]), f"{sizes.clients} clients": rate(prompts)}


# -- the run -------------------------------------------------------------------------------------


@dataclass
class Results:
    one: dict[str, list[Outcome]] = field(default_factory=dict)
    many: dict[str, list[Outcome]] = field(default_factory=dict)
    cold: dict[str, list[Outcome]] = field(default_factory=dict)
    warm: dict[str, list[Outcome]] = field(default_factory=dict)
    split: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    uniform: dict[str, list[Outcome]] = field(default_factory=dict)  # every client YaRN x4
    mixed: dict[str, list[Outcome]] = field(default_factory=dict)  # six scaling types in one batch
    generate: list[dict[str, float]] = field(default_factory=list)


def measure(peers: Sequence[Peer], tokens: list[int], q4_1: Path, sizes: Sizes, repeats: int) -> Results:
    results = Results()
    short = [tokens[i * 97 : i * 97 + sizes.short_prompt] for i in range(sizes.clients)]
    with tempfile.TemporaryDirectory() as logs, started(peers, Path(logs)) as servers:
        for server in servers:  # a first request of each kind, so no repeat pays a cold start
            with turn(server, servers):
                run_clients(server, short[:1], sizes.new_tokens, 1)
        for repeat in range(repeats):
            # A long prompt no server has seen: each repeat starts further into the text.
            offset = 1000 + repeat * 4000
            long_prompt = tokens[offset : offset + sizes.long_prompt]
            for running in servers:
                progress(f"repeat {repeat + 1}/{repeats}: {running.peer.name}")
                with turn(running, servers) as server:
                    measure_turn(server, results, short, long_prompt, sizes, repeat)
    for repeat in range(repeats):
        progress(f"repeat {repeat + 1}/{repeats}: generate()")
        results.generate.append(generate_rates(q4_1, short, sizes))
    return results


def measure_turn(
    server: Running,
    results: Results,
    short: list[list[int]],
    long_prompt: list[int],
    sizes: Sizes,
    repeat: int,
) -> None:
    """One repeat's workloads on one server, into `results`."""
    name = server.peer.name
    results.one.setdefault(name, []).append(
        run_clients(server, short[repeat % len(short) :][:1], sizes.new_tokens, sizes.sequential)
    )
    before = cpu_seconds(server.process.pid) if server.peer.is_pe_serve else None
    results.many.setdefault(name, []).append(run_clients(server, short, sizes.new_tokens, 1))
    if before is not None:
        after = cpu_seconds(server.process.pid)
        results.split.setdefault(name, []).append({k: after[k] - before[k] for k in after})
    if server.peer.is_pe_serve:  # per-request scalings: what no other server has
        mix = [MIXED_SCALINGS[i % len(MIXED_SCALINGS)] for i in range(len(short))]
        uniform = [MIXED_SCALINGS[-2]] * len(short)  # yarn x4
        for table, scalings in ((results.uniform, uniform), (results.mixed, mix)):
            table.setdefault(name, []).append(run_clients(server, short, sizes.new_tokens, 1, scalings))
    results.cold.setdefault(name, []).append(run_prompt(server, long_prompt, sizes.long_new_tokens))
    results.warm.setdefault(name, []).append(run_prompt(server, long_prompt, sizes.long_new_tokens))


def progress(message: str) -> None:
    print(f"[{datetime.now(UTC):%H:%M:%S}] {message}", file=sys.stderr, flush=True)


# -- the report ----------------------------------------------------------------------------------


def ratio(results: dict[str, list[Outcome]], ours: str, theirs: str, *, time_based: bool) -> float:
    """The median over repeats of ours / theirs (speed: tok/s; time_based: their time / ours)."""
    pairs = zip(results[ours], results[theirs], strict=True)
    if time_based:
        return statistics.median(b.wall_s / a.wall_s for a, b in pairs)
    return statistics.median(a.tokens_per_s / b.tokens_per_s for a, b in pairs)


def report(results: Results, sizes: Sizes, repeats: int, peers: Sequence[Peer]) -> str:
    names = [peer.name for peer in peers]
    cpu = platform.processor() or platform.machine()
    lines = [
        "# SmolLM2-135M-Instruct: pe-serve against llama-server and generate()",
        "",
        f"Run {datetime.now(UTC):%Y-%m-%d %H:%M} UTC at `{code_revision()}`, {os.cpu_count()} cores ({cpu}), "
        f"medians of {repeats} repeats; the sides take turns within each repeat, the other servers "
        "paused (SIGSTOP) during each side's turn. Reproduce: "
        "`make bench-real` (or `python -m bench.real_model`).",
        "",
        "Requests: `/v1/completions`, token ids, greedy, `ignore_eos`. "
        f"Short: {sizes.short_prompt} prompt tokens, {sizes.new_tokens} new; 1 client sends "
        f"{sizes.sequential} one after another, {sizes.clients} clients one each at once. Long: "
        f"{sizes.long_prompt} tokens of `pydoc_data.topics`, {sizes.long_new_tokens} new, a prompt "
        "this server has not seen, then the same one again.",
        "",
        "| | " + " | ".join(names) + " | generate() |",
        "|---|" + "---|" * (len(names) + 1),
    ]

    def row(label: str, values: Sequence[str], extra: str = "—") -> str:
        return f"| {label} | " + " | ".join(values) + f" | {extra} |"

    def med(table: dict[str, list[Outcome]], name: str, attribute: str) -> float:
        return statistics.median(float(getattr(outcome, attribute)) for outcome in table[name])

    generate = {key: statistics.median(run[key] for run in results.generate) for key in results.generate[0]}
    lines += [
        row(
            "1 client, tok/s",
            [f"{med(results.one, n, 'tokens_per_s'):.1f}" for n in names],
            f"{generate['1 client']:.1f}",
        ),
        row(
            f"{sizes.clients} clients, tok/s",
            [f"{med(results.many, n, 'tokens_per_s'):.1f}" for n in names],
            f"{generate[f'{sizes.clients} clients']:.1f}",
        ),
        row("long prompt, first time, s", [f"{med(results.cold, n, 'wall_s'):.2f}" for n in names]),
        row("the same prompt again, s", [f"{med(results.warm, n, 'wall_s'):.2f}" for n in names]),
        row(
            "cached tokens reported (again)", [f"{med(results.warm, n, 'cached_tokens'):.0f}" for n in names]
        ),
        "",
        "Ratios (pe-serve over the peer, > 1 means pe-serve is faster), medians of per-repeat ratios:",
        "",
        "| pe-serve | peer | 1 client | " + f"{sizes.clients} clients | long, first | long, again |",
        "|---|---|---|---|---|---|",
    ]
    llama = [name for name in names if name.startswith("llama-server")]
    for ours in (name for name in names if name.startswith("pe-serve")):
        for theirs in llama:
            lines.append(
                f"| {ours} | {theirs} | {ratio(results.one, ours, theirs, time_based=False):.2f}x | "
                f"{ratio(results.many, ours, theirs, time_based=False):.2f}x | "
                f"{ratio(results.cold, ours, theirs, time_based=True):.2f}x | "
                f"{ratio(results.warm, ours, theirs, time_based=True):.2f}x |"
            )
    one_generate = statistics.median(
        outcome.tokens_per_s / run["1 client"]
        for outcome, run in zip(results.one[names[0]], results.generate, strict=True)
    )
    lines += [
        "",
        f"{names[0]} against generate(): 1 client {one_generate:.2f}x.",
        "",
        f"Mixed scalings, {sizes.clients} clients at once: every client YaRN x4 (uniform) against the "
        "six types (none, linear, ntk, dynamic, yarn, llama3; x4 each) in one batch:",
        "",
        "| pe-serve | uniform, tok/s | mixed, tok/s | mixed / uniform |",
        "|---|---|---|---|",
    ]
    for name in results.mixed:
        mixed_ratio = ratio(
            {"m": results.mixed[name], "u": results.uniform[name]}, "m", "u", time_based=False
        )
        lines.append(
            f"| {name} | {med(results.uniform, name, 'tokens_per_s'):.1f} | "
            f"{med(results.mixed, name, 'tokens_per_s'):.1f} | {mixed_ratio:.3f} |"
        )
    lines += [
        "",
        f"CPU seconds over the {sizes.clients}-client run, API process / engine process (medians):",
        "",
    ]
    for name, splits in results.split.items():
        api = statistics.median(split["api"] for split in splits)
        engine = statistics.median(split["engine"] for split in splits)
        share = api / (api + engine) if api + engine else float("nan")
        lines.append(f"- {name}: {api:.1f} / {engine:.1f} ({share:.0%} in the API process)")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "bench/results/real_model.md")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--weights", nargs="*", default=["float", "int8", "int4"], help="pe-serve formats")
    args = parser.parse_args(argv)
    if not LLAMA_SERVER.is_file():
        parser.error(f"{LLAMA_SERVER} is missing: run scripts/build_llama_server.sh")
    sizes = Sizes.quick() if args.quick else Sizes()
    q4_1 = smollm2_q4_1()
    f32 = f32_gguf(q4_1)
    peers = [
        *(
            pe_serve(f"pe-serve {weights}", q4_1, *(("--weights", weights) if weights != "float" else ()))
            for weights in args.weights
        ),
        pe_serve("pe-serve float, 1 engine thread", q4_1, "--torch-threads", "1"),  # the split
        llama_server("llama-server F32", f32),
        llama_server("llama-server Q4_1", q4_1),
    ]
    tokens = english_tokens(q4_1)
    results = measure(peers, tokens, q4_1, sizes, args.repeats)
    text = report(results, sizes, args.repeats, peers)
    print(text)
    args.output.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
