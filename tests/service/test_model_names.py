"""Model names that carry a configuration (`service.requests.model_names`), without a server.

A scaling SPEC must give the very value the body's `pe_scaling` field gives for the same fields
(one union validates both), an attention SPEC the rule `pe_attention` gives; a name's SPECs fill
the field their type names; malformed names and `--alias` entries are refused with the part at
fault, the flag's before the server loads anything.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import TypeAdapter

from service.cli import load_settings
from service.requests.model_names import (
    SCALING_TYPES,
    ModelAliases,
    ModelNameError,
    NamedModel,
    parse_scaling_spec,
)
from service.requests.scaling import SCALING_EXAMPLES, PEScaling
from service.settings import Settings

_BODY_FIELD: TypeAdapter[PEScaling] = TypeAdapter(PEScaling)


def spec_of(fields: dict[str, Any]) -> str:
    """The lab's form of a `pe_scaling` dict (lists as `;`-separated numbers)."""
    values = {key: value for key, value in fields.items() if key != "type"}
    written = ",".join(
        f"{key}={';'.join(map(str, value)) if isinstance(value, list) else value}"
        for key, value in values.items()
    )
    return f"{fields['type']}:{written}" if written else fields["type"]


def no_aliases() -> ModelAliases:
    return ModelAliases()


def resident() -> list[str]:
    return ["tiny-rope", "odd@name"]


def test_the_scaling_types_are_the_body_fields() -> None:
    assert tuple(SCALING_EXAMPLES) == SCALING_TYPES


@pytest.mark.parametrize("scaling_type", list(SCALING_EXAMPLES))
def test_a_scaling_spec_is_the_body_fields_value(scaling_type: str) -> None:
    fields = SCALING_EXAMPLES[scaling_type]
    assert parse_scaling_spec(spec_of(fields)) == _BODY_FIELD.validate_python(fields)


def test_spec_values_are_typed_as_the_body_would_be() -> None:
    scaling = parse_scaling_spec("dynamic:factor=2,dynamic_mode=hf")
    assert scaling == _BODY_FIELD.validate_python({"type": "dynamic", "factor": 2.0, "dynamic_mode": "hf"})
    yarn = parse_scaling_spec(" yarn : factor = 4 , truncate=false ")
    assert yarn == _BODY_FIELD.validate_python({"type": "yarn", "factor": 4.0, "truncate": False})


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ("yarn:factor=0.5", "pe_scaling.factor"),
        ("yarn", "pe_scaling.factor"),
        ("yarn:factr=2,factor=2", "pe_scaling.factr"),
        ("linear:factor=2,factor=3", "pe_scaling.factor is given twice"),
        ("linear:factor", "expected key=value"),
        ("ntk:factor=inf", "pe_scaling.factor"),
        ("warp:factor=2", "pe_scaling.type"),
    ],
)
def test_bad_scaling_specs_name_the_field(spec: str, named: str) -> None:
    with pytest.raises(ModelNameError, match=named.replace(".", r"\.")):
        parse_scaling_spec(spec)


def test_a_name_fills_the_field_its_types_name() -> None:
    name = "tiny-rope@yarn:factor=2,original_max_position_embeddings=64@self_extend:group_size=4,window=16"
    named = no_aliases().resolve(name, resident)
    assert named.model == "tiny-rope"
    assert named.scaling == parse_scaling_spec("yarn:factor=2,original_max_position_embeddings=64")
    assert named.attention == {"type": "self_extend", "group_size": 4, "window": 16}
    swapped = no_aliases().resolve("tiny-rope@rerope:window=8@none", resident)
    assert swapped == NamedModel("tiny-rope", parse_scaling_spec("none"), {"type": "rerope", "window": 8})


def test_plain_names_and_resident_names_with_an_at_sign_pass_as_they_are() -> None:
    aliases = no_aliases()
    assert aliases.resolve(None, resident) == NamedModel(None)
    assert aliases.resolve("tiny-rope", resident) == NamedModel("tiny-rope")
    assert aliases.resolve("odd@name", resident) == NamedModel("odd@name")


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("tiny-rope@yarn:factor=2@ntk:factor=2", "two scaling SPECs"),
        ("tiny-rope@rerope:window=4@dca:chunk_size=8,local_window=2", "two attention SPECs"),
        ("tiny-rope@warp:factor=2", "neither a scaling"),
        ("tiny-rope@", "empty SPEC"),
        ("tiny-rope@@yarn:factor=2", "empty SPEC"),
        ("@yarn:factor=2", "no model name"),
        ("tiny-rope@self_extend:group_size=4,window=0", r"pe_attention\.window"),
        ("tiny-rope@self_extend:window=16", r"pe_attention\.group_size"),
    ],
)
def test_bad_names_are_refused_with_the_part_at_fault(name: str, problem: str) -> None:
    with pytest.raises(ModelNameError, match=problem):
        no_aliases().resolve(name, resident)


def test_aliases_stand_for_their_target_and_take_more_specs() -> None:
    aliases = ModelAliases.from_flags(["long=tiny-rope@yarn:factor=2", "plain=tiny-rope"])
    assert list(aliases.targets) == ["long", "plain"]
    assert aliases.resolve("long", resident) == NamedModel("tiny-rope", parse_scaling_spec("yarn:factor=2"))
    assert aliases.resolve("plain", resident) == NamedModel("tiny-rope")
    more = aliases.resolve("long@rerope:window=8", resident)
    assert more.scaling == parse_scaling_spec("yarn:factor=2")
    assert more.attention == {"type": "rerope", "window": 8}
    with pytest.raises(ModelNameError, match="two scaling SPECs"):
        aliases.resolve("long@ntk:factor=2", resident)


@pytest.mark.parametrize(
    ("flag", "problem"),
    [
        ("long", "expected NAME=TARGET"),
        ("=tiny-rope", "expected NAME=TARGET"),
        ("a@b=tiny-rope", "no '@'"),
        ("long=tiny-rope@yarn:factor=0.5", r"pe_scaling\.factor"),
        ("long=tiny-rope@yarn:factor=2@linear:factor=2", "two scaling SPECs"),
    ],
)
def test_bad_alias_flags_are_refused_naming_the_flag(flag: str, problem: str) -> None:
    with pytest.raises(ModelNameError, match=f"--alias '{flag}': .*{problem}"):
        ModelAliases.from_flags([flag])
    with pytest.raises(ModelNameError, match="given twice"):
        ModelAliases.from_flags(["a=tiny-rope", "a=tiny-rope@none"])


def test_the_cli_refuses_a_bad_alias_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        load_settings(["--alias", "long=tiny-rope@yarn:factor=0.5"])
    assert stopped.value.code == 2
    assert "--alias 'long=tiny-rope@yarn:factor=0.5'" in capsys.readouterr().err
    settings = load_settings(["--alias", "a=m@yarn:factor=2", "--alias", "b=m@rerope:window=4"])
    assert settings.alias == ["a=m@yarn:factor=2", "b=m@rerope:window=4"]


def test_aliases_from_the_environment_are_separated_by_whitespace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PE_SERVE_ALIAS", "a=m@yarn:factor=2,original_max_position_embeddings=64\n b=m@none")
    assert Settings().alias == ["a=m@yarn:factor=2,original_max_position_embeddings=64", "b=m@none"]
