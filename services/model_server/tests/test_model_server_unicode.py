"""Log-likelihoods and offsets on text a byte-level tokenizer splits inside characters: the minus
sign U+2212, accents, an emoji, CJK. Every prompt logprob the server echoes equals ``transformers``'
own (to 1e-4), each token's piece joins into the returned text, and ``text_offset`` is a character
offset into it — for a text prompt, a token-id prompt (vLLM accepts ``echo`` with those) and the
tokens it generates."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from test_model_server_live import client, live_server
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from forge_model_server.service import ModelServer

TEXTS = [
    "x \u2212 2 And",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9, \u00fcber \u00e0 la mode",
    "To be \U0001f600 or not \U0001f44d\U0001f3fd to be",
    "\u4e2d\u6587\u6d4b\u8bd5\uff1a\u6c49\u5b57 and \u65e5\u672c\u8a9e",
    "\u2212\u2212\u2212",
]


@pytest.fixture
def models(tmp_path: Path, tiny_llama: Path) -> Path:
    shutil.copytree(tiny_llama, tmp_path / "models" / "tiny")
    return tmp_path / "models"


@pytest.fixture
async def http(models: Path) -> AsyncIterator[httpx.AsyncClient]:
    server: ModelServer = live_server(models)
    async with client(server) as c:
        yield c
    await server.drain(0)


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> tuple[Any, Any]:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tiny_llama))
    return tokenizer, LlamaForCausalLM.from_pretrained(tiny_llama).eval()


def transformers_logprobs(model: Any, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i ≥ 1, computed by ``transformers`` directly."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    return [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]


def check_offsets(text: str, tokens: list[str], offsets: list[int]) -> None:
    """Each token's piece sits at its offset in ``text``, and the pieces join to it."""
    assert "".join(tokens) == text
    at = 0
    for token, offset in zip(tokens, offsets, strict=True):
        assert offset == at
        assert text[offset : offset + len(token)] == token
        at += len(token)


@pytest.mark.parametrize("text", TEXTS)
async def test_echoed_logprobs_equal_transformers_and_offsets_are_characters(
    http: httpx.AsyncClient, reference: tuple[Any, Any], text: str
) -> None:
    tokenizer, model = reference
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split())  # byte tokens: the case that broke offsets
    body = {"model": "tiny", "max_tokens": 1, "temperature": 0.0, "echo": True, "logprobs": 1}
    expected = transformers_logprobs(model, ids)
    replies = []
    for prompt in (text, ids):  # a text prompt, then the same prompt as token ids (vLLM accepts echo)
        reply = await http.post("/v1/completions", json={**body, "prompt": prompt})
        assert reply.status_code == 200, reply.text
        replies.append(reply.json()["choices"][0])
    for choice in replies:
        lps = choice["logprobs"]
        assert lps["token_logprobs"][0] is None
        assert lps["token_logprobs"][1 : len(ids)] == pytest.approx(expected, abs=1e-4)
        assert choice["text"].startswith(text)
        check_offsets(choice["text"], lps["tokens"], lps["text_offset"])
        n = len(ids)
        assert "".join(lps["tokens"][:n]) == text and lps["text_offset"][n] == len(text)
    assert replies[0]["text"] == replies[1]["text"]


async def test_generated_tokens_offsets_are_characters_also_streamed(
    http: httpx.AsyncClient, reference: tuple[Any, Any]
) -> None:
    """Offsets of generated tokens, whole and streamed, point into the generated text; the model
    is pushed towards byte tokens by a logit bias on the minus sign's bytes."""
    tokenizer, _ = reference
    minus = tokenizer.encode("\u2212")
    body = {
        "model": "tiny",
        "prompt": TEXTS[0],
        "max_tokens": 9,
        "temperature": 0.0,
        "logprobs": 0,
        "logit_bias": {str(t): 100 for t in minus},
        "ignore_eos": True,
    }
    whole = (await http.post("/v1/completions", json=body)).json()["choices"][0]
    assert "\u2212" in whole["text"] or any(ord(c) > 127 for c in whole["text"])
    check_offsets(whole["text"], whole["logprobs"]["tokens"], whole["logprobs"]["text_offset"])
    streamed_text, tokens, offsets = "", [], []
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as reply:
        async for line in reply.aiter_lines():
            if not line.startswith("data: {"):
                continue
            import json

            choice = json.loads(line[6:])["choices"][0]
            streamed_text += choice["text"]
            if choice["logprobs"]:
                tokens += choice["logprobs"]["tokens"]
                offsets += choice["logprobs"]["text_offset"]
    assert streamed_text == whole["text"]
    check_offsets(streamed_text, tokens, offsets)


async def test_echo_of_a_token_id_prompt_without_logprobs_returns_its_text(
    http: httpx.AsyncClient, reference: tuple[Any, Any]
) -> None:
    tokenizer, _ = reference
    ids = tokenizer.encode(TEXTS[3])
    reply = await http.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": ids, "echo": True, "max_tokens": 1, "temperature": 0},
    )
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["text"].startswith(TEXTS[3]) and choice["logprobs"] is None


async def test_a_harness_gets_the_served_tokenizer_without_its_files(
    http: httpx.AsyncClient, reference: tuple[Any, Any]
) -> None:
    """vLLM's tokenizer routes as lm-evaluation-harness's remote tokenizer calls them (no
    ``model``: the one served): the same ids and text as the checkpoint's own tokenizer, and no
    host path in what they or ``/v1/models`` say."""
    tokenizer, _ = reference
    for text in TEXTS:
        ids = (await http.post("/tokenize", json={"prompt": text, "add_special_tokens": False})).json()[
            "tokens"
        ]
        assert ids == tokenizer.encode(text, add_special_tokens=False)
        back = await http.post("/detokenize", json={"tokens": ids})
        assert back.status_code == 200 and back.json()["prompt"] == text
    info = await http.get("/tokenizer_info")
    assert info.status_code == 200 and info.json()["eos_token"] == tokenizer.eos_token
    models = (await http.get("/v1/models")).text
    for shown in (info.text, models):
        assert "/tmp" not in shown and str(Path.home()) not in shown
    bad = await http.post("/detokenize", json={"tokens": [1, 10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    negative = await http.post("/detokenize", json={"tokens": [-1]})
    assert negative.status_code == 400 and negative.json()["error"]["param"].startswith("tokens")
    unknown = await http.get("/tokenizer_info", params={"model": "nope"})
    assert unknown.status_code == 404
