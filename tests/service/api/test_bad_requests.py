"""The bad-request battery over HTTP: the right 4xx in the SPEC's error shape, and the server lives on.

The table is tests/service/bad_inputs.py, shared with the gRPC twins.
"""

from __future__ import annotations

import httpx
import pytest

from tests.service.api.helpers import assert_error_shape
from tests.service.bad_inputs import CASES, GOOD, BadRequest


def test_the_battery_is_large_enough() -> None:
    assert len(CASES) >= 40
    assert len({case.name for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_bad_request_gets_the_right_status_and_error_shape(client: httpx.Client, case: BadRequest) -> None:
    assert_error_shape(case.send(client), case.status, case.param)


def test_server_stays_healthy_after_the_battery(client: httpx.Client) -> None:
    for case in CASES:
        case.send(client)
    assert client.get("/healthz").status_code == 200
    assert client.get("/readyz").status_code == 200
    response = client.post("/generate", json=GOOD)
    assert response.status_code == 200, response.text
    assert 'status="500"' not in client.get("/metrics").text
