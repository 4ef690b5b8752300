"""The kit's input checks: each refusal is a ValidationError naming the field."""

from __future__ import annotations

import math

import pytest
from pydantic import BaseModel, ValidationError

from forge_kit import errors
from forge_kit.validate import (
    MAX_SEED,
    FiniteFloat,
    PrintableName,
    Seed,
    check_finite,
    check_int,
    check_labels,
    check_path,
    check_printable_name,
    check_seed,
    check_text,
    json_depth_error,
    loads_json,
)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "1", None, True])
def test_check_finite_refuses_what_is_not_a_finite_number(value: object) -> None:
    with pytest.raises(errors.ValidationError) as refused:
        check_finite("weight", value)
    assert refused.value.field == "weight"


def test_check_finite_bounds() -> None:
    assert check_finite("x", 0, low=0) == 0.0
    assert check_finite("x", 2, high=2) == 2.0
    with pytest.raises(errors.ValidationError):
        check_finite("x", 0, low=0, low_open=True)
    with pytest.raises(errors.ValidationError):
        check_finite("x", 2.5, high=2)


def test_integers_and_seeds() -> None:
    assert check_int("n", 3, 0, 3) == 3
    assert check_seed("seed", MAX_SEED) == MAX_SEED
    for bad in (MAX_SEED + 1, 2**64, -1, True, 1.0):
        with pytest.raises(errors.ValidationError) as refused:
            check_seed("seed", bad)
        assert refused.value.field == "seed"


@pytest.mark.parametrize("name", ["", "a b", "a\r\nb", "a\x00", "a\x7f", "é", "x" * 257, 3, None])
def test_names_unfit_for_a_header_are_refused(name: object) -> None:
    with pytest.raises(errors.ValidationError) as refused:
        check_printable_name("model", name)
    assert refused.value.field == "model"


def test_names_fit_for_a_header_pass() -> None:
    for name in ("llama", "meta-llama/Llama-3:v2", "x" * 256):
        assert check_printable_name("model", name) == name


@pytest.mark.parametrize("path", ["", "/a\x00b", "/a\nb", "/" + "a" * 256, "/a" * 3000])
def test_paths_the_os_cannot_take_are_refused(path: str) -> None:
    with pytest.raises(errors.ValidationError):
        check_path("path", path)


def test_text_and_labels() -> None:
    assert check_text("uri", "s3://b/m", 16) == "s3://b/m"
    with pytest.raises(errors.ValidationError):
        check_text("uri", "s3://" + "x" * 20, 16)
    assert check_labels("labels", {"team": "nlp"}) == {"team": "nlp"}
    for labels in (
        {f"k{i}": "v" for i in range(65)},
        {"": "v"},
        {"k" * 64: "v"},
        {"k": "v" * 257},
        {"k": "\n"},
    ):
        with pytest.raises(errors.ValidationError) as refused:
            check_labels("labels", labels)
        assert refused.value.field.startswith("labels")
    # A bad key is never echoed in the field name (it travels in gRPC metadata).
    for key in ("\x1f", "a\r\nb", "é", "a b"):
        with pytest.raises(errors.ValidationError) as refused:
            check_labels("labels", {key: "v"})
        assert refused.value.field == "labels"


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_loads_json_refuses_non_finite_literals(literal: str) -> None:
    with pytest.raises(errors.ValidationError) as refused:
        loads_json(f'{{"temperature": {literal}}}')
    assert refused.value.field == "body" and literal.lstrip("-") in refused.value.message


def test_loads_json_reads_standard_json_and_names_malformed_bodies() -> None:
    assert loads_json(b'{"a": [1, 2.5, null]}') == {"a": [1, 2.5, None]}
    with pytest.raises(errors.ValidationError):
        loads_json(b"{")


class _Body(BaseModel):
    model: PrintableName
    temperature: FiniteFloat = 1.0
    seed: Seed | None = None


def test_the_pydantic_types_hold_the_same_rules() -> None:
    assert _Body(model="llama", temperature=0.5, seed=MAX_SEED).seed == MAX_SEED
    for bad in (
        {"model": "a\r\nb"},
        {"model": "x" * 257},
        {"model": "m", "temperature": math.nan},
        {"model": "m", "temperature": math.inf},
        {"model": "m", "seed": MAX_SEED + 1},
        {"model": "m", "seed": -1},
    ):
        with pytest.raises(ValidationError):
            _Body(**bad)  # type: ignore[arg-type]


def test_json_nested_past_the_limit_is_refused_naming_it() -> None:
    deep = "[" * 100_000 + "]" * 100_000
    assert "deeper than 64 levels" in json_depth_error(deep)
    assert json_depth_error("[" * 64 + "]" * 64) == ""
    assert json_depth_error('{"a":' * 65 + "1" + "}" * 65) != ""
    # Brackets inside strings (escaped quotes included) are text, not nesting.
    assert json_depth_error('{"text": "' + "[{" * 5000 + '\\" [[ "}') == ""
    for body in (deep, "[" * 65 + "]" * 65):
        with pytest.raises(errors.ValidationError, match="deeper than 64 levels"):
            loads_json(body)
    assert loads_json("[" * 64 + "]" * 64) is not None
