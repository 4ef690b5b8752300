"""The ``vlm`` task: a LLaVA-style vision-language model, one curriculum stage per run
(``vlm.stage``), on image-text shards (:mod:`forge_training.vlm`).

| stage | parent | data | trains |
|---|---|---|---|
| ``align`` | causal LM | captions | the projector (vision tower and LM frozen); with ``vlm.align_lm`` the LM too |
| ``interleave`` | VLM | interleaved documents + ``text_replay`` text-only windows (+ ``caption_replay`` captions) | projector + LM |
| ``instruct`` | VLM | VQA and caption chats (loss on the reply) | projector + LM |
| ``joint`` | causal LM (``from_scratch``: tokenizer and shape only) | all of the above mixed | projector + LM |

The vision tower trains only with ``vlm.train_vision`` (off by default, as LLaVA keeps CLIP frozen).

Batches: each slot's source is drawn by :class:`~forge_training.data.MixtureSampler` (seeded by
step, per-source epoch permutations; its state is the resume point). A sample that cannot be
used (corrupt or oversized image, placeholder/image mismatch, too long) is logged with its name
(``vlm.item_refused``) and dropped; the rest of the micro-batch trains. Loss: next-token cross
entropy summed over label tokens (image positions and prompts carry none). Evaluation:
``val_loss`` on held-in chats (train templates, unseen scenes) and their exact-match
``val_vqa_accuracy`` by greedy generation; held-out templates are the benchmark's alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformers import LlavaForConditionalGeneration, PreTrainedModel

from forge_kit.paths import resolve_data_path
from forge_training.collectives import all_reduce, barrier
from forge_training.data import MixtureSampler, PreparedData, TokenShards, prepare
from forge_training.device import on_model_device
from forge_training.mfu import train_flops_per_token
from forge_training.objectives.base import (
    Micro,
    Objective,
    ObjectiveSpec,
    StepBatch,
    prepare_rank0_first,
    rank_batches,
)
from forge_training.parents import load_parent
from forge_training.schema import DataConfig, RecipeError, TrainConfig, VlmConfig
from forge_training.vlm.dataset import WorldSize, write_world
from forge_training.vlm.evaluate import score_chats
from forge_training.vlm.model import (
    VisionShape,
    build_vlm,
    export_vlm,
    image_spec,
    init_vision_positions,
    text_config,
)
from forge_training.vlm.parent import load_vlm_parent
from forge_training.vlm.shards import ItemError, ShardReader, shard_files
from forge_training.vlm.tokens import Encoded, SequenceEncoder, collate, encode_batch

log = structlog.get_logger()
IMAGE_SOURCES = ("captions", "documents", "chats")
TEXT = "text"


def world_folder(v: VlmConfig, cache_dir: Path) -> Path:
    """The data folder: the synthetic world in the cache (written once per seed and size), or
    ``vlm.world``."""
    if v.world == "synthetic":
        return cache_dir / f"vlm-world-{v.world_seed}-{v.image_size}px"
    return resolve_data_path(v.world)


def stage_sources(v: VlmConfig) -> dict[str, float]:
    """Sampling weight of each source (``captions``, ``documents``, ``chats``, ``text``)."""
    if v.stage == "align":
        return {"captions": 1.0}
    if v.stage == "interleave":
        out = {"documents": 1.0 - v.text_replay - v.caption_replay, TEXT: v.text_replay}
        return {**out, "captions": v.caption_replay} if v.caption_replay > 0 else out
    if v.stage == "instruct":
        return {"chats": 1.0}
    weights: dict[str, float] = {}
    for part in v.joint_weights.split(","):
        name, _, raw = part.partition(":")
        if name.strip() not in IMAGE_SOURCES:
            raise RecipeError(
                f"vlm.joint_weights: unknown source {name.strip()!r} (one of {', '.join(IMAGE_SOURCES)})"
            )
        weights[name.strip()] = float(raw)
    total = sum(weights.values())
    out = {k: (1.0 - v.text_replay) * w / total for k, w in weights.items()}
    if v.text_replay > 0:
        out[TEXT] = v.text_replay
    return out


class VisionLanguage(Objective):
    task = "vlm"
    model: LlavaForConditionalGeneration

    def __init__(self, config: TrainConfig, rank: int, world_size: int, cache_dir: Path) -> None:
        super().__init__(config, rank, world_size)
        v = config.vlm
        self.model, tokenizer = self._model(config)
        self.tokenizer_json = tokenizer.to_str()
        self.spec = image_spec(self.model)
        cfg = self.model.config
        self.encoder = SequenceEncoder(
            tokenizer, cfg.image_token_id, cfg.image_seq_length, self.spec, config.data.seq_len
        )
        folder = world_folder(v, cache_dir)
        if v.world == "synthetic" and rank == 0:
            write_world(folder, v.world_seed, WorldSize(image_size=v.image_size))
        barrier(world_size)
        self.weights = stage_sources(v)
        self.sources: list[str] = list(self.weights)
        self.readers: dict[str, ShardReader] = {}
        self.text: TokenShards | None = None
        if TEXT in self.weights:
            self.text = self._text(folder, cache_dir, tokenizer).split("train")
        for name in self.sources:
            if name != TEXT:
                self.readers[name] = ShardReader(shard_files(folder / name))
        self.val = ShardReader(shard_files(folder / "eval" / "val"))
        sizes = [self._size(name) for name in self.sources]
        self.sampler = MixtureSampler(
            sizes, [self.weights[s] for s in self.sources], config.global_batch_size, config.seed
        )
        self.data_hash = f"vlm:{folder.name}:{','.join(self.sources)}"
        self.refused = 0
        self._per_token = train_flops_per_token(
            text_config(self.model), text_config(self.model).vocab_size, config.data.seq_len
        )

    def _model(self, config: TrainConfig) -> tuple[LlavaForConditionalGeneration, Tokenizer]:
        v = config.vlm
        if v.stage in ("align", "joint"):
            parent = load_parent(config.init.parent)
            shape = VisionShape(
                v.image_size,
                v.patch_size,
                v.vision_hidden_size,
                2 * v.vision_hidden_size,
                v.vision_layers,
                v.vision_heads,
            )
            model, tok = build_vlm(parent.model, parent.tokenizer(), shape)
            if v.from_scratch:
                model = LlavaForConditionalGeneration(model.config)
                init_vision_positions(model)
        else:
            loaded = load_vlm_parent(config.init.parent)
            model, tok = loaded.model, loaded.tokenizer
        text = text_config(model)
        text.max_position_embeddings = max(text.max_position_embeddings, config.data.seq_len)
        model.train()
        for name, p in model.named_parameters():
            if v.stage == "align" and not v.align_lm:
                p.requires_grad = "multi_modal_projector" in name
            elif name.startswith("model.vision_tower."):
                p.requires_grad = v.train_vision
        return model, tok

    def _text(self, folder: Path, cache_dir: Path, tokenizer: Tokenizer) -> PreparedData:
        data = DataConfig(corpus=str(folder / "text.txt"), seq_len=self.config.data.seq_len)
        return prepare_rank0_first(
            self.world_size, self.rank, lambda: prepare(data, cache_dir, tokenizer.to_str())
        )

    def _size(self, name: str) -> int:
        if name == TEXT:
            assert self.text is not None
            return self.text.num_windows(self.config.data.seq_len - 1)
        return len(self.readers[name])

    def _rows(self, items: Sequence[tuple[int, int]]) -> list[Encoded]:
        rows: list[Encoded] = []
        pending = []
        for source, index in items:
            name = self.sources[source]
            if name == TEXT:
                assert self.text is not None
                window = [int(t) for t in self.text.window(index, self.config.data.seq_len - 1)]
                rows.append(
                    Encoded(
                        window, window, torch.zeros(0, 3, self.spec.size, self.spec.size), f"text:{index}"
                    )
                )
                continue
            reader = self.readers[name]
            try:
                pending.append((reader.read(index), reader.name(index)))
            except ItemError as exc:
                self._refuse(exc)
        good, bad = encode_batch(self.encoder, pending)
        for err in bad:
            self._refuse(err)
        return rows + good

    def _refuse(self, exc: ItemError) -> None:
        self.refused += 1
        log.warning("vlm.item_refused", item=exc.item, reason=exc.reason)

    def draw(self) -> StepBatch:
        """As :meth:`Objective.draw`, with the step's items grouped by source before they are cut
        into micro-batches: a micro-batch pads to its longest row, and a 40-token chat beside a
        200-token document would be mostly padding. The step's items are the same either way."""
        items = sorted(self.sampler.next_step(self.rank, self.world_size), key=lambda item: item[0])
        position = self.sampler.state_dict()
        mb = self.config.micro_batch_size
        micro = [self.collate(items[i : i + mb]) for i in range(0, len(items), mb)]
        units = sum(self.units(m) for m in micro)
        tokens = sum(float(m["attention_mask"].sum()) for m in micro)
        return StepBatch(micro, units, tokens, sum(self.flops(m) for m in micro), position)

    def collate(self, items: Sequence[Any]) -> Micro:
        rows = self._rows(items)
        if not rows:
            raise RuntimeError(
                f"every item of a micro-batch was refused ({len(items)} items; see vlm.item_refused)"
            )
        return collate(rows, self.encoder.eot)

    def units(self, micro: Micro) -> float:
        return float((micro["labels"][:, 1:] != -100).sum())

    def flops(self, micro: Micro) -> float:
        return float(micro["attention_mask"].sum()) * self._per_token

    def loss(self, module: torch.nn.Module, micro: Micro) -> tuple[torch.Tensor, list[float]]:
        pixels = micro["pixel_values"] if micro["pixel_values"].numel() else None
        logits = module(
            input_ids=micro["input_ids"],
            attention_mask=micro["attention_mask"],
            pixel_values=pixels,
            use_cache=False,
        ).logits
        return F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)),
            micro["labels"][:, 1:].reshape(-1),
            ignore_index=-100,
            reduction="sum",
        ), []

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """``val_loss`` and ``val_vqa_accuracy`` on the first ``vlm.eval_items`` held-in chats."""
        n = min(self.config.vlm.eval_items, len(self.val))
        self.model.eval()
        total, units, hits, count = 0.0, 0.0, 0.0, 0.0
        for batch, counts in rank_batches(
            list(range(n)), self.rank, self.world_size, self.config.micro_batch_size
        ):
            samples, _ = self.val.read_many(batch)
            rows, _ = encode_batch(self.encoder, [(s, s.key) for s in samples])
            micro = on_model_device(collate(rows, self.encoder.eot), self.model)
            loss, _ = self.loss(self.model, micro)
            scored = score_chats(
                self.model, self.encoder, samples, max_new_tokens=self.config.vlm.max_new_tokens
            )
            if counts:
                total, units = total + float(loss), units + self.units(micro)
                hits, count = hits + sum(scored.scores), count + len(scored.scores)
        self.model.train()
        total, units, hits, count = all_reduce([total, units, hits, count], self.world_size)
        val = total / max(units, 1.0)
        return {
            "val_loss": val,
            "val_ppl": math.exp(min(val, 50.0)),
            "val_vqa_accuracy": hits / max(count, 1.0),
            "refused_items": float(self.refused),
        }

    def export(self, out_dir: Path, model: PreTrainedModel | None = None) -> Path:
        return export_vlm(model or self.model, Tokenizer.from_str(self.tokenizer_json), self.spec, out_dir)

    def state_dict(self) -> dict[str, Any]:
        return {"refused": self.refused}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.refused = int(state.get("refused", 0))


def build(config: TrainConfig, rank: int, world_size: int, cache_dir: Path) -> Objective:
    return VisionLanguage(config, rank, world_size, cache_dir)


SPEC = ObjectiveSpec("vlm", build, "LLaVA-style vision-language model, one curriculum stage per run")
