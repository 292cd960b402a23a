"""Rendering a model's chat template the way transformers' `apply_chat_template` does.

The template is Jinja2 from `tokenizer_config.json`; transformers renders it in a sandboxed
environment with `trim_blocks` and `lstrip_blocks`, the loop-control extension, a `tojson` that
keeps non-ASCII text, and the globals `raise_exception` and `strftime_now`; the special tokens
(`bos_token`, `eos_token`, ...) and `add_generation_prompt` are variables. Doing the same here
lets a chat request reach the prompt transformers would build, without transformers at run time.
The rendered text already holds the special tokens the template wants, so it is encoded without
adding any (as `apply_chat_template(tokenize=True)` does).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from service.engine.types import TokenizerInfo
from service.requests.errors import ErrorKind, RequestError


class _TemplateRaised(TemplateError):
    """What the template's own `raise_exception(...)` raises (a message for the user)."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys)


def _strftime_now(format_: str) -> str:
    return datetime.now().strftime(format_)


@lru_cache(maxsize=32)
def _compiled(template: str) -> Any:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment.from_string(template)


def render_chat(
    model: str,
    tokenizer: TokenizerInfo,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text; a 422 (400 under /v1) naming the model if it has no template or it fails."""
    if tokenizer.chat_template is None:
        raise RequestError(
            ErrorKind.INVALID,
            f"Model {model!r} has no chat template (no chat_template in its tokenizer_config.json); "
            "use /v1/completions with a prompt instead.",
            param="model",
        )
    special = {
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": tokenizer.pad_token,
    }
    try:
        rendered: str = _compiled(tokenizer.chat_template).render(
            messages=[dict(message) for message in messages],
            add_generation_prompt=add_generation_prompt,
            **{name: value for name, value in special.items() if value is not None},
        )
    except _TemplateRaised as error:
        raise RequestError(
            ErrorKind.INVALID,
            f"The chat template of {model!r} refused the messages: {error}",
            param="messages",
        ) from error
    except Exception as error:  # a template meeting data it cannot handle is a bad request, not a bug
        raise RequestError(
            ErrorKind.INVALID, f"The chat template of {model!r} failed: {error}", param="messages"
        ) from error
    return rendered
