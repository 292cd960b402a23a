"""EleutherAI's lm-evaluation-harness against a live pe-serve, the configuration chosen by model name.

lm-eval's own `local-completions` model (`lm_eval.simple_evaluate`, what `lm-eval run --model
local-completions` calls) runs our offline cloze task (tests/harness/tasks: a YAML and a JSONL, no
hub) through `/v1/completions` on one tiny RoPE checkpoint under three names: the `--alias` `plain`
(the checkpoint as it is), the `--alias` `long` (YaRN x2 and self-extend) and a `NAME@SPEC` name
(ReRoPE) that no flag declares. lm-eval counts tokens with the server's tokenizer
(`tokenizer_backend=remote`: /tokenizer_info, /tokenize, /detokenize), so nothing comes from a hub:
while it runs, any connection or name lookup off loopback is refused and the test fails.

Each (context, choice) log-likelihood lm-eval reports must equal the sum of `/score`'s
log-probabilities of the choice's tokens after the context, scored with the alias's configuration
as explicit `pe_scaling`/`pe_attention` fields (within 1e-4), its greedy flag what `/score`'s top
token says, and `acc`/`acc_norm` what those log-likelihoods give. The dev extra brings lm-eval;
without it the test skips, except in CI, where `make test` installs it and its absence fails.
"""

from __future__ import annotations

import contextlib
import importlib
import ipaddress
import os
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.conftest import TinyCheckpointFactory
from tests.harness.tasks.pe_cloze import documents
from tests.live_server import LiveServer, OptionValue, live_server
from tests.service.api.conftest import SERVER_ENV

lm_eval = importlib.import_module("lm_eval") if os.environ.get("CI") else pytest.importorskip("lm_eval")

pytestmark = pytest.mark.slow

TASKS = Path(__file__).parent / "tasks"
TASK = "pe_cloze"
MODEL = "tiny-rope"
MAX_CONTEXT = 512
YARN = {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}
SELF_EXTEND = {"type": "self_extend", "group_size": 4, "window": 16}
RE_ROPE = {"type": "rerope", "window": 8}
ALIASES = {
    "plain": MODEL,
    "long": f"{MODEL}@yarn:factor=2,original_max_position_embeddings=64@self_extend:group_size=4,window=16",
}
# model name -> (the explicit fields /score is given, how lm-eval sends the requests)
CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "plain": ({}, {"batch_size": 8}),
    "long": ({"pe_scaling": YARN, "pe_attention": SELF_EXTEND}, {"batch_size": 8}),
    f"{MODEL}@rerope:window=8": ({"pe_attention": RE_ROPE}, {"batch_size": 8, "num_concurrent": 2}),
}
TOLERANCE = 1e-4
TIMEOUT = 120.0


@pytest.fixture(scope="module")
def server(make_tiny_checkpoint: TinyCheckpointFactory) -> Iterator[LiveServer]:
    checkpoint = make_tiny_checkpoint("rope", name=MODEL, seed=3)
    options: dict[str, OptionValue] = {
        "device": "cpu",
        "dtype": "float32",
        "max_context": MAX_CONTEXT,
        "alias": [f"{name}={target}" for name, target in ALIASES.items()],
    }
    with live_server([checkpoint], options=options, env=SERVER_ENV) as running:
        yield running


@contextlib.contextmanager
def loopback_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Refuse (and record) every connection and name lookup of this process that leaves loopback."""
    refused: list[str] = []

    def is_loopback(host: Any) -> bool:
        if host in (None, "localhost", b"localhost"):
            return True
        try:
            return ipaddress.ip_address(host.decode() if isinstance(host, bytes) else host).is_loopback
        except ValueError:
            return False

    real_getaddrinfo = socket.getaddrinfo
    real_connect = socket.socket.connect
    real_connect_ex = socket.socket.connect_ex

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if not is_loopback(host):
            refused.append(f"lookup {host!r}")
            raise socket.gaierror(socket.EAI_NONAME, f"off-loopback lookup refused in this test: {host}")
        return real_getaddrinfo(host, *args, **kwargs)

    def guarded(real: Any) -> Any:
        def connect(sock: socket.socket, address: Any) -> Any:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and not is_loopback(address[0]):
                refused.append(f"connect {address!r}")
                raise ConnectionRefusedError(f"off-loopback connection refused in this test: {address}")
            return real(sock, address)

        return connect

    with monkeypatch.context() as patch:
        patch.setattr(socket, "getaddrinfo", getaddrinfo)
        patch.setattr(socket.socket, "connect", guarded(real_connect))
        patch.setattr(socket.socket, "connect_ex", guarded(real_connect_ex))
        yield refused


def run_lm_eval(server: LiveServer, name: str, sending: dict[str, Any]) -> dict[str, Any]:
    """lm-eval's results for `name`, as docs/harnesses.md runs it, without touching global RNGs."""
    from lm_eval.tasks import TaskManager

    model_args = {
        "base_url": server.url("/v1/completions"),
        "model": name,
        "tokenizer_backend": "remote",
        "max_length": MAX_CONTEXT,
        **({"num_concurrent": sending["num_concurrent"]} if "num_concurrent" in sending else {}),
    }
    results: dict[str, Any] = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
        batch_size=sending.get("batch_size", 1),
        log_samples=True,
        bootstrap_iters=0,
        random_seed=None,
        numpy_random_seed=None,
        torch_random_seed=None,
        fewshot_random_seed=None,
    )
    return results


