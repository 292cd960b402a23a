"""Request bodies validated by the real pydantic models, and their errors named by dotted field."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from pe_runtime import RopeScaling
from service.requests.bodies import GenerateRequest
from service.requests.errors import param_from_location
from service.requests.scaling import SCALING_EXAMPLES


def first_error_param(body: dict[str, Any]) -> str | None:
    with pytest.raises(ValidationError) as raised:
        GenerateRequest.model_validate(body)
    error = raised.value.errors()[0]
    return param_from_location(("body", *error["loc"]), error["type"])


@pytest.mark.parametrize("scaling_type", sorted(SCALING_EXAMPLES))
def test_every_scaling_example_validates_and_resolves(scaling_type: str) -> None:
    body = GenerateRequest.model_validate({"prompt": "x", "pe_scaling": SCALING_EXAMPLES[scaling_type]})
    assert body.pe_scaling is not None and body.pe_scaling.type == scaling_type
    resolved = RopeScaling.from_hf(body.pe_scaling.to_hf(), max_position_embeddings=256)
    assert resolved.type == scaling_type


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "pe_scaling": {"type": "yarn", "factor": 0.5}}, "pe_scaling.factor"),
        ({"prompt": "x", "pe_scaling": {"type": "linear"}}, "pe_scaling.factor"),
        ({"prompt": "x", "pe_scaling": {"type": "warp", "factor": 2}}, "pe_scaling.type"),
        ({"prompt": "x", "pe_scaling": {"factor": 2}}, "pe_scaling.type"),
        ({"prompt": "x", "pe_scaling": {"type": "ntk", "factor": 2, "beta_fast": 3}}, "pe_scaling.beta_fast"),
        (
            {"prompt": "x", "pe_scaling": {"type": "longrope", "short_factor": [], "long_factor": [1]}},
            "pe_scaling.short_factor",
        ),
        ({"prompt": "x", "stop": ["a"] * 9}, "stop"),
        ({"prompt": "x", "stop": ["a" * 65]}, "stop.0"),
        ({"tokens": [1, -2]}, "tokens.1"),
        ({"prompt": "x", "max_new_tokens": "8"}, "max_new_tokens"),
    ],
)
def test_errors_name_the_dotted_field(body: dict[str, Any], param: str) -> None:
    assert first_error_param(body) == param


def test_json_decode_errors_name_no_field() -> None:
    assert param_from_location(("body", 17), "json_invalid") is None
