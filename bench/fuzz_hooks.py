"""Schemathesis hooks for `bench/fuzz.py`: the fuzzer's view of `pe_attention` and model names.

`/openapi.json` describes `pe_attention` as a free-form object and `model` as any string: true to
what the server parses first, but a fuzzer reading only that would almost never send a rule of a
known type or a `NAME@SPEC` name, so the code past the parse (the rules' validation, the alias
parser, their effects in a batch) would go untested. Before schemathesis reads the description,
`before_load_schema` puts in its place (for the request bodies, and the `model` query parameter):

- `pe_attention`: one object per type of the SPEC's table, each with its fields, their ranges
  (`service.model.attention_rules`: counts up to 2^22, `leak` in [1, 1024]) and optional `logn`,
  no other field but as `null` (which the server reads as absent); numbers may also be huge
  (2^63, ±10^400, 1e308). So positive cases are rules
  of every type, valid or out of reach of the model (`dca` with `local_window` >= `chunk_size`,
  `rerope` on ALiBi, `streaming` under a dynamic table), and negative ones (wrong types, numbers
  below the minimum or not whole, unknown fields, missing ones) must be refused; `null` stays.
- `model`: any string still, or one of the server's names (`PE_FUZZ_MODELS`: residents and
  `--alias` names), or a curated list of names with SPECs (`ALIAS_EXAMPLES`, valid and malformed),
  or a name built from the pattern `NAME(@SPEC){0,3}` whose SPECs mix every scaling and rule type
  with keys of both and values right, wrong or huge.

Most generated bodies fail on something else first (both `prompt` and `tokens`, a scaling out of
range, a length past the context), which would leave the rules' own paths unreached. So
`map_case` turns half of the positive cases that carry a rule or a `NAME@SPEC` on the inference
routes into plausible requests: a short prompt and a few tokens, one of the server's models when
the generated name is none of them, the rule and the name kept as generated (`plausible`).
Negative cases are sent as generated.

`after_call` counts what was sent by its kind (`pe_attention` type, model-name form) and status,
written as JSON at exit to `PE_FUZZ_TALLY` for the report.

Loaded by `st run` through `SCHEMATHESIS_HOOKS=bench.fuzz_hooks` (`bench.fuzz.run_fuzz` sets it).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import random
import threading
from collections import Counter
from typing import Any

import schemathesis

from pe_runtime.scaling import MAX_FACTOR, MAX_POSITIONS

MODELS_ENV = "PE_FUZZ_MODELS"
TALLY_ENV = "PE_FUZZ_TALLY"
MAX_NAME = 256  # ModelSelection.model's max_length
# What no count or factor may be, each a way a number can be too large: past int64, past a float
# (json writes it, Python reads it exactly), the largest float, just past the bound.
HUGE: tuple[int | float, ...] = (2**63, -(2**63), 10**400, -(10**400), 1e308, MAX_POSITIONS + 1)
# Model names with SPECs: valid, out of range, malformed, and for names that are not there.
ALIAS_EXAMPLES: tuple[str, ...] = (
    "zoo-rope@rerope:window=64",
    "zoo-rope@yarn:factor=4@self_extend:group_size=4,window=64",
    "zoo-rope@linear:factor=8@leaky_rerope:window=32,leak=4.5,logn=256",
    "zoo-rope@none@dca:chunk_size=128,local_window=16",
    "zoo-rope@streaming:sink_tokens=4,window=60",
    "zoo-alibi@streaming:sink_tokens=0,window=8,logn=512",
    "zoo-nope@standard:logn=64",
    "zoo-rope@longrope:short_factor=1;1;1;1;1;1;1;1;1;1;1;1;1;1;1;1,long_factor=4;4;4;4;4;4;4;4;4;4;4;4;4;4;4;4",
    "zoo-rope@dynamic:factor=2@streaming:sink_tokens=4,window=8",
    "zoo-rope@rerope:window=0",
    "zoo-rope@rerope:window=-1",
    "zoo-rope@rerope:window=1.5",
    "zoo-rope@rerope:window=" + "9" * 200,
    "zoo-rope@rerope:window=1e999",
    "zoo-rope@leaky_rerope:window=4,leak=0.5",
    "zoo-rope@dca:chunk_size=8,local_window=8",
    "zoo-rope@standard:logn=1",
    "zoo-rope@self_extend:group_size=4",
    "zoo-rope@self_extend:group_size=4,window=8,window=9",
    "zoo-rope@rerope:window",
    "zoo-rope@rerope:=4",
    "zoo-rope@rerope:window=4,",
    "zoo-rope@rerope:bogus=4",
    "zoo-rope@warp:factor=2",
    "zoo-rope@@rerope:window=4",
    "zoo-rope@",
    "@rerope:window=4",
    "@",
    "zoo-rope@linear:factor=2@ntk:factor=2",
    "zoo-rope@rerope:window=4@streaming:sink_tokens=1,window=4",
    "zoo-rope@linear:factor=true",
    "zoo-rope@linear:factor=hf",
    "zoo-rope@yarn:factor=2,dynamic_mode=hf",
    "zoo-alibi@rerope:window=16",
    "zoo-learned@streaming:sink_tokens=4,window=8",
    "zoo-t5_bias@linear:factor=2",
    "no-such-model@rerope:window=4",
    "zoo-long@ntk:factor=2",
    "zoo-long@rerope:window=32",
    "zoo-window@dca:chunk_size=64,local_window=8",
)
_NAMES = r"(zoo-rope|zoo-alibi|zoo-nope|zoo-learned|zoo-rope_alibi|zoo-long|zoo-window|no-such-model|)"
_TYPES = (
    r"(none|linear|ntk|dynamic|yarn|llama3|longrope|"
    r"standard|self_extend|rerope|leaky_rerope|dca|streaming|warp|)"
)
_KEYS = (
    r"(factor|original_max_position_embeddings|short_factor|long_factor|beta_fast|dynamic_mode|"
    r"group_size|window|leak|chunk_size|local_window|sink_tokens|logn|bogus|)"
)
_VALUES = r"(-?[0-9]{1,4}(\.[0-9]{1,2})?|[0-9](;[0-9]{1,2}){1,15}|true|hf|1e999|9{20,60}|)"
_SPEC = rf"{_TYPES}(:{_KEYS}={_VALUES}(,{_KEYS}={_VALUES}){{0,3}})?"
ALIAS_PATTERN = rf"^{_NAMES}(@{_SPEC}){{0,3}}@?$"


def _count(minimum: int) -> dict[str, Any]:
    """A rule's integer field: a whole number in [minimum, 2^22], or a huge one."""
    return {
        "anyOf": [{"type": "integer", "minimum": minimum, "maximum": MAX_POSITIONS}, {"enum": list(HUGE)}]
    }


