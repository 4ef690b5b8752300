"""The model server serves what the training library exports: a VLM built and exported by
``forge_training.vlm`` (``build_vlm`` + ``export_vlm``, the contract in ``forge_training/vlm``)
answers an ``image_url`` chat with the tokens transformers generates from the training side's own
prompt ids (``SequenceEncoder.prompt_ids``) and pixels (``images.preprocess``): the server's
template, placeholder expansion and image preprocessing are the trainer's."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from PIL import Image

from forge_kit.http import HttpServer, make_app
from forge_kit.objectstore import ObjectStore
from forge_kit.testing.tiny_llama import save_tiny_llama
from forge_model_server.engine.async_engine import HFEngineLoader
from forge_model_server.engine.core import EngineConfig
from forge_model_server.entrypoints.openai_api import install_openai_api
from forge_model_server.service import ModelDirectory, ModelServer

vlm = pytest.importorskip("forge_training.vlm.model")
TOKEN = "export-token"


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    root = tmp_path_factory.mktemp("vlm-export")
    parent = save_tiny_llama(root / "parent", initializer_range=0.2, seed=3)
    torch.manual_seed(3)
    model, tokenizer = vlm.build_vlm(
        LlamaForCausalLM.from_pretrained(str(parent)),
        Tokenizer.from_file(str(parent / "tokenizer.json")),
        vlm.VisionShape(),
    )
    return Path(
        vlm.export_vlm(model.eval(), tokenizer, vlm.image_spec(model), root / "models" / "shapes-vlm")
    )


def _png(seed: int, size: tuple[int, int]) -> bytes:
    pixels = np.random.RandomState(seed).randint(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


async def test_exported_vlm_served_equals_training_side_generate(exported: Path) -> None:
    from forge_training.vlm.images import preprocess
    from forge_training.vlm.tokens import SequenceEncoder

    loaded = vlm.load_vlm(exported)
    encoder = SequenceEncoder.of(loaded, 512)
    loader = HFEngineLoader(EngineConfig(num_blocks=64, block_size=8), max_waiting=8)
    server = ModelServer(ModelDirectory(ObjectStore(str(exported.parent))), loader=loader)
    app = make_app("model_server")
    install_openai_api(app, server, TOKEN)
    http = HttpServer(app, "127.0.0.1", 0)
    await http.start()
    try:
        async with openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{http.port}/v1", api_key=TOKEN, max_retries=0, timeout=120
        ) as client:
            # 32x32 is the tower's size; 48x40 is resized (bicubic) first, on both sides alike.
            for seed, size in ((0, (32, 32)), (1, (48, 40))):
                data = _png(seed, size)
                question = "What colour is the circle?"
                reply = await client.chat.completions.create(
                    model="shapes-vlm",
                    messages=[
                        {
                            "role": "user",
                            "content": [
                                {
                                    "type": "image_url",
                                    "image_url": {
                                        "url": "data:image/png;base64," + base64.b64encode(data).decode()
                                    },
                                },
                                {"type": "text", "text": question},
                            ],
                        }
                    ],
                    max_tokens=6,
                    temperature=0,
                )
                ids = encoder.prompt_ids(
                    [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
                )
                with torch.no_grad():
                    out = loaded.model.generate(
                        input_ids=torch.tensor([ids]),
                        pixel_values=preprocess(data, loaded.spec)[None],
                        max_new_tokens=6,
                        do_sample=False,
                    )
                want = loaded.tokenizer.decode([int(t) for t in out[0, len(ids) :]], skip_special_tokens=True)
                assert reply.choices[0].message.content == want != ""
                assert reply.usage is not None and reply.usage.prompt_tokens == len(ids)
    finally:
        await server.drain(0)
        await http.stop()
