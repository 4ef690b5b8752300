"""The VLM data path: the synthetic world, shards, the reader's mappings, bad items."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from forge_training import recipes
from forge_training.data import MixtureSampler, train_tokenizer
from forge_training.objectives.vlm import stage_sources
from forge_training.schema import RecipeError
from forge_training.validation import validate
from forge_training.vlm import world
from forge_training.vlm.dataset import WorldSize, write_world
from forge_training.vlm.images import ImageError, ImageSpec, decode, preprocess
from forge_training.vlm.model import with_image_token
from forge_training.vlm.shards import ItemError, Sample, ShardReader, ShardWriter, shard_files
from forge_training.vlm.tokens import SequenceEncoder, encode_batch

SMALL = WorldSize(captions=40, documents=10, chats=40, text_scenes=40, eval_items=12, per_shard=16)


def _png(colour: tuple[int, int, int] = (200, 10, 10), size: int = 32) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(out, format="PNG")
    return out.getvalue()


def test_world_is_a_function_of_its_seed(tmp_path: Path) -> None:
    a, b = world.scenes(3, 20), world.scenes(3, 20)
    assert a == b and a != world.scenes(4, 20)
    assert [world.png(world.render(s)) for s in a] == [world.png(world.render(s)) for s in b]
    one = write_world(tmp_path / "one", 7, SMALL)
    two = write_world(tmp_path / "two", 7, SMALL)
    assert one["hash"] == two["hash"]
    assert write_world(tmp_path / "three", 8, SMALL)["hash"] != one["hash"]


def test_templates_split_and_answers_follow_the_scene() -> None:
    norm = world._norm
    all_held_norm = [norm(t) for _, h in world.TEMPLATES.values() for t in h]
    for qtype, (train, held) in world.TEMPLATES.items():
        dev = world.DEV_TEMPLATES[qtype]
        assert len(train) >= 30 and len(dev) >= 4 and held == world.HELD_OUT[qtype]
        assert not set(train) & set(held) and not set(dev) & set(held) and not set(train) & set(dev)
        for text in train + dev:  # no paraphrase duplicates or wraps a held-out wording
            assert not any(h in norm(text) or norm(text) in h for h in all_held_norm), text
    dev_items = world.vqa_items(0, 40, held_out=False, dev=True)
    assert {q.template for _, q in dev_items} <= {t for d in world.DEV_TEMPLATES.values() for t in d}
    held_out = world.vqa_items(0, 40, held_out=True)
    trained = world.vqa_items(0, 40, held_out=False)
    all_held = {t for _, h in world.TEMPLATES.values() for t in h}
    assert {q.template for _, q in held_out} <= all_held
    assert not {q.template for _, q in trained} & all_held
    for scene, q in held_out:
        if q.qtype == "count":
            assert q.answer == world.NUMBERS[len(scene.things)]
        if q.qtype == "colour":
            assert q.answer in {t.colour for t in scene.things}
    assert "Tell me the colour" not in world.world_text(0, 200)  # held-out wording never trained on


def test_shards_round_trip_and_resume(tmp_path: Path) -> None:
    samples = [
        Sample(
            f"k{i:03d}",
            "caption",
            segments=[{"image": 0}, {"text": f" caption {i}"}],
            images=[_png()],
            meta={"i": i},
        )
        for i in range(10)
    ]
    with ShardWriter(tmp_path, "s", per_shard=4) as writer:
        for s in samples:
            writer.write(s)
    assert [p.name for p in shard_files(tmp_path)] == ["s-000000.tar", "s-000001.tar", "s-000002.tar"]
    reader = ShardReader(shard_files(tmp_path))
    assert len(reader) == 10
    assert [reader.read(i) for i in range(10)] == samples
    assert reader.name(5) == "s-000001.tar:k005"
    # Resumable position: a sampler restored from its state continues with the same items.
    first = MixtureSampler([len(reader)], [1.0], 4, seed=1)
    for _ in range(3):
        first.next_step(0, 1)
    state = json.loads(json.dumps(first.state_dict()))
    expected = [first.next_step(0, 1) for _ in range(4)]
    second = MixtureSampler([len(reader)], [1.0], 4, seed=1)
    second.load_state_dict(state)
    assert [second.next_step(0, 1) for _ in range(4)] == expected


def test_laion_and_obelics_layouts_read_through_the_same_reader(tmp_path: Path) -> None:
    with tarfile.open(tmp_path / "laion-000000.tar", "w") as tar:
        for name, data in (
            ("000001.jpg", _png()),  # the reader sniffs the bytes, not the extension
            ("000001.txt", b"a red square"),
            ("000001.json", b'{"url": "http://example/x.jpg"}'),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    sample = ShardReader([tmp_path / "laion-000000.tar"]).read(0)
    assert (sample.kind, sample.segments, sample.meta) == (
        "caption",
        [{"image": 0}, {"text": "a red square"}],
        {"url": "http://example/x.jpg"},
    )
    table = pa.table(
        {"texts": [["Intro.", None, "After."]], "images": [[None, {"bytes": _png(), "path": None}, None]]}
    )
    pq.write_table(table, tmp_path / "obelics-000000.parquet")
    urls = pa.table({"texts": [[None, "url only"]], "images": [["http://x/y.png", None]]})
    pq.write_table(urls, tmp_path / "obelics-000001.parquet")
    reader = ShardReader(shard_files(tmp_path))
    assert len(reader) == 3  # the LAION tar's sample, then one row per Parquet file
    doc = reader.read(1)
    assert doc.kind == "document" and doc.segments == [{"text": "Intro."}, {"image": 0}, {"text": "After."}]
    assert doc.images == [_png()]
    with pytest.raises(ItemError, match=r"obelics-000001.parquet:row 0: position 0: an image URL"):
        reader.read(2)


def test_images_are_decoded_limited_and_normalised() -> None:
    spec = ImageSpec(16)
    pixels = preprocess(_png((255, 0, 0), 40), spec)
    assert pixels.shape == (3, 16, 16)
    assert float(pixels[0, 0, 0]) == pytest.approx((1.0 - spec.mean[0]) / spec.std[0], rel=1e-5)
    assert bool((preprocess(_png(), spec) == preprocess(_png(), spec)).all())
    with pytest.raises(ImageError, match="corrupt or truncated"):
        decode(_png()[:-30])  # the header reads, the pixels do not
    with pytest.raises(ImageError, match="supported format"):
        bmp = io.BytesIO()
        Image.new("RGB", (4, 4)).save(bmp, format="BMP")
        decode(bmp.getvalue())
    with pytest.raises(ImageError, match="byte limit"):
        decode(_png(), max_bytes=10)
    with pytest.raises(ImageError, match="pixels are accepted"):
        decode(_png(size=64), max_pixels=100)


def test_bad_items_are_named_and_the_rest_kept(tmp_path: Path) -> None:
    good = Sample("good", "caption", segments=[{"image": 0}, {"text": " fine"}], images=[_png()])
    cases = {
        "corrupt": Sample(
            "corrupt", "caption", segments=[{"image": 0}, {"text": " x"}], images=[_png()[:50]]
        ),
        "nofile": Sample("nofile", "document", segments=[{"text": "a"}, {"image": 0}]),
        "literal": Sample("literal", "document", segments=[{"text": "see <image> here"}]),
        "unplaced": Sample("unplaced", "document", segments=[{"text": "no place"}], images=[_png()]),
        "chatimg": Sample("chatimg", "chat", messages=world.chat("q?", "a"), images=[]),
    }
    with ShardWriter(tmp_path, "bad", per_shard=100) as writer:
        writer.write(good)
        for sample in cases.values():
            writer.write(sample)
    with tarfile.open(tmp_path / "bad-000001.tar", "w") as tar:  # an unsupported image member
        for name, data in (
            ("tiff.json", b'{"kind": "caption", "segments": [{"image": 0}]}'),
            ("tiff.0.tiff", b"II*\x00"),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    reader = ShardReader(shard_files(tmp_path))
    samples, read_errors = reader.read_many(range(len(reader)))
    assert [str(e) for e in read_errors] == ["bad-000001.tar:tiff: image 0: unsupported format .tiff"]
    tok, image_id = with_image_token(train_tokenizer("a red square fine no place see here " * 20, 300))
    encoder = SequenceEncoder(tok, image_id, 4, ImageSpec(32), seq_len=64)
    rows, errors = encode_batch(encoder, [(s, f"bad-000000.tar:{s.key}") for s in samples])
    assert [r.name for r in rows] == ["bad-000000.tar:good"]
    reasons = {e.item.split(":")[1]: e.reason for e in errors}
    assert set(reasons) == set(cases)
    assert reasons["corrupt"].startswith("image 0: image is corrupt or truncated (PNG)")
    assert "no image for it" in reasons["nofile"] and "no image for it" in reasons["literal"]
    assert "without a placeholder" in reasons["unplaced"]
    assert "image part(s) without an image" in reasons["chatimg"]


def test_world_folder_layout(tmp_path: Path) -> None:
    write_world(tmp_path, 0, SMALL)
    for part in ("captions", "documents", "chats", "eval/val", "eval/held_out", "eval/captions"):
        assert ShardReader(shard_files(tmp_path / part)).read(0).images
    held = ShardReader(shard_files(tmp_path / "eval" / "held_out"))
    templates = {held.read(i).meta["template"] for i in range(len(held))}
    assert templates <= {t for _, h in world.TEMPLATES.values() for t in h}
    assert np.mean([len(held.read(i).images) for i in range(len(held))]) == 1.0


def test_stage_sources_mix_text_and_caption_replay_into_the_interleave_stage() -> None:
    plain = stage_sources(recipes.build("vlm_interleave").vlm)
    assert plain == pytest.approx({"documents": 0.8, "text": 0.2})
    replay = recipes.build("vlm_interleave", {"vlm.caption_replay": 0.2, "init.parent": "x"})
    assert stage_sources(replay.vlm) == pytest.approx({"documents": 0.6, "text": 0.2, "captions": 0.2})
    too_much = recipes.build("vlm_interleave", {"vlm.caption_replay": 0.8, "init.parent": "x"})
    with pytest.raises(RecipeError, match="caption_replay"):
        validate(too_much, 1)
