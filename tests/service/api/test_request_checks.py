"""Each rule a request meets runs once, at submission, and its error names the field as the route's
body wrote it.

The rules (scheme support for a scaling and a rule, vocabulary, room in the context) live in
`service.engine.catalog`; the routes only resolve and encode. Served in this process by the real
app on a real uvicorn server, so the catalog's rule functions can be counted where they run.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.engine import catalog
from service.engine.engine import InferenceEngine
from service.settings import Settings
from tests.live_server import free_port
from tests.service.api.in_process import serve_in_process
from tests.service.api.test_openai_chat import write_chat_llama

MODEL = "tiny-rope"
CHAT_MODEL = "tiny-chat"  # the chat routes need a model with a chat template
CHAT = [{"role": "user", "content": "w12 w13"}]


@pytest.fixture(scope="module")
def served(
    tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[httpx.Client]:
    chat = write_chat_llama(tmp_path_factory.mktemp("chat") / CHAT_MODEL)
    engine = InferenceEngine.from_model_dirs(
        [tiny_checkpoints["rope"], chat], device="cpu", dtype="float32", max_context=256
    )
    with serve_in_process(engine, Settings(warmup=False, grpc_port=free_port())) as client:
        yield client


@pytest.fixture
def rules_run(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """How often each of the catalog's input rules ran, by rule (the input's token check only:
    `stop_token_ids` are checked by the same function under their own name)."""
    counts: Counter[str] = Counter()

    def counted(name: str, rule: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("field") != "stop_token_ids":
                counts[name] += 1
            return rule(*args, **kwargs)

        return run

    for name in ("check_configuration", "check_tokens", "check_room"):
        rule: Callable[..., Any] = getattr(catalog, name)
        for module in [module for key, module in sys.modules.items() if key.startswith("service.")]:
            if getattr(module, name, None) is rule:  # wherever the service imported it
                monkeypatch.setattr(module, name, counted(name, rule))
    return counts


@pytest.mark.parametrize(
    ("path", "body", "jobs"),
    [
        ("/generate", {"prompt": "def f(x):", "max_new_tokens": 2, "temperature": 0}, 1),
        ("/score", {"prompt": "def f(x):\n    return x"}, 1),
        ("/v1/completions", {"prompt": "def f(", "max_tokens": 2, "n": 2, "echo": True, "logprobs": 1}, 3),
        ("/v1/completions", {"prompt": [256, 5, 6], "max_tokens": 0, "echo": True}, 1),
        ("/v1/chat/completions", {"model": CHAT_MODEL, "messages": CHAT, "max_tokens": 2}, 1),
    ],
    ids=["generate", "score", "completions-n2-echo-logprobs", "completions-echo-only", "chat"],
)
def test_every_input_rule_runs_once_per_job(
    served: httpx.Client, rules_run: Counter[str], path: str, body: dict[str, Any], jobs: int
) -> None:
    """A job is one generation or one echoed score; a request that runs none (an echo with
    `max_tokens` 0) is still checked, once. Before, the routes checked and the engine checked again."""
    response = served.post(path, json={"model": MODEL, **body, "pe_scaling": {"type": "linear", "factor": 2}})
    assert response.status_code == 200, response.text
    assert rules_run == {"check_configuration": jobs, "check_tokens": jobs, "check_room": jobs}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/generate", {"tokens": [256, 99999], "max_new_tokens": 2}, 422, "tokens.1"),
        ("/score", {"tokens": [256]}, 422, "tokens"),
        ("/generate", {"prompt": "x", "max_new_tokens": 300}, 422, "max_new_tokens"),
        ("/v1/completions", {"prompt": [256, 99999], "max_tokens": 0, "echo": True}, 400, "prompt.0.1"),
        ("/v1/completions", {"prompt": [[256, 5], [256, 99999]], "max_tokens": 1}, 400, "prompt.1.1"),
        ("/v1/completions", {"prompt": "x " * 300, "max_tokens": 1}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 255}, 400, "max_tokens"),
        (
            "/v1/chat/completions",
            {"model": CHAT_MODEL, "messages": CHAT, "max_tokens": 300},
            400,
            "max_tokens",
        ),
    ],
)
def test_an_input_refused_at_submission_names_the_field_the_body_sent(
    served: httpx.Client, path: str, body: dict[str, Any], status: int, param: str
) -> None:
    """The engine's one check names the body's field: `prompt.1.1` on /v1/completions for the
    second prompt's second id, `max_tokens` there for what /generate calls `max_new_tokens`."""
    error = refused(served.post(path, json={"model": MODEL, **body}), status, param)
    assert param in error["message"]


def test_what_a_model_name_sets_is_refused_at_submission_as_the_model_s_error(served: httpx.Client) -> None:
    """Streaming keeps only its window, so it refuses dynamic NTK; set by the name, the error is
    on `model`, and names the field the name set."""
    name = f"{MODEL}@dynamic:factor=2@streaming:sink_tokens=4,window=32"
    response = served.post("/generate", json={"model": name, "prompt": "x", "max_new_tokens": 2})
    error = refused(response, 422, "model")
    assert error["message"].startswith(f"model {name!r}: pe_attention.type:")
    rule = {"type": "streaming", "sink_tokens": 4, "window": 32}
    sent = {"prompt": "x", "max_new_tokens": 2, "pe_attention": rule}
    response = served.post("/generate", json={"model": f"{MODEL}@dynamic:factor=2", **sent})
    refused(response, 422, "pe_attention.type")  # the body's own field: named as sent


def refused(response: httpx.Response, status: int, param: str) -> dict[str, Any]:
    """The error of a refused request (the SPEC's shape, or OpenAI's with its `code`), naming `param`."""
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["param"] == param, error
    return error