def tokenize(client: httpx.Client, text: str) -> list[int]:
    response = client.post("/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False})
    assert response.status_code == 200, response.text
    tokens: list[int] = response.json()["tokens"]
    return tokens


def scored_continuation(
    client: httpx.Client, context: list[int], whole: list[int], fields: dict[str, Any]
) -> tuple[float, bool]:
    """(log-likelihood, greedy) of the tokens of `whole` after `context`: `/score` with explicit fields."""
    assert whole[: len(context)] == context and len(whole) > len(context)
    response = client.post("/score", json={"model": MODEL, "tokens": whole, "top_logprobs": 1, **fields})
    assert response.status_code == 200, response.text
    scored = response.json()
    positions = range(len(context), len(whole))
    loglikelihood = sum(scored["token_logprobs"][i] for i in positions)
    greedy = all(scored["top_logprobs"][i][0]["token"] == whole[i] for i in positions)
    return loglikelihood, greedy


def expected(
    server: LiveServer, pairs: list[tuple[str, str]], fields: dict[str, Any]
) -> list[tuple[float, bool]]:
    """`/score`'s answer for each (context, continuation), the texts tokenized by the server as lm-eval
    sends them (no BOS: token ids are used as given); a few requests in flight at once."""
    with httpx.Client(base_url=server.base_url, timeout=TIMEOUT) as client, ThreadPoolExecutor(4) as pool:
        texts = sorted(
            {text for context, continuation in pairs for text in (context, context + continuation)}
        )
        tokens = dict(zip(texts, pool.map(lambda text: tokenize(client, text), texts), strict=True))
        return list(
            pool.map(
                lambda pair: scored_continuation(client, tokens[pair[0]], tokens[pair[0] + pair[1]], fields),
                pairs,
            )
        )


def test_the_task_data_is_ours_and_multiple_choice() -> None:
    items = documents()
    assert len(items) >= 8
    for item in items:
        assert item["context"] and item["context"] == item["context"].strip()
        assert 0 <= item["label"] < len(item["choices"]) and len(set(item["choices"])) == len(item["choices"])


@pytest.mark.parametrize("name", list(CASES))
def test_lm_eval_through_a_model_name_equals_score_with_the_fields(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    fields, sending = CASES[name]
    with loopback_only(monkeypatch) as refused:
        results = run_lm_eval(server, name, sending)
    assert refused == [], f"lm-eval tried to leave loopback: {refused}"
    assert results["config"]["model_args"]["model"] == name

    items = documents()
    samples = sorted(results["samples"][TASK], key=lambda sample: sample["doc_id"])
    assert [sample["doc_id"] for sample in samples] == list(range(len(items)))
    pairs = [(item["context"], f" {choice}") for item in items for choice in item["choices"]]
    want = iter(expected(server, pairs, fields))
    correct: dict[str, list[float]] = {"acc": [], "acc_norm": []}
    for item, sample in zip(items, samples, strict=True):
        arguments = [(item["context"], f" {choice}") for choice in item["choices"]]
        assert [tuple(argument) for argument in sample["arguments"]] == arguments
        reported = [(float(ll), bool(greedy)) for ll, greedy in sample["filtered_resps"]]
        scored = [next(want) for _ in arguments]
        for (got, got_greedy), (loglikelihood, greedy) in zip(reported, scored, strict=True):
            assert abs(got - loglikelihood) <= TOLERANCE, (name, item["context"], got, loglikelihood)
            assert got_greedy == greedy
        lls = np.array([loglikelihood for loglikelihood, _ in scored])
        lengths = np.array([float(len(choice)) for choice in item["choices"]])
        acc = float(np.argmax(lls) == item["label"])
        acc_norm = float(np.argmax(lls / lengths) == item["label"])
        assert (sample["acc"], sample["acc_norm"]) == (acc, acc_norm)
        correct["acc"].append(acc)
        correct["acc_norm"].append(acc_norm)

    metrics = results["results"][TASK]
    assert metrics["acc,none"] == pytest.approx(np.mean(correct["acc"]))
    assert metrics["acc_norm,none"] == pytest.approx(np.mean(correct["acc_norm"]))
    if fields:  # the name reached the server: the first item is not what the checkpoint alone gives
        first = pairs[: len(items[0]["choices"])]
        plain = [loglikelihood for loglikelihood, _ in expected(server, first, {})]
        configured = [float(loglikelihood) for loglikelihood, _ in samples[0]["filtered_resps"]]
        assert max(abs(a - b) for a, b in zip(plain, configured, strict=True)) > 1e-3, name