def _rule(kind: str, fields: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One type's object. The server reads a `null` field as absent (`parse_attention`), so any
    other property may be there as `null`; a `null` type is the default, `standard`."""
    null = {"type": "null"}
    logn = {"anyOf": [_count(2), null]}
    standard = kind == "standard"
    return {
        "type": "object",
        "properties": {
            "type": {"anyOf": [{"const": kind}, null]} if standard else {"const": kind},
            **fields,
            "logn": logn,
        },
        "required": [*([] if standard else ["type"]), *fields],
        "additionalProperties": null,
    }


def attention_schema(description: str | None = None) -> dict[str, Any]:
    """`pe_attention` as the SPEC's table says it: a rule of one type, or null."""
    leak = {"anyOf": [{"type": "number", "minimum": 1.0, "maximum": MAX_FACTOR}, {"enum": list(HUGE)}]}
    rules = [
        _rule("standard", {}),
        _rule("self_extend", {"group_size": _count(1), "window": _count(1)}),
        _rule("rerope", {"window": _count(1)}),
        _rule("leaky_rerope", {"window": _count(1), "leak": leak}),
        _rule("dca", {"chunk_size": _count(1), "local_window": _count(0)}),
        _rule("streaming", {"sink_tokens": _count(0), "window": _count(1)}),
    ]
    schema: dict[str, Any] = {"anyOf": [*rules, {"type": "null"}]}
    if description:
        schema["description"] = description
    return schema


def model_schema(names: list[str], description: str | None = None) -> dict[str, Any]:
    """`model`: any name as before, the server's own, curated `NAME@SPEC`s, or built ones."""
    anything = {"type": "string", "minLength": 1, "maxLength": MAX_NAME}
    built = {"type": "string", "pattern": ALIAS_PATTERN, "minLength": 1, "maxLength": MAX_NAME}
    known = {"enum": sorted({*names, *ALIAS_EXAMPLES})}
    schema: dict[str, Any] = {"anyOf": [anything, known, built, {"type": "null"}]}
    if description:
        schema["description"] = description
    return schema


def _is_request_model(schema: Any) -> bool:
    """The request bodies' and query's `model`: an optional string of at most 256 characters (a
    response's `model` is a plain string and keeps its schema)."""
    if not isinstance(schema, dict):
        return False
    branches = schema.get("anyOf", [])
    return any(isinstance(b, dict) and b.get("maxLength") == MAX_NAME for b in branches)


def enrich(raw_schema: dict[str, Any], names: list[str]) -> list[str]:
    """Replace `pe_attention` and the request `model`s in an OpenAPI document, in place; returns
    what was replaced (`Component.field`, `path parameter`)."""
    replaced = []
    for component, schema in raw_schema.get("components", {}).get("schemas", {}).items():
        properties = schema.get("properties", {})
        if "pe_attention" in properties:
            properties["pe_attention"] = attention_schema(properties["pe_attention"].get("description"))
            replaced.append(f"{component}.pe_attention")
        if _is_request_model(properties.get("model")):
            properties["model"] = model_schema(names, properties["model"].get("description"))
            replaced.append(f"{component}.model")
    for path, operations in raw_schema.get("paths", {}).items():
        for method, operation in operations.items():
            for parameter in operation.get("parameters", []) if isinstance(operation, dict) else []:
                if parameter.get("name") == "model" and _is_request_model(parameter.get("schema")):
                    parameter["schema"] = model_schema(names, parameter["schema"].get("description"))
                    replaced.append(f"{method.upper()} {path} ?model")
    return replaced


def kinds(body: Any, query: Any) -> list[str]:
    """What a request carried of the new surface: its `pe_attention` type and its model name's
    form; empty when neither."""
    found = []
    if isinstance(body, dict) and body.get("pe_attention") is not None:
        rule = body["pe_attention"]
        kind = rule.get("type", "standard") if isinstance(rule, dict) else None
        label = kind if isinstance(kind, str) and len(kind) <= 16 else "(no type name)"
        if isinstance(rule, dict) and rule.get("logn") is not None:
            label += "+logn"
        found.append(f"pe_attention {label}")
    names = [body.get("model") if isinstance(body, dict) else None, (query or {}).get("model")]
    for name in names:
        if isinstance(name, str):
            if "@" in name:
                found.append("model NAME@SPEC")
            elif name in _SERVER_NAMES:
                found.append("model a server name")
    return found


# A short request per inference route, which `plausible` puts around a generated rule or name.
_PROMPT = "def add(x, y):\n    return"
_BASES: dict[str, dict[str, Any]] = {
    "/generate": {"prompt": _PROMPT},
    "/score": {"prompt": _PROMPT},
    "/v1/completions": {"prompt": _PROMPT},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": _PROMPT}]},
}


def plausible(path: str, body: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """`body`'s rule and model name around a short request for `path` that could run: a few tokens
    (streamed or not, as generated), a scaling kept half the time, one of the server's models
    (`PE_FUZZ_MODELS`) when the generated name is none of them and has no SPEC."""
    new = dict(_BASES[path])
    count = rng.randint(1, 12)
    if path == "/generate":
        new["max_new_tokens"] = count
        if isinstance(body.get("stream"), bool):
            new["stream"] = body["stream"]
    elif path.startswith("/v1/"):
        new["max_tokens"] = count
    for key in ("pe_attention", "model"):
        if key in body:
            new[key] = body[key]
    if "pe_scaling" in body and rng.random() < 0.5:
        new["pe_scaling"] = body["pe_scaling"]
    model = new.get("model")
    if _SERVER_NAMES and (not isinstance(model, str) or ("@" not in model and model not in _SERVER_NAMES)):
        new["model"] = rng.choice(sorted(_SERVER_NAMES))
    return new


_SERVER_NAMES: frozenset[str] = frozenset(filter(None, os.environ.get(MODELS_ENV, "").split(",")))
_TALLY: Counter[str] = Counter()
_LOCK = threading.Lock()


@schemathesis.hook
def before_load_schema(context: schemathesis.HookContext, raw_schema: dict[str, Any]) -> None:
    enrich(raw_schema, sorted(_SERVER_NAMES))


@schemathesis.hook
def map_case(context: schemathesis.HookContext, case: Any) -> Any:
    meta = case.meta
    body = case.body
    if meta is None or meta.generation.mode.is_negative or not isinstance(body, dict):
        return case
    path = case.operation.path
    name = body.get("model")
    if path not in _BASES or (
        body.get("pe_attention") is None and not (isinstance(name, str) and "@" in name)
    ):
        return case
    seed = hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).digest()
    rng = random.Random(seed)
    if rng.random() < 0.5:
        case.body = plausible(path, body, rng)
    return case


@schemathesis.hook
def after_call(context: schemathesis.HookContext, case: Any, response: Any) -> None:
    status = f"{response.status_code // 100}xx"
    labels = kinds(case.body, case.query)
    with _LOCK:
        for label in labels:
            _TALLY[f"{label}|{status}"] += 1
            if status == "2xx":
                _TALLY[f"{label}|200 {case.operation.path}"] += 1


def _write_tally() -> None:
    path = os.environ.get(TALLY_ENV)
    if path:
        with open(path, "w") as file:
            json.dump(dict(_TALLY), file)


atexit.register(_write_tally)
