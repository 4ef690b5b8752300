"""Image tasks: the synthetic shapes world as benchmark data (deterministic, pinned), the three
shipped VLM tasks (held-out-template VQA, captions, and the text-only control), and a run of each
against a real model_server process serving a tiny random LLaVA: the image travels as an
``image_url`` part (the answers are the model server's own for that image), the control sends
the same questions without it, and the scores and the spec carry what decides them."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import openai
import pytest

from forge_eval.backend import OpenAIBackend
from forge_eval.harness import run_task
from forge_eval.scorers import get_scorer
from forge_eval.tasks import DataRoots, Doc, build_docs, dataset_hash, load_task
from forge_eval.vlm_data import write_shapes
from forge_kit import errors
from forge_kit.paths import resolve_data_path
from forge_kit.testing import ServiceProcess, base_env
from forge_kit.testing.tiny_llava import save_tiny_llava

pytest.importorskip("forge_training.vlm.world")
TOKEN = "eval-vlm-token"
TASKS = ("vlm_shapes_vqa", "vlm_shapes_vqa_text_only", "vlm_shapes_caption")


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> DataRoots:
    benchmarks = tmp_path_factory.mktemp("vlm-bench") / "benchmarks"
    write_shapes(benchmarks)
    return DataRoots(benchmarks, resolve_data_path("corpora"))


@pytest.fixture(scope="module")
def model_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    root = tmp_path_factory.mktemp("vlm-serve")
    save_tiny_llava(root / "models" / "llava", context=512)
    env = base_env("model_server", token=TOKEN, models_dir=str(root / "models"), torch_threads="1")
    proc = ServiceProcess("forge_model_server", env=env, cwd=str(root), log_path=str(root / "log")).start(60)
    yield proc
    proc.stop()


@pytest.fixture
async def backend(model_server: ServiceProcess) -> AsyncIterator[OpenAIBackend]:
    made = OpenAIBackend(f"{model_server.http_url}", "llava", token=TOKEN, timeout_s=120)
    yield made
    await made.aclose()


def test_the_world_is_written_deterministically_and_matches_the_pins(
    roots: DataRoots, tmp_path: Path
) -> None:
    again = write_shapes(tmp_path / "benchmarks")
    for name in ("vqa_heldout.jsonl", "captions.jsonl"):
        assert (again / name).read_bytes() == (roots.benchmarks / "vlm_shapes" / name).read_bytes()
    for name in TASKS:
        task = load_task(name)
        assert task.dataset.sha256 and dataset_hash(roots, task.dataset).startswith(task.dataset.sha256)
    docs = build_docs(load_task("vlm_shapes_vqa"), roots)
    assert len(docs) == 200 and {d.record["qtype"] for d in docs} == {"colour", "shape", "count", "position"}
    assert all(
        d.image.startswith(b"\x89PNG") and d.image_sha256 == hashlib.sha256(d.image).hexdigest() for d in docs
    )
    # Held-out templates only: none of the phrasings the recipes train on.
    from forge_training.vlm.world import TEMPLATES

    trained = {t for train, _ in TEMPLATES.values() for t in train}
    assert not trained & {d.record["template"] for d in docs}


def test_image_paths_must_stay_inside_the_data_root(roots: DataRoots, tmp_path: Path) -> None:
    task = load_task("vlm_shapes_vqa")
    escape = task.model_copy(
        update={"template": task.template.model_copy(update={"image": "../../etc/passwd"})}
    )
    with pytest.raises(errors.ValidationError) as refused:
        build_docs(escape, roots, limit=1)
    assert refused.value.field == "task.template.image" and "outside" in refused.value.message
    text_task = task.model_copy(update={"chat": False})
    with pytest.raises(ValueError, match="chat: true"):
        type(task).model_validate(text_task.model_dump())


def test_vqa_and_caption_scorers_use_the_training_metrics() -> None:
    vqa = get_scorer("vqa_exact_match", "generate_until")
    doc = Doc(id="x", prompt="What colour is the circle?", target="red")
    assert vqa.score(doc, {"texts": ["Red.\nmore"]}, {})[0].score == 1.0
    assert vqa.score(doc, {"texts": ["the red one"]}, {})[0].score == 0.0
    caption = get_scorer("caption_bleu4", "generate_until")
    ref = "two shapes: a small red circle in the top left, a big blue square in the top right."
    assert caption.score(Doc(id="c", prompt="", target=ref), {"texts": [ref]}, {})[0].score == pytest.approx(
        1.0
    )
    assert caption.score(Doc(id="c", prompt="", target=ref), {"texts": ["nothing"]}, {})[0].score == 0.0


async def test_image_tasks_run_against_a_served_llava(
    roots: DataRoots, backend: OpenAIBackend, model_server: ServiceProcess
) -> None:
    identity = await backend.identity()
    vqa = await run_task(load_task("vlm_shapes_vqa"), roots, backend, identity, limit=6, seed=1)
    control = await run_task(load_task("vlm_shapes_vqa_text_only"), roots, backend, identity, limit=6, seed=1)
    caption = await run_task(load_task("vlm_shapes_caption"), roots, backend, identity, limit=4, seed=1)
    assert [s["id"] for s in vqa.samples] == [s["id"] for s in control.samples]
    assert "images_sha256" in vqa.spec and vqa.spec_hash != control.spec_hash
    assert vqa.summary["metric"] == "vqa_exact_match" and vqa.summary["n"] == 6
    assert caption.summary["metric"] == "bleu4" and "bleu4" in caption.summary["corpus"]
    # The answers are the model server's own for the same chat with the image, and without it.
    docs = {d.id: d for d in build_docs(load_task("vlm_shapes_vqa"), roots, limit=6, seed=1)}
    async with openai.AsyncOpenAI(
        base_url=f"{model_server.http_url}/v1", api_key=TOKEN, max_retries=0, timeout=120
    ) as client:
        differ = 0
        for with_image, without in zip(vqa.samples[:3], control.samples[:3], strict=True):
            doc = docs[with_image["id"]]
            uri = "data:image/png;base64," + base64.b64encode(doc.image).decode()
            reply = await client.chat.completions.create(
                model="llava",
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": uri}},
                            {"type": "text", "text": doc.prompt},
                        ],
                    }
                ],
                max_tokens=8,
                temperature=0,
                stop=["\n"],
                seed=1,
            )
            assert with_image["response"]["texts"] == [reply.choices[0].message.content]
            plain = await client.chat.completions.create(
                model="llava",
                messages=[{"role": "user", "content": doc.prompt}],
                max_tokens=8,
                temperature=0,
                stop=["\n"],
                seed=1,
            )
            assert without["response"]["texts"] == [plain.choices[0].message.content]
            differ += with_image["response"]["texts"] != without["response"]["texts"]
    assert differ, "the image must reach the model: answers with and without it differ"
