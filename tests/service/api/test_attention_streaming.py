"""`streaming` attention past max_context: a real server generates five times its context while
the row keeps only its sinks and window, and every token is the authors' (mit-han-lab/streaming-llm,
ported in float64 in `tests/references/streaming.py`).

The server's own figures show the bound: `/metrics` polled while the generation runs never reports
more KV tokens reserved than the sinks, the window and a few blocks of slack, far below what the
text would take.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from functools import partial

import httpx
import pytest
import torch

from service.model.attention_rules import StreamingAttention
from tests.conftest import TinyCheckpointFactory
from tests.live_server import LiveServer, OptionValue, live_server
from tests.references.streaming import streaming_attention
from tests.service.api.conftest import SERVER_ENV
from tests.service.test_attention_model import BASE, model, reference_logprobs, text

MODEL = "tiny-rules"
MAX_CONTEXT = 128
GENERATED = 5 * MAX_CONTEXT
RULE = StreamingAttention(sink_tokens=4, window=24)
BLOCK = 16  # the pool's block size
TIMEOUT = 300.0


@pytest.fixture(scope="module")
def server(make_tiny_checkpoint: TinyCheckpointFactory) -> Iterator[LiveServer]:
    rope = make_tiny_checkpoint("rope", name=MODEL, seed=5, rope_base=BASE, native_context=128)
    options: dict[str, OptionValue] = {
        "device": "cpu",
        "dtype": "float32",
        "max_context": MAX_CONTEXT,
        "max_stream_tokens": GENERATED,
    }
    with live_server([rope], options=options, env=SERVER_ENV) as running:
        yield running


def reserved_tokens(server: LiveServer) -> float:
    """KV tokens reserved by running requests, from the pool's gauges."""
    values = {}
    for line in httpx.get(server.url("/metrics")).text.splitlines():
        for name in ("pe_kv_cache_usage_perc", "pe_kv_cache_capacity_tokens"):
            if line.startswith(f'{name}{{model="{MODEL}"}}'):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values["pe_kv_cache_usage_perc"] * values["pe_kv_cache_capacity_tokens"]


def test_a_generation_of_five_contexts_keeps_its_window_and_equals_the_authors(server: LiveServer) -> None:
    prompt = text()[:40]
    body = {
        "model": MODEL,
        "tokens": prompt,
        "max_new_tokens": GENERATED,
        "temperature": 0.0,
        "logprobs": True,
        "pe_attention": RULE.to_dict(),
    }
    peak = 0.0
    done = threading.Event()
    result: dict[str, object] = {}

    def generate() -> None:
        try:
            result["response"] = httpx.post(server.url("/generate"), json=body, timeout=TIMEOUT)
        finally:
            done.set()

    worker = threading.Thread(target=generate)
    worker.start()
    samples = 0
    while not done.wait(0.02):
        peak = max(peak, reserved_tokens(server))
        samples += 1
    worker.join()
    response = result["response"]
    assert isinstance(response, httpx.Response)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert len(answer["tokens"]) == GENERATED
    assert answer["pe"]["attention"] == RULE.to_dict()

    held = (1 + 2 + 2) * BLOCK  # the sinks' block, the window's two, two of slack
    assert samples > 5 and 0 < peak <= held, f"peak {peak} tokens reserved over {samples} samples"
    assert peak < (len(prompt) + GENERATED) / 5  # the whole text's blocks would be 680 tokens

    tokens = prompt + answer["tokens"]
    reference = reference_logprobs(
        model(), tokens, partial(streaming_attention, base=BASE, start_size=4, recent_size=24)
    )
    steps = torch.arange(len(prompt) - 1, len(tokens) - 1)
    expected = reference[steps, torch.tensor(tokens[len(prompt) :])]
    served = torch.tensor(answer["logprobs"], dtype=torch.float64)
    assert (served - expected).abs().max().item() <= 2e-4
    greedy = reference[steps].argmax(dim=-1)
    assert (greedy == torch.tensor(answer["tokens"])).float().mean().item() == 1.0


def test_past_max_context_only_streaming_may_run(server: LiveServer) -> None:
    body = {"model": MODEL, "tokens": [1, 2, 3], "max_new_tokens": MAX_CONTEXT + 1}
    response = httpx.post(server.url("/generate"), json=body, timeout=TIMEOUT)
    assert response.status_code == 422 and response.json()["error"]["param"] == "max_new_tokens"
    too_many = body | {"max_new_tokens": GENERATED + 1, "pe_attention": RULE.to_dict()}
    response = httpx.post(server.url("/generate"), json=too_many, timeout=TIMEOUT)
    assert response.status_code == 422 and response.json()["error"]["param"] == "max_new_tokens"
    dynamic = body | {
        "max_new_tokens": 4,
        "pe_attention": RULE.to_dict(),
        "pe_scaling": {"type": "dynamic", "factor": 2.0},
    }
    response = httpx.post(server.url("/generate"), json=dynamic, timeout=TIMEOUT)
    assert response.status_code == 422 and response.json()["error"]["param"] == "pe_attention.type"
