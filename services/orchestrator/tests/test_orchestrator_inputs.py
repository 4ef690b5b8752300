"""Every workflow's input goes through the one converter of the front door
(:func:`forge_orchestrator.service.parse_input`): for each kind the API starts, every field of its
dataclass survives the trip through a protobuf ``Struct`` (as ``StartWorkflow`` receives it: every
number a float), and a missing, unknown or mistyped field is refused as ``input.<field>`` — never
as the dataclass's own ``TypeError``. Then the training typo of ``forge workflows start training``,
refused by a real orchestrator with the catalogue's nearest key before anything is queued."""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any, get_args, get_origin, get_type_hints

import pytest
from google.protobuf import json_format, struct_pb2
from typer.testing import CliRunner

from forge_kit import errors
from forge_orchestrator.cli import app as cli_app
from forge_orchestrator.service import KINDS, parse_input

#: Set by the orchestrator from the caller's token, refused in any input before parsing.
CALLER = "caller"


def _sample(hint: Any) -> Any:
    """A value of type ``hint`` for a field without a default."""
    origin = get_origin(hint)
    if hint is str:
        return "x"
    if hint is bool:
        return True
    if hint is int:
        return 3
    if hint is float:
        return 0.5
    if origin is list:
        return [_sample(get_args(hint)[0])]
    if origin is tuple:
        return (_sample(get_args(hint)[0]),)
    if origin is dict:
        return {"k": _sample(get_args(hint)[1])}
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return _required(hint)
    raise AssertionError(f"no sample for {hint!r}")


def _required(cls: type) -> Any:
    """An instance of ``cls`` with its required fields sampled and the rest at their defaults."""
    hints = get_type_hints(cls)
    values = {
        f.name: _sample(hints[f.name])
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    return cls(**values)


def _through_struct(value: Any) -> dict[str, Any]:
    """``value`` (a dataclass) as ``StartWorkflow`` receives it: JSON through a ``Struct``."""
    data = {k: v for k, v in dataclasses.asdict(value).items() if k != CALLER}
    struct = struct_pb2.Struct()
    struct.update(json.loads(json.dumps(data)))
    decoded: dict[str, Any] = json_format.MessageToDict(struct)
    return decoded


def _fields(cls: type) -> list[tuple[str, Any, bool]]:
    """(name, type, required) of every field a caller may set."""
    hints = get_type_hints(cls)
    return [
        (
            f.name,
            hints[f.name],
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
        )
        for f in dataclasses.fields(cls)
        if f.name != CALLER
    ]


def _wrong(hint: Any) -> object:
    """A JSON value that is not of type ``hint``."""
    if hint is str:
        return 3
    if hint in (int, float):
        return "3"
    if hint is bool:
        return "true"
    return "x"  # a list, a mapping or a section given as a string


FIELDS = [(kind, *field) for kind in sorted(KINDS) for field in _fields(KINDS[kind].input)]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_field_survives_the_struct(kind: str) -> None:
    """Each kind's input, its required fields set and the rest at their defaults, parses back
    equal after the Struct trip (integers that arrived as floats, lists as tuples, sections)."""
    cls = KINDS[kind].input
    value = _required(cls)
    parsed = parse_input(cls, _through_struct(value))
    assert parsed == value
    assert repr(parsed) == repr(value)  # 3, not 3.0: each value of its field's own type


@pytest.mark.parametrize(("kind", "name", "hint", "required"), FIELDS)
def test_a_mistyped_field_is_named(kind: str, name: str, hint: Any, required: bool) -> None:
    cls = KINDS[kind].input
    data = {**_through_struct(_required(cls)), name: _wrong(hint)}
    with pytest.raises(errors.ValidationError) as caught:
        parse_input(cls, data)
    assert caught.value.field == f"input.{name}"
    assert "must be" in str(caught.value)


@pytest.mark.parametrize(("kind", "name"), [(kind, name) for kind, name, _, required in FIELDS if required])
def test_a_missing_field_is_named(kind: str, name: str) -> None:
    cls = KINDS[kind].input
    data = _through_struct(_required(cls))
    del data[name]
    with pytest.raises(errors.ValidationError) as caught:
        parse_input(cls, data)
    assert str(caught.value) == f"input.{name}: required"


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_an_unknown_field_is_named(kind: str) -> None:
    cls = KINDS[kind].input
    with pytest.raises(errors.ValidationError) as caught:
        parse_input(cls, {**_through_struct(_required(cls)), "colour": "red"})
    assert caught.value.field == "input.colour"
    assert f"is not a field of {cls.__name__}" in str(caught.value)


def test_a_section_names_its_own_fields() -> None:
    """A nested section (``cpt``'s search space) is parsed by the same rules, path and all."""
    cls = KINDS["cpt"].input
    data = _through_struct(_required(cls))
    del data["search"]["peak_lrs"]
    with pytest.raises(errors.ValidationError) as caught:
        parse_input(cls, data)
    assert str(caught.value) == "input.search.peak_lrs: required"
    data["search"]["peak_lrs"] = [1e-4, "fast"]
    with pytest.raises(errors.ValidationError) as caught:
        parse_input(cls, data)
    assert caught.value.field == "input.search.peak_lrs[1]"


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_the_cli_refuses_a_training_typo_with_the_nearest_key(shared_orchestrator: Any) -> None:
    env = {
        "FORGE_CLI_ORCHESTRATOR_TARGET": shared_orchestrator.target,
        "FORGE_CLI_ORCHESTRATOR_TOKEN": shared_orchestrator.token,
    }
    workflow_id = f"training-typo-{uuid.uuid4().hex[:8]}"
    data = {"team": "typo", "recipe": "smoke", "gpu_type": "SIM", "overrides": ["optim.lrr=1e-3"]}
    refused = CliRunner().invoke(
        cli_app, ["start", "training", "--id", workflow_id, "--input", json.dumps(data)], env=env
    )
    assert refused.exit_code == 1 and "INVALID_ARGUMENT" in refused.output, refused.output
    assert "input.overrides[0]" in refused.output, refused.output
    assert "did you mean 'optim.lr'?" in refused.output, refused.output
    # Nothing was started, so nothing was queued.
    absent = CliRunner().invoke(cli_app, ["get", workflow_id], env=env)
    assert absent.exit_code == 1 and "NOT_FOUND" in absent.output, absent.output
