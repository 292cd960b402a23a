"""The settings of the shared live server (tests/service/conftest.py) and names the API tests use."""

from __future__ import annotations

from service.model.config import SCHEMES
from tests.conftest import TINY_CONFIG
from tests.live_server import OptionValue

NATIVE_CONTEXT: int = TINY_CONFIG["native_context"]
ROTARY_FREQUENCIES: int = TINY_CONFIG["d_model"] // TINY_CONFIG["n_heads"] // 2
MAX_CONTEXT = 512
# The load order of `tiny_checkpoints`: RoPE first, so it is the default model.
SCHEME_ORDER = ("rope", *(scheme for scheme in SCHEMES if scheme != "rope"))
SERVER_ENV = {"OMP_NUM_THREADS": "1"}
BASE_OPTIONS: dict[str, OptionValue] = {"device": "cpu", "dtype": "float32", "max_context": MAX_CONTEXT}


def model_name(scheme: str) -> str:
    return f"tiny-{scheme}"
