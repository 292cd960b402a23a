"""The gRPC twin of every case the HTTP battery answers with 422 or 404, from the same table.

422 becomes INVALID_ARGUMENT and 404 NOT_FOUND, with `pe-serve-param` naming the field; the server
stays healthy afterwards.
"""

from __future__ import annotations

import grpc
import httpx
import pytest

from service.grpc_api import pe_serve_pb2 as pb
from tests.service.bad_inputs import CASES, GOOD, GRPC_TWIN_STATUSES, BadRequest
from tests.service.grpc.helpers import assert_status, generate, raw_call

TWINS = [case for case in CASES if case.has_grpc_twin]
_CODES = {422: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND}


def _send(channel: grpc.Channel, case: BadRequest) -> grpc.RpcError:
    call = raw_call(channel, case.grpc_method())
    with pytest.raises(grpc.RpcError) as caught:
        result = call(case.grpc_request(), timeout=30)
        if case.grpc_method() == "Generate":
            list(result)
    return caught.value


def test_every_case_without_a_twin_concerns_what_only_http_has() -> None:
    fields = set(pb.GenerateRequest.DESCRIPTOR.fields_by_name)
    lacking = [case for case in CASES if case.status in GRPC_TWIN_STATUSES and not case.has_grpc_twin]
    assert [case.name for case in lacking] == ["stream as string", "unknown path"]
    assert all(str(case.param) not in fields for case in lacking)
    assert len(TWINS) >= 50


@pytest.mark.parametrize("case", TWINS, ids=lambda case: case.name)
def test_bad_request_twin_gets_the_right_code_and_field(grpc_channel: grpc.Channel, case: BadRequest) -> None:
    metadata = assert_status(_send(grpc_channel, case), _CODES[case.status], case.expected_grpc_param())
    assert metadata["pe-serve-error-type"] and metadata["x-request-id"]


def test_server_stays_healthy_after_the_twins(grpc_channel: grpc.Channel, client: httpx.Client) -> None:
    for case in TWINS:
        _send(grpc_channel, case)
    # Every token asked for: the random tiny model may otherwise draw EOS first (a flake CI met).
    responses = generate(grpc_channel, {**GOOD, "ignore_eos": True}, timeout=30)
    assert responses[-1].end.usage.completion_tokens == GOOD["max_new_tokens"]
    metrics = client.get("/metrics").text
    assert 'status="INTERNAL"' not in metrics and 'status="UNKNOWN"' not in metrics
