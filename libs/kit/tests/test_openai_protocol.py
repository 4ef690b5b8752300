"""The shared OpenAI request models: refusals by name, content parts, the new sampling ranges."""

from __future__ import annotations

import pytest

from forge_kit import errors
from forge_kit.openai_protocol import (
    ChatCompletionBody,
    CompletionBody,
    check_sampling,
    logit_bias,
    message_text,
    parse,
    refuse_unsupported,
)


def test_parameters_that_ask_for_nothing_pass_and_the_others_are_named() -> None:
    refuse_unsupported({"tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "x": 1})
    for fields in ({"tools": [{"type": "function"}]}, {"response_format": {"type": "json_schema"}}):
        with pytest.raises(errors.UnsupportedParameterError) as refused:
            refuse_unsupported(fields)
        assert refused.value.field == next(iter(fields))


def test_content_parts_join_with_newlines_and_images_are_refused() -> None:
    body = parse(
        ChatCompletionBody,
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
            ],
        },
    )
    assert message_text(body.messages[0], 0) == "a\nb"
    image = parse(
        ChatCompletionBody,
        {
            "model": "m",
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}],
        },
    )
    with pytest.raises(errors.ValidationError) as refused:
        message_text(image.messages[0], 0)
    assert refused.value.field == "messages.0.content.0"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 0}, "n"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"logit_bias": {"1": 100.5}}, "logit_bias"),
        ({"prompt": [-1]}, "prompt"),
        ({"model": "bad name"}, "model"),
    ],
)
def test_out_of_range_values_name_their_parameter(fields: dict[str, object], param: str) -> None:
    with pytest.raises(errors.ValidationError) as refused:
        check_sampling(parse(CompletionBody, {"model": "m", "prompt": "p", **fields}))
    assert refused.value.field.split(".")[0] == param


def test_logit_bias_keys_become_token_ids() -> None:
    assert logit_bias({"5": 1.5, "07": -100}) == {5: 1.5, 7: -100.0}
    with pytest.raises(errors.ValidationError):
        logit_bias({str(i): 1.0 for i in range(301)})


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        ({"model": "m", "prompt": 5}, "prompt"),  # not "prompt.str": the union's member is no field
        ({"model": "m", "prompt": "x", "stop": 5}, "stop"),
        ({"model": "m"}, "prompt"),
        ({"model": "m", "prompt": "x", "logit_bias": {"3": "a"}}, "logit_bias.3"),
    ],
)
def test_a_malformed_field_is_named_by_its_path_in_the_body(raw: dict[str, object], param: str) -> None:
    with pytest.raises(errors.ValidationError) as refused:
        parse(CompletionBody, raw)
    assert refused.value.field == param


def test_a_malformed_message_is_named_by_its_path() -> None:
    with pytest.raises(errors.ValidationError) as refused:
        parse(
            ChatCompletionBody, {"model": "m", "messages": [{"role": "user", "content": 5}, {"content": "x"}]}
        )
    assert refused.value.field == "messages.0.content"
    with pytest.raises(errors.ValidationError) as missing:
        parse(ChatCompletionBody, {"model": "m", "messages": [{"content": "x"}]})
    assert missing.value.field == "messages.0.role"


def test_null_parameters_mean_their_defaults() -> None:
    body = parse(
        CompletionBody, {"model": "m", "prompt": "x", "n": None, "presence_penalty": None, "stream": None}
    )
    assert (body.n, body.presence_penalty, body.stream) == (1, 0.0, False)
    check_sampling(body)
