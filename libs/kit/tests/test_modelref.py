"""ModelRef: the one parser and formatter of ``name:version``."""

from __future__ import annotations

import pytest
from forge.common.v1 import common_pb2
from hypothesis import given
from hypothesis import strategies as st

from forge_kit.modelref import NAME_MAX, TEXT_MAX, VERSION_MAX, ModelRef, label

_ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
_NAMES = st.builds(
    lambda head, tail: head + tail,
    st.sampled_from(_ALNUM),
    st.text(alphabet=_ALNUM + "._-", max_size=NAME_MAX - 1),
)
_VERSIONS = st.one_of(
    st.just(""),
    st.builds(
        lambda head, tail: head + tail,
        st.sampled_from(_ALNUM),
        st.text(alphabet=_ALNUM + "._-", max_size=VERSION_MAX - 1),
    ),
)


@given(_NAMES, _VERSIONS)
def test_format_then_parse_is_the_identity(name: str, version: str) -> None:
    ref = ModelRef(name, version)
    assert ModelRef.parse(str(ref)) == ref
    assert str(ModelRef.parse(str(ref))) == str(ref)


@pytest.mark.parametrize(
    ("text", "name", "version"),
    [
        ("tiny", "tiny", ""),
        ("tiny:3", "tiny", "3"),
        ("run-7f3a:step-120", "run-7f3a", "step-120"),
        ("Qwen2.5-0.5B_instruct:v1.2", "Qwen2.5-0.5B_instruct", "v1.2"),
    ],
)
def test_parse_splits_at_the_colon(text: str, name: str, version: str) -> None:
    ref = ModelRef.parse(text)
    assert (ref.name, ref.version, ref.pinned) == (name, version, bool(version))
    assert str(ref) == text


@given(name=st.from_regex(r"[a-z][a-z0-9_-]{0,20}", fullmatch=True), version=st.sampled_from(["", "v1", "3"]))
def test_label_writes_a_reference_as_a_model_ref_does(name: str, version: str) -> None:
    assert label(name, version) == str(ModelRef(name, version))
    assert label(name, "") == name  # never "name:"


def test_an_empty_version_formats_as_the_bare_name() -> None:
    assert str(ModelRef("tiny")) == "tiny" and str(ModelRef("tiny", "")) == "tiny"
    assert str(ModelRef("tiny").with_version("4")) == "tiny:4"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "invalid model name ''"),
        (":3", "invalid model name ''"),
        ("tiny:", "nothing after ':'"),
        ("a:b:c", "invalid model version 'b:c'"),
        ("../etc", "invalid model name '../etc'"),
        ("org/model", "invalid model name 'org/model'"),
        ("-tiny", "invalid model name '-tiny'"),
        ("tiny:.hidden", "invalid model version '.hidden'"),
        ("tiny model", "invalid model name 'tiny model'"),
        (" tiny", "invalid model name ' tiny'"),
        ("tiny ", "invalid model name 'tiny '"),
        ("tiny:3 ", "invalid model version '3 '"),
        ("tiny: 3", "invalid model version ' 3'"),
        ("\ttiny", "invalid model name"),
        ("   ", "invalid model name '   '"),
        ("::", "invalid model name ''"),
        ("tiny\r\nx-evil: 1", "invalid model name"),
        ("tïny", "invalid model name 'tïny'"),
        ("a" * (NAME_MAX + 1), f"at most {NAME_MAX}"),
        ("a:" + "1" * (VERSION_MAX + 1), f"at most {VERSION_MAX}"),
        ("a" * (TEXT_MAX + 1), f"longer than {TEXT_MAX}"),
    ],
)
def test_invalid_references_are_refused_naming_the_input(text: str, says: str) -> None:
    with pytest.raises(ValueError, match="invalid model reference") as caught:
        ModelRef.parse(text)
    message = str(caught.value)
    assert says in message
    assert len(message) < 400, "a hostile input is shortened in the message"


@pytest.mark.parametrize(("name", "version"), [("", ""), ("a/b", ""), ("ok", "x y"), ("ok", "a:b")])
def test_construction_validates_too(name: str, version: str) -> None:
    with pytest.raises(ValueError, match=r"invalid model (name|version)"):
        ModelRef(name, version)


def test_non_strings_are_refused() -> None:
    with pytest.raises(ValueError, match="must be a string"):
        ModelRef.parse(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="invalid model name int"):
        ModelRef(3, "")  # type: ignore[arg-type]


def test_optional_references_and_proto_messages() -> None:
    assert ModelRef.parse_optional("") is None
    assert ModelRef.parse_optional("tiny:2") == ModelRef("tiny", "2")
    message = common_pb2.ModelRef(name="tiny", version="2")
    assert ModelRef.of(message) == ModelRef("tiny", "2")


def test_matches_leaves_an_open_version_open() -> None:
    served = ModelRef("tiny", "2")
    assert ModelRef("tiny").matches(served)
    assert ModelRef("tiny", "2").matches(served)
    assert not ModelRef("tiny", "3").matches(served)
    assert ModelRef("tiny", "3").matches(ModelRef("tiny"))
    assert not ModelRef("other").matches(served)


def test_the_longest_valid_reference_is_accepted_and_one_more_character_is_not() -> None:
    longest = "n" * NAME_MAX + ":" + "v" * VERSION_MAX
    assert len(longest) == TEXT_MAX and ModelRef.parse(longest) == ModelRef("n" * NAME_MAX, "v" * VERSION_MAX)
    with pytest.raises(ValueError, match=f"longer than {TEXT_MAX}"):
        ModelRef.parse(longest + "v")
