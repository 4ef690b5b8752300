"""The VLM: placeholders, the forward with images at them, the export and the training stages."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoProcessor, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from forge_kit.objectstore import ObjectStore
from forge_training import recipes
from forge_training.data import EOT, train_tokenizer
from forge_training.schema import RecipeError
from forge_training.train import RunContext, train
from forge_training.validation import validate
from forge_training.vlm import world
from forge_training.vlm.dataset import WorldSize, write_world
from forge_training.vlm.images import preprocess
from forge_training.vlm.model import (
    CHAT_TEMPLATE,
    VisionShape,
    build_vlm,
    export_vlm,
    image_spec,
    load_vlm,
    render_chat,
    sincos_positions,
)
from forge_training.vlm.parent import load_vlm_parent
from forge_training.vlm.shards import Sample
from forge_training.vlm.tokens import SequenceEncoder, collate

SHAPE = VisionShape(
    image_size=16, patch_size=8, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2
)


def _lm(tok: Tokenizer) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def vlm() -> tuple:
    tok = train_tokenizer(world.world_text(0, 60), 300)
    lm = _lm(tok)
    model, tok2 = build_vlm(lm, tok, SHAPE)
    model.eval()
    enc = SequenceEncoder(
        tok2, model.config.image_token_id, model.config.image_seq_length, image_spec(model), 96
    )
    return lm, model, tok2, enc


def _png(scene_index: int) -> bytes:
    return world.png(world.render(world.scenes(1, 10)[scene_index], 16))


def test_image_token_expands_to_one_position_per_patch(vlm: tuple) -> None:
    lm, model, tok, enc = vlm
    assert model.config.image_seq_length == 4 == SHAPE.image_seq_length
    assert tok.token_to_id("<image>") == model.config.image_token_id == lm.config.vocab_size
    prompt = enc.prompt_ids(world.chat("What colour is the circle?", "red")[:1])
    assert prompt.count(model.config.image_token_id) == 4
    first = prompt.index(model.config.image_token_id)
    assert prompt[first : first + 4] == [model.config.image_token_id] * 4
    doc = Sample(
        "d",
        "document",
        segments=[{"text": "One:"}, {"image": 0}, {"text": " two:"}, {"image": 1}],
        images=[_png(0), _png(1)],
    )
    row = enc.encode(doc, "d")
    assert row.ids.count(model.config.image_token_id) == 8 and row.pixels.shape == (2, 3, 16, 16)
    assert all(
        lab == -100 for i, lab in zip(row.ids, row.labels, strict=True) if i == model.config.image_token_id
    )
    chat = enc.encode(
        Sample("c", "chat", messages=world.chat("Where is it?", "top left"), images=[_png(0)]), "c"
    )
    supervised = [t for t, lab in zip(chat.ids, chat.labels, strict=True) if lab != -100]
    assert tok.decode(supervised, skip_special_tokens=False) == f" top left{EOT}\n"


def test_chat_template_jinja_equals_python(vlm: tuple, tmp_path: Path) -> None:
    _, model, tok, _ = vlm
    export_vlm(model, tok, image_spec(model), tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert hf.chat_template == CHAT_TEMPLATE
    conversations: list[list[dict[str, Any]]] = [
        world.chat("How many shapes are there?", "two"),
        [{"role": "user", "content": "plain text"}, {"role": "assistant", "content": "ok"}],
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}],
            }
        ],
    ]
    for messages in conversations:
        for gen in (False, True):
            assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen) == render_chat(
                messages, gen
            )


def test_forward_puts_the_image_at_its_placeholders(vlm: tuple) -> None:
    _, model, _, enc = vlm
    rows = [
        enc.encode(
            Sample("a", "chat", messages=world.chat("What colour is the square?", "red"), images=[_png(i)]),
            "a",
        )
        for i in (0, 1)
    ]
    batch = collate(rows, enc.eot)
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            pixel_values=batch["pixel_values"],
        ).logits
        swapped = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            pixel_values=batch["pixel_values"].flip(0),
        ).logits
        image_features = model.model.get_image_features(pixel_values=batch["pixel_values"][:1])
    first = rows[0].ids.index(model.config.image_token_id)
    # Causal: positions before the image do not see it; positions from it on do.
    assert torch.allclose(logits[0, :first], swapped[0, :first])
    assert not torch.allclose(logits[0, first:], swapped[0, first:])
    assert torch.allclose(logits[1, :first], swapped[1, :first])
    feats = image_features.pooler_output if hasattr(image_features, "pooler_output") else image_features
    flat = torch.cat(list(feats)) if isinstance(feats, (list, tuple)) else feats.reshape(-1, feats.shape[-1])
    assert flat.shape[0] == model.config.image_seq_length  # CLS dropped: one feature per patch
    mismatched = batch["input_ids"][:1].clone()
    mismatched[0, first] = enc.eot  # one placeholder fewer than the image's patches
    with pytest.raises(ValueError):
        model(input_ids=mismatched, pixel_values=batch["pixel_values"][:1])


def test_export_reloads_equal_and_matches_the_hf_processor(vlm: tuple, tmp_path: Path) -> None:
    _, model, tok, enc = vlm
    export_vlm(model, tok, image_spec(model), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlavaForConditionalGeneration"]
    assert config["image_token_index"] == model.config.image_token_id
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as handle:
        prefixes = {".".join(k.split(".")[:2]) for k in handle.keys()}  # noqa: SIM118 - safe_open is not iterable
    assert prefixes == {
        "vision_tower.vision_model",
        "multi_modal_projector.linear_1",
        "multi_modal_projector.linear_2",
        "language_model.model",
        "language_model.lm_head",
    }
    loaded = load_vlm(tmp_path)
    rows = [
        enc.encode(
            Sample("a", "chat", messages=world.chat("Count the shapes.", "one"), images=[_png(2)]), "a"
        )
    ]
    batch = collate(rows, enc.eot)
    args = {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        "pixel_values": batch["pixel_values"],
    }
    with torch.no_grad():
        assert torch.equal(model(**args).logits, loaded.model(**args).logits)
    text = render_chat(world.chat("Where is the red circle?", "top left"))
    assert loaded.tokenizer.encode(text).ids == tok.encode(text).ids and loaded.spec == image_spec(model)
    assert loaded.tokenizer.get_vocab() == tok.get_vocab()
    processor = AutoProcessor.from_pretrained(tmp_path)
    messages = world.chat("Count the shapes.", "one")[:1]
    out = processor(
        text=render_chat(messages, add_generation_prompt=True),
        images=[Image.open(io.BytesIO(_png(2)))],
        return_tensors="pt",
    )
    assert out["input_ids"][0].tolist() == enc.prompt_ids(messages)
    assert torch.allclose(out["pixel_values"][0], preprocess(_png(2), loaded.spec), atol=1e-6)


def test_vision_positions_start_as_large_as_patches_and_tell_cells_apart(vlm: tuple) -> None:
    _, model, _, enc = vlm
    emb = model.model.vision_tower.embeddings
    table = emb.position_embedding.weight.detach()
    assert torch.equal(table[1:], sincos_positions(2, SHAPE.hidden_size)) and not table[0].any()
    pixels = preprocess(_png(0), enc.spec)[None]
    with torch.no_grad():
        patches = emb.patch_embedding(pixels).flatten(2).transpose(1, 2)[0]
    gaps = torch.cdist(table[1:], table[1:])
    # every pair of cells apart by at least a third of a patch embedding's norm (CLIP's own
    # std-0.02 init: a few per cent), so the projected patches say where they are
    assert gaps[~torch.eye(4, dtype=torch.bool)].min() > patches.norm(dim=-1).mean() / 3
    with pytest.raises(ValueError, match="multiple of 4"):
        sincos_positions(2, 30)


def test_curriculum_stages_chain_train_and_resume(tmp_path: Path) -> None:
    folder = tmp_path / "world"
    write_world(
        folder, 0, WorldSize(captions=48, documents=16, chats=48, text_scenes=200, eval_items=8, per_shard=20)
    )
    store = ObjectStore(str(tmp_path / "objects"))
    tiny = {
        "max_steps": 4,
        "optim.warmup_steps": 1,
        "global_batch_size": 4,
        "micro_batch_size": 2,
        "eval_batches": 1,
    }

    def run(name: str, run_id: str, **over: object) -> Path:
        config = recipes.build(name, {**tiny, **over})
        ctx = RunContext(run_id=run_id, run_dir=tmp_path / run_id, store=store, cache_dir=tmp_path / "cache")
        result = train(config, ctx)
        assert result.outcome == "succeeded" and result.export_dir is not None
        return result.export_dir

    lm = run("vlm_world_lm", "lm", **{"data.corpus": str(folder / "text.txt"), "data.seq_len": 32})
    vlm_over = {"vlm.world": str(folder), "vlm.eval_items": 4, "vlm.max_new_tokens": 3}
    with pytest.raises(RecipeError, match=r"init\.parent"):
        validate(recipes.build("vlm_interleave", {"init.parent": str(lm), **vlm_over}), 1)
    projector_only = run(
        "vlm_align", "align_p", **{"init.parent": str(lm), **vlm_over, "vlm.align_lm": False}
    )
    frozen_lm = LlamaForCausalLM.from_pretrained(lm)
    after_p = load_vlm_parent(str(projector_only)).model
    assert torch.equal(after_p.lm_head.weight[:-1], frozen_lm.lm_head.weight)  # LLaVA's stage 1
    aligned = run("vlm_align", "align", **{"init.parent": str(lm), **vlm_over})
    after = load_vlm_parent(str(aligned)).model
    assert not torch.equal(after.lm_head.weight[:-1], frozen_lm.lm_head.weight)  # the recipe: LM too
    assert torch.equal(  # the tower frozen either way
        after.model.vision_tower.embeddings.patch_embedding.weight,
        after_p.model.vision_tower.embeddings.patch_embedding.weight,
    )
    joint = run("vlm_joint", "joint", **{"init.parent": str(lm), **vlm_over})
    joint_table = load_vlm_parent(str(joint)).model.model.vision_tower.embeddings.position_embedding
    fresh = sincos_positions(4, joint_table.weight.size(1))
    assert torch.allclose(joint_table.weight[1:], fresh, atol=0.05)  # from scratch: the same table
    inter = run("vlm_interleave", "inter", **{"init.parent": str(aligned), **vlm_over})
    tower_after = load_vlm_parent(str(inter)).model.model.vision_tower.state_dict()
    tower_before = after.model.vision_tower.state_dict()
    assert all(torch.equal(tower_after[k], tower_before[k]) for k in tower_before)  # frozen tower
    unfrozen = run(
        "vlm_interleave", "inter_tv", **{"init.parent": str(aligned), **vlm_over, "vlm.train_vision": True}
    )
    moved = load_vlm_parent(str(unfrozen)).model.model.vision_tower.state_dict()
    assert not all(torch.equal(moved[k], tower_before[k]) for k in tower_before)
    manifest = tmp_path / "objects" / "checkpoints" / "inter" / "step-00000004" / "manifest.json"
    assert load_vlm_parent(str(manifest)).model.config.image_seq_length == 16  # 32 px, 8 px patches
    # Stage 3 killed after step 2 and restarted: it resumes from its checkpoint.
    over = {**tiny, "init.parent": str(inter), **vlm_over, "checkpoint.interval_steps": 2}
    config = recipes.build("vlm_instruct", over)
    ctx = RunContext(
        run_id="instr",
        run_dir=tmp_path / "instr",
        store=store,
        cache_dir=tmp_path / "cache",
        stop_after_step=3,
    )
    assert train(config, ctx).outcome == "stopped"
    resumed = train(
        config,
        RunContext(run_id="instr", run_dir=tmp_path / "instr", store=store, cache_dir=tmp_path / "cache"),
    )
    assert resumed.outcome == "succeeded" and resumed.step == 4
    assert sorted(resumed.losses) == [3, 4]  # from the step-2 checkpoint, not from the start
    assert 0.0 <= resumed.eval_metrics["val_vqa_accuracy"] <= 1.0
