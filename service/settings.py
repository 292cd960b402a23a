"""Server settings: one pydantic-settings model fed by CLI flags, `PE_SERVE_*` variables and defaults.

Precedence is flag > environment > default, so a container can be configured entirely through its
environment while a developer still overrides one knob on the command line.
"""

from __future__ import annotations

import os
import ssl
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from service.engine.budget import DEFAULT_PREFILL_SLOWDOWN, DEFAULT_STEP_TOKEN_BUDGET

Device = Literal["auto", "cpu", "cuda"]
DType = Literal["auto", "float32", "bfloat16", "float16"]
# How linear weights are kept at run time (`service.model.quantized` packs the non-float ones).
Weights = Literal["float", "int8", "int4"]
LogLevel = Literal["debug", "info", "warning", "error", "critical"]
EngineMode = Literal["process", "thread"]

ONE_MIB = 1 << 20


class Settings(BaseSettings):
    """Everything the server process can be told; immutable once the app is built."""

    model_config = SettingsConfigDict(env_prefix="PE_SERVE_", extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    grpc_port: int = Field(
        default=50051, ge=0, le=65535, description="Port of the gRPC API on the same host; 0 disables it."
    )
    model_dir: Annotated[list[Path], NoDecode] = Field(
        default_factory=list,
        description="Checkpoint directories to serve; empty means the bundled zoo.",
    )
    alias: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Fixed model names, NAME=TARGET with TARGET a model and its SPECs "
        "(MODEL@SPEC[@SPEC], docs/openai-api.md); listed by GET /v1/models.",
    )
    device: Device = "auto"
    dtype: DType = "auto"
    weights: Weights = Field(
        default="float",
        description="Linear weights kept packed at run time: float, int8 (per channel) or int4 "
        "(groups of 32, CPU only).",
    )
    max_context: int = Field(default=4096, ge=16)
    max_stream_tokens: int = Field(
        default=65536,
        ge=1,
        description="The most tokens a generation under `pe_attention` streaming may make; it may run "
        "past max_context, its row keeping only the sinks and the window.",
    )
    max_batch_size: int = Field(default=16, ge=1)
    max_queue: int = Field(default=64, ge=0)
    engine_mode: EngineMode = Field(
        default="process",
        description="process: the engine core in its own process (the server default); thread: in-process.",
    )
    step_token_budget: int = Field(
        default=DEFAULT_STEP_TOKEN_BUDGET,
        ge=16,
        description="The most prompt and scoring tokens one engine step runs besides its decode rows.",
    )
    prefill_slowdown: float = Field(
        default=DEFAULT_PREFILL_SLOWDOWN,
        ge=0.0,
        description="While a request streams, a step's prompt and scoring chunks take at most this many "
        "times its decode pass; 0: off.",
    )
    torch_threads: int = Field(
        default=0, ge=0, description="Torch threads of the engine; 0 means every core."
    )
    kv_cache_mb: int | None = Field(
        default=None,
        ge=1,
        description="KV cache pool per model in MiB (never less than one max_context request); "
        "default: 128, or room for 4 max_context requests where that is more.",
    )
    compile: bool = Field(
        default=False,
        description="Open the fast step backends (c, compiled, cuda_graphs; docs/decode.md): start-up cost.",
    )
    prefix_cache: bool = Field(
        default=True,
        description="Reuse the KV blocks of earlier prompts with the same model, scaling and prefix.",
    )
    compile_max_window: int = Field(
        default=512,
        ge=64,
        description="Longest context (keys) a compiled decode pass covers; longer ones run eager.",
    )
    api_key: SecretStr | None = Field(
        default=None, description="Bearer key(s) required on inference routes; comma-separated for several."
    )
    api_key_file: Path | None = Field(
        default=None,
        description="File of bearer keys, one a line (blank lines and # comments ignored); adds to api_key.",
    )
    max_concurrent_per_key: int = Field(
        default=0, ge=0, description="Requests one key may have running or queued at once; 0: no limit."
    )
    max_queued_tokens_per_key: int = Field(
        default=0,
        ge=0,
        description="Prompt plus requested new tokens one key may have unfinished at once; 0: no limit.",
    )
    tls_cert: Path | None = Field(default=None, description="PEM certificate chain: HTTP and gRPC over TLS.")
    tls_key: Path | None = Field(default=None, description="PEM private key of tls_cert.")
    tls_client_ca: Path | None = Field(
        default=None, description="PEM CA bundle: clients must present a certificate it signed (mTLS)."
    )
    max_body_bytes: int = Field(default=ONE_MIB, ge=1)
    header_timeout_s: float = Field(
        default=10.0, gt=0.0, description="Seconds a client has to send a request's headers (else 408)."
    )
    max_header_bytes: int = Field(
        default=32 * 1024, ge=1024, description="Request header limit in bytes (else 431)."
    )
    max_connections: int = Field(
        default=1000, ge=1, description="Open connections at once; one more is answered 503 and closed."
    )
    drain_timeout_s: float = Field(default=30.0, ge=0.0)
    log_level: LogLevel = "info"
    warmup: bool = True

    @field_validator("model_dir", mode="before")
    @classmethod
    def _split_path_list(cls, value: object) -> object:
        """`PE_SERVE_MODEL_DIR=a:b` (os.pathsep) or `a,b` lists several directories in one variable."""
        if isinstance(value, str):
            separators = value.replace(",", os.pathsep)
            return [part for part in separators.split(os.pathsep) if part.strip()]
        return value

    @field_validator("alias", mode="before")
    @classmethod
    def _split_aliases(cls, value: object) -> object:
        """`PE_SERVE_ALIAS="a=M@yarn:factor=2 b=M@ntk:factor=4"`: aliases separated by whitespace
        (a SPEC has commas, never a space). Each is read when the server is built
        (`service.requests.model_names`), which keeps this module free of the model's imports."""
        if isinstance(value, str):
            return value.split()
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_log_level(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @field_validator("api_key_file")
    @classmethod
    def _readable_key_file(cls, path: Path | None) -> Path | None:
        """Refused at start-up, not at the first request: an unreadable or empty file serves nobody."""
        if path is not None and not read_key_file(path):
            raise ValueError(f"{path} holds no key (one a line; blank lines and # comments are skipped)")
        return path

    @model_validator(mode="after")
    def _loadable_tls(self) -> Settings:
        """Certificate and key come together and must load; a client CA needs them."""
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key are given together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca needs tls_cert and tls_key")
        if self.tls_cert is not None and self.tls_key is not None:
            try:
                context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
                context.load_cert_chain(self.tls_cert, self.tls_key)
                if self.tls_client_ca is not None:
                    context.load_verify_locations(self.tls_client_ca)
            except (OSError, ssl.SSLError) as error:
                raise ValueError(f"cannot load the TLS files: {error}") from None
        return self

    def api_keys(self) -> tuple[bytes, ...]:
        """The accepted keys (`api_key`'s, then the file's) as bytes, for constant-time comparison."""
        given = self.api_key.get_secret_value().split(",") if self.api_key is not None else []
        from_file = read_key_file(self.api_key_file) if self.api_key_file is not None else []
        keys = (key.strip() for key in (*given, *from_file))
        return tuple(dict.fromkeys(key.encode() for key in keys if key))


def read_key_file(path: Path) -> list[str]:
    """The keys of a key file, one a line; blank lines and `#` comments are not keys.

    Raises ValueError (a settings error) when the file cannot be read.
    """
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"cannot read the key file: {error}") from None
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
