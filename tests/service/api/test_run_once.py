"""A request id runs once: a retry under the same `X-Request-ID` gets the first run's answer.

Against the shared live server. How many times the engine admitted a prompt is read from
`pe_prefix_cache_queries` (prompt tokens looked up, per admission), compared with one plain run.
"""

from __future__ import annotations

import json
import socket
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import httpx

from tests.live_server import LiveServer
from tests.service.api.helpers import metric_sum, metric_value, wait_for

# Sampled, so two runs would differ in their text as well as in their `id`; a prompt of several KV
# blocks, so that its admission is counted in the prefix cache's queries.
PROMPT = "".join(f"def once_{index}(x):\n    return x + {index}\n" for index in range(8))
BODY: dict[str, Any] = {"prompt": PROMPT, "max_new_tokens": 200, "temperature": 1.0, "pe": "rope"}
SCORED: dict[str, Any] = {"prompt": "import os\nprint(os.getcwd())\n", "pe": "rope"}
QUERIES = "pe_prefix_cache_queries_total"


def admitted_prompt_tokens(client: httpx.Client) -> float:
    return metric_sum(client, QUERIES, 'model="tiny-rope"')


def with_id(request_id: str) -> dict[str, str]:
    return {"X-Request-ID": request_id}


def test_submissions_under_one_id_run_once_and_answer_alike(client: httpx.Client) -> None:
    before = admitted_prompt_tokens(client)
    client.post("/generate", json=BODY).raise_for_status()
    one_run = admitted_prompt_tokens(client) - before
    assert one_run > 0

    request_id = f"once-{uuid.uuid4().hex}"
    before = admitted_prompt_tokens(client)
    with ThreadPoolExecutor(max_workers=3) as pool:
        concurrent = list(
            pool.map(lambda _: client.post("/generate", json=BODY, headers=with_id(request_id)), range(3))
        )
    late = client.post("/generate", json=BODY, headers=with_id(request_id))
    answers = [response.json() for response in (*concurrent, late)]
    assert all(response.status_code == 200 for response in (*concurrent, late))
    assert all(answer == answers[0] for answer in answers), "every submission got the first run's answer"
    assert admitted_prompt_tokens(client) - before == one_run, "four submissions, one run"


def test_an_id_reused_for_another_body_or_without_an_id_runs_again(client: httpx.Client) -> None:
    request_id = f"once-{uuid.uuid4().hex}"
    first = client.post("/generate", json=BODY, headers=with_id(request_id)).json()
    other = client.post("/generate", json={**BODY, "max_new_tokens": 199}, headers=with_id(request_id)).json()
    plain = [client.post("/generate", json=BODY).json() for _ in range(2)]
    assert len({first["id"], other["id"], plain[0]["id"], plain[1]["id"]}) == 4


def test_score_is_answered_once_per_id(client: httpx.Client) -> None:
    request_id = f"once-{uuid.uuid4().hex}"
    answers = [client.post("/score", json=SCORED, headers=with_id(request_id)) for _ in range(2)]
    assert [response.status_code for response in answers] == [200, 200]
    assert answers[0].content == answers[1].content


def test_a_run_whose_only_caller_left_is_cancelled(client: httpx.Client, server: LiveServer) -> None:
    wait_for(lambda: metric_value(client, "pe_serve_batch_size") == 0, "an idle batch")
    address = urlsplit(server.base_url)
    request_id = f"once-{uuid.uuid4().hex}"
    payload = json.dumps({"prompt": "a", "max_new_tokens": 500, "temperature": 0}).encode()
    head = (
        f"POST /generate HTTP/1.1\r\nHost: {address.netloc}\r\nX-Request-ID: {request_id}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode()
    with socket.create_connection((address.hostname, address.port)) as raw:
        raw.sendall(head + payload)
        wait_for(lambda: metric_value(client, "pe_serve_batch_size") == 1, "the request to join the batch")
    wait_for(lambda: metric_value(client, "pe_serve_batch_size") == 0, "the abandoned run to leave the batch")
    records = [json.loads(line) for line in server.logs().splitlines() if request_id in line]
    assert [record["status"] for record in records if record.get("path") == "/generate"] == [499]
