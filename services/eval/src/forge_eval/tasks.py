"""Tasks as configuration: a YAML file names the data, its pinned hash, the Jinja templates, the
few-shot selection, the decoding parameters and the scorer; this module turns it into requests.

Why declarative: adding a benchmark of an existing shape must need only a YAML file and its data,
and everything that decides a result must be visible (and hashed) in one place. Unknown keys, a
missing dataset, a dataset whose content no longer matches its pinned hash and a template that
references a field the records lack are all refused before any model call, naming the field.
"""

from __future__ import annotations

import ast
import csv
import functools
import gzip
import hashlib
import io
import json
import random
from collections import defaultdict
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import jinja2
import jinja2.sandbox
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from forge_kit import errors
from forge_kit.images import MAX_IMAGE_BYTES

OutputType = Literal["generate_until", "multiple_choice", "loglikelihood_rolling", "code_exec"]
Root = Literal["benchmarks", "corpora"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DatasetConfig(_Strict):
    """Where the records come from and what their content must hash to."""

    root: Root = "benchmarks"
    path: str = Field(description="file or glob relative to the root, e.g. 'mmlu/test/*.csv'")
    sha256: str = Field(default="", description="pinned hash (a prefix is enough) over the file(s)")
    format: Literal["jsonl", "jsonl.gz", "json", "csv", "text"] = "jsonl"
    split: str = "test"
    records_key: str = Field(default="", description="json: the key holding the list of records")
    columns: tuple[str, ...] = Field(default=(), description="csv: column names (files have no header)")
    chunk_chars: int = Field(default=2048, ge=16, description="text: characters per document")
    slice: tuple[float, float] = Field(
        default=(0.0, 1.0), description="text: fraction of the file; other formats: of each file's records"
    )


class FewShotConfig(_Strict):
    """Few-shot examples: how many, from where, chosen by which seed."""

    num: int = Field(default=0, ge=0, le=64)
    seed: int = 1234
    dataset: DatasetConfig | None = None
    same_source: bool = Field(default=False, description="draw shots from the example's own file")
    separator: str = "\n\n"


class TemplateConfig(_Strict):
    """Jinja templates over a record's fields (plus ``_index`` and ``_source``, the file stem)."""

    id: str = "{{ _source }}:{{ _index }}"
    prompt: str
    target: str = ""
    fewshot_target: str = Field(default="", description="a shot's answer; defaults to target")
    choices: tuple[str, ...] | str = Field(
        default=(),
        description="multiple choice continuations: a list of templates (the same choices for every "
        "example), or one template rendering a list (per-example choices, lm-evaluation-harness's "
        "doc_to_choice), e.g. '{{ mc1_targets.choices }}'",
    )
    choice: str = Field(
        default="",
        description="a template over each choice (``choice``, and the record's fields), e.g. "
        "' {{ choice }}'; the choice as it is when empty",
    )
    delimiter: str = Field(
        default="",
        description="multiple choice: put between the prompt and each choice, outside the choice "
        "(lm-evaluation-harness's target_delimiter, ' '): acc_norm's length does not count it",
    )
    gold: str = Field(
        default="",
        description="multiple choice: the index of the right choice, or a list of indices when "
        "several are right (e.g. '{{ choices.label.index(answerKey) }}')",
    )
    targets: str = Field(
        default="",
        description="generation: a template rendering a list of reference answers (any one matches)",
    )
    image: str = Field(
        default="",
        description="an image sent with the prompt (a chat image_url part): its path relative to "
        "the dataset root, e.g. 'vlm_shapes/{{ image }}' (PNG, JPEG, WebP or GIF)",
    )


class GenerationConfig(_Strict):
    """Decoding parameters; greedy with a fixed length by default so runs repeat."""

    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_tokens: int = Field(default=256, ge=1, le=32768)
    stop: tuple[str, ...] = ()
    n: int = Field(default=1, ge=1, le=200, description="samples per example (pass@k)")


class ScorerConfig(_Strict):
    name: str
    options: dict[str, Any] = Field(default_factory=dict)


class SmokeConfig(_Strict):
    """The smoke tier: a small stratified subset, for when compute is short."""

    size: int = Field(default=100, ge=1)
    stratify_by: str = "_source"


class GateConfig(_Strict):
    """Release-gate policy: which metrics gate and by how much a drop is tolerated."""

    metrics: tuple[str, ...] = ()
    tolerance: float = Field(default=0.0, ge=0.0)


class TaskConfig(_Strict):
    """One benchmark task, as its YAML file states it."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_.-]{0,63}$")
    description: str = ""
    output_type: OutputType
    dataset: DatasetConfig
    fewshot: FewShotConfig = FewShotConfig()
    template: TemplateConfig
    chat: bool = Field(default=False, description="send as a chat message instead of plain text")
    images: Literal["send", "drop"] = Field(
        default="send",
        description="drop: the text-only control, the same prompts without their images",
    )
    generation: GenerationConfig = GenerationConfig()
    scorer: ScorerConfig
    gate: GateConfig = GateConfig()
    smoke: SmokeConfig = SmokeConfig()

    @model_validator(mode="after")
    def _shape(self) -> TaskConfig:
        if self.output_type == "multiple_choice" and (not self.template.choices or not self.template.gold):
            raise ValueError("template.choices and template.gold are required for multiple_choice")
        if self.dataset.format == "csv" and not self.dataset.columns:
            raise ValueError("dataset.columns is required for csv")
        if self.template.image and (not self.chat or self.output_type != "generate_until"):
            raise ValueError("template.image needs chat: true and output_type generate_until")
        return self


@dataclass(frozen=True)
class Doc:
    """One rendered example: the prompt, what the scorer needs, and the record it came from."""

    id: str
    prompt: str
    target: str
    choices: tuple[str, ...] = ()
    gold: int = -1
    record: dict[str, Any] = field(default_factory=dict)
    shots: tuple[str, ...] = ()
    image: bytes = b""
    """The example's image (encoded file bytes), when the task has ``template.image``."""
    image_sha256: str = ""
    golds: tuple[int, ...] = ()
    """Every right choice (``gold`` is the first); several when the task's ``gold`` is a list."""
    targets: tuple[str, ...] = ()
    """Reference answers of a generative task with ``template.targets``; any one matches."""


@dataclass(frozen=True)
class DataRoots:
    """The folders a task's ``dataset.root`` refers to."""

    benchmarks: Path
    corpora: Path

    def of(self, root: Root) -> Path:
        return self.benchmarks if root == "benchmarks" else self.corpora


# --- loading task files ------------------------------------------------------------------------


def shipped_tasks() -> dict[str, Path]:
    """The task YAML files shipped in ``forge_eval/tasks``, by task name (file stem)."""
    folder = resources.files("forge_eval") / "tasks"
    return {Path(str(p)).stem: Path(str(p)) for p in folder.iterdir() if str(p).endswith((".yaml", ".yml"))}


def load_task(ref: str) -> TaskConfig:
    """A task from a YAML path, or a shipped task by name; errors name the offending key."""
    path = Path(ref)
    if not path.suffix:
        known = shipped_tasks()
        if ref not in known:
            raise errors.ValidationError(
                "task", f"no shipped task {ref!r}; shipped: {', '.join(sorted(known))}"
            )
        path = known[ref]
    if not path.is_file():
        raise errors.ValidationError("task", f"task file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise errors.ValidationError("task", f"{path} is not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise errors.ValidationError("task", f"{path} must hold a mapping of task keys")
    try:
        return TaskConfig.model_validate(raw)
    except ValidationError as exc:
        # An unknown key is usually a typo of a key reported as missing: name it first.
        found = sorted(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")
        first = found[0]
        where = ".".join(str(p) for p in first["loc"]) or "task"
        message = "unknown key" if first["type"] == "extra_forbidden" else first["msg"]
        raise errors.ValidationError(f"task.{where}", f"{message} (in {path})") from None


# --- data --------------------------------------------------------------------------------------


def _files(roots: DataRoots, ds: DatasetConfig, field_name: str) -> tuple[Path, list[Path]]:
    base = roots.of(ds.root)
    files = sorted(p for p in base.glob(ds.path) if p.is_file())
    if not files:
        raise errors.ValidationError(f"{field_name}.path", f"no file matches {ds.path!r} under {base}")
    return base, files


def dataset_hash(roots: DataRoots, ds: DatasetConfig, field_name: str = "task.dataset") -> str:
    """sha256 of one file, or over ``path\\tsha256`` lines of every file a glob matches; checked
    against the pinned ``sha256`` so changed data refuses to run."""
    base, files = _files(roots, ds, field_name)
    digests = [(p.relative_to(base).as_posix(), hashlib.sha256(p.read_bytes()).hexdigest()) for p in files]
    digest = (
        digests[0][1]
        if len(digests) == 1
        else hashlib.sha256("".join(f"{rel}\t{h}\n" for rel, h in digests).encode()).hexdigest()
    )
    if ds.sha256 and not digest.startswith(ds.sha256.lower()):
        raise errors.ValidationError(
            f"{field_name}.sha256",
            f"data under {ds.path!r} hashes to {digest[:16]}…, the task pins {ds.sha256}",
        )
    return digest


def load_records(
    roots: DataRoots, ds: DatasetConfig, field_name: str = "task.dataset"
) -> list[dict[str, Any]]:
    """Every record, each with ``_index`` (position in its file) and ``_source`` (the file stem)."""
    _, files = _files(roots, ds, field_name)
    records: list[dict[str, Any]] = []
    for path in files:
        source = path.name.split(".")[0].removesuffix(f"_{ds.split}")
        for i, record in enumerate(_read(path, ds, field_name)):
            records.append({**record, "_index": i, "_source": source})
    return records


def _read(path: Path, ds: DatasetConfig, field_name: str) -> list[dict[str, Any]]:
    records = _read_all(path, ds, field_name)
    if ds.format == "text" or tuple(ds.slice) == (0.0, 1.0):
        return records
    lo, hi = (int(len(records) * f) for f in ds.slice)  # a held-out tail, as a corpus's split
    return records[lo:hi]


def _read_all(path: Path, ds: DatasetConfig, field_name: str) -> list[dict[str, Any]]:
    if ds.format in ("jsonl", "jsonl.gz"):
        text = gzip.decompress(path.read_bytes()).decode() if ds.format == "jsonl.gz" else path.read_text()
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    if ds.format == "json":
        data = json.loads(path.read_text())
        rows = data.get(ds.records_key) if ds.records_key and isinstance(data, dict) else data
        if not isinstance(rows, list):
            raise errors.ValidationError(
                f"{field_name}.records_key", f"{path.name} has no list at {ds.records_key!r}"
            )
        return [r if isinstance(r, dict) else {"value": r} for r in rows]
    if ds.format == "csv":
        rows = list(csv.reader(io.StringIO(path.read_text())))
        bad = [i for i, r in enumerate(rows) if len(r) != len(ds.columns)]
        if bad:
            raise errors.ValidationError(
                f"{field_name}.columns",
                f"{path.name} row {bad[0]} has {len(rows[bad[0]])} columns, not {len(ds.columns)}",
            )
        return [dict(zip(ds.columns, r, strict=True)) for r in rows]
    text = path.read_text()
    lo, hi = (int(len(text) * f) for f in ds.slice)
    text = text[lo:hi]
    return [{"text": text[i : i + ds.chunk_chars]} for i in range(0, len(text), ds.chunk_chars)]


# --- rendering ---------------------------------------------------------------------------------

_ENV = jinja2.sandbox.ImmutableSandboxedEnvironment(
    undefined=jinja2.StrictUndefined, keep_trailing_newline=True
)


@functools.lru_cache(maxsize=256)
def _compile(template: str) -> jinja2.Template:
    return _ENV.from_string(template)


def _render(template: str, record: dict[str, Any], field_name: str) -> str:
    try:
        return _compile(template).render(**record)
    except jinja2.UndefinedError as exc:
        fields = ", ".join(sorted(k for k in record if not k.startswith("_")))
        raise errors.ValidationError(field_name, f"{exc.message}; the records have: {fields}") from None
    except jinja2.TemplateError as exc:
        raise errors.ValidationError(field_name, f"template error: {exc}") from None


def _image(roots: DataRoots, task: TaskConfig, record: dict[str, Any], doc_id: str) -> bytes:
    """The bytes of an example's image: a file inside the dataset's root, at most
    :data:`forge_kit.images.MAX_IMAGE_BYTES`; a path outside the root is refused."""
    base = roots.of(task.dataset.root).resolve()
    rel = _render(task.template.image, record, "task.template.image").strip()
    path = (base / rel).resolve()
    if not path.is_relative_to(base):
        raise errors.ValidationError("task.template.image", f"{doc_id}: {rel!r} is outside {base}")
    if not path.is_file():
        raise errors.ValidationError("task.template.image", f"{doc_id}: no image file {rel!r} under {base}")
    if path.stat().st_size > MAX_IMAGE_BYTES:
        raise errors.ValidationError(
            "task.template.image", f"{doc_id}: {rel!r} is over {MAX_IMAGE_BYTES} bytes"
        )
    return path.read_bytes()


#: Longest rendering of a list-valued template read back as a list.
MAX_LIST_CHARS = 1 << 20


def _listed(template: str, record: dict[str, Any], field_name: str, doc_id: str) -> tuple[str, ...]:
    """A template that renders a list (lm-evaluation-harness's doc_to_choice reading: the
    rendering is a Python literal), as strings; a single value is a list of one."""
    text = _render(template, record, field_name).strip()
    if len(text) > MAX_LIST_CHARS:
        raise errors.ValidationError(field_name, f"{doc_id}: renders over {MAX_LIST_CHARS} characters")
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        value = text
    items = value if isinstance(value, list | tuple) else [value]
    if not items or not all(isinstance(v, str | int | float) and not isinstance(v, bool) for v in items):
        raise errors.ValidationError(field_name, f"{doc_id}: {text[:80]!r} is not a non-empty list of values")
    return tuple(str(v) for v in items)


def _choices(t: TemplateConfig, record: dict[str, Any], doc_id: str) -> tuple[str, ...]:
    """An example's choices: each fixed template rendered, or the list one template renders, each
    then through ``template.choice``."""
    field_name = "task.template.choices"
    if isinstance(t.choices, str):
        raw = _listed(t.choices, record, field_name, doc_id)
    else:
        raw = tuple(_render(c, record, field_name) for c in t.choices)
    if not t.choice:
        return raw
    return tuple(_render(t.choice, {**record, "choice": c}, "task.template.choice") for c in raw)


def _golds(t: TemplateConfig, record: dict[str, Any], doc_id: str, count: int) -> tuple[int, ...]:
    """The right choices' indices: one, or a list of them."""
    golds = _listed(t.gold, record, "task.template.gold", doc_id)
    bad = [g for g in golds if not g.lstrip("-").isdigit() or not 0 <= int(g) < count]
    if bad:
        raise errors.ValidationError(
            "task.template.gold", f"{doc_id}: {bad[0]!r} is not a choice index (0 to {count - 1})"
        )
    return tuple(dict.fromkeys(int(g) for g in golds))


def select(
    records: list[dict[str, Any]], limit: int, seed: int, stratify_by: str = ""
) -> list[dict[str, Any]]:
    """All records, or a seeded subset of ``limit`` in original order; with ``stratify_by`` the
    subset keeps each group's share (largest remainder), so a smoke run covers every subject."""
    if limit <= 0 or limit >= len(records):
        return records
    rng = random.Random(seed)
    if not stratify_by:
        keep = set(rng.sample(range(len(records)), limit))
    else:
        groups: dict[str, list[int]] = defaultdict(list)
        for i, r in enumerate(records):
            groups[str(r.get(stratify_by, ""))].append(i)
        quotas = {g: limit * len(ids) / len(records) for g, ids in groups.items()}
        counts = {g: int(q) for g, q in quotas.items()}
        for g in sorted(quotas, key=lambda g: (counts[g] - quotas[g], g))[: limit - sum(counts.values())]:
            counts[g] += 1
        keep = {i for g in sorted(groups) for i in rng.sample(groups[g], counts[g])}
    return [r for i, r in enumerate(records) if i in keep]


def build_docs(
    task: TaskConfig, roots: DataRoots, *, limit: int = 0, seed: int = 0, smoke: bool = False
) -> list[Doc]:
    """Render every selected example of ``task`` with its few-shot prefix.

    1. Load the records; 2. select the subset (seeded, stratified for smoke); 3. render the shot
    pool; 4. per example, draw its shots with a generator seeded by (few-shot seed, example id) so
    the selection never depends on which other examples run or in what order; 5. render it.
    """
    records = load_records(roots, task.dataset)
    if smoke:
        by = task.smoke.stratify_by
        if by and any(by not in r for r in records):
            fields = ", ".join(sorted(k for k in records[0] if not k.startswith("_"))) if records else ""
            raise errors.ValidationError(
                "task.smoke.stratify_by",
                f"the records have no field {by!r} to stratify by; they have: {fields}",
            )
        records = select(records, task.smoke.size, seed, by)
    records = select(records, limit, seed)
    t = task.template
    pool: dict[str, list[dict[str, Any]]] = defaultdict(list)
    if task.fewshot.num:
        shot_ds = task.fewshot.dataset or task.dataset
        for r in load_records(roots, shot_ds, "task.fewshot.dataset"):
            pool[r["_source"] if task.fewshot.same_source else ""].append(r)

    def shot_text(r: dict[str, Any]) -> str:
        answer = _render(t.fewshot_target or t.target, r, "task.template.fewshot_target")
        return _render(t.prompt, r, "task.template.prompt") + " " + answer

    docs = []
    for r in records:
        doc_id = _render(t.id, r, "task.template.id")
        shots: tuple[str, ...] = ()
        if task.fewshot.num:
            candidates = pool.get(r["_source"] if task.fewshot.same_source else "", [])
            rng = random.Random(f"{task.fewshot.seed}:{doc_id}")
            picked = rng.sample(range(len(candidates)), min(task.fewshot.num, len(candidates)))
            shots = tuple(shot_text(candidates[i]) for i in picked)
        prefix = "".join(s + task.fewshot.separator for s in shots)
        choices = _choices(t, r, doc_id)
        golds = _golds(t, r, doc_id, len(choices)) if choices else ()
        image = _image(roots, task, r, doc_id) if t.image else b""
        docs.append(
            Doc(
                id=doc_id,
                prompt=prefix + _render(t.prompt, r, "task.template.prompt"),
                target=_render(t.target, r, "task.template.target") if t.target else "",
                choices=choices,
                gold=golds[0] if golds else -1,
                golds=golds,
                targets=_listed(t.targets, r, "task.template.targets", doc_id) if t.targets else (),
                record=r,
                shots=shots,
                image=image,
                image_sha256=hashlib.sha256(image).hexdigest() if image else "",
            )
        )
    ids = [d.id for d in docs]
    if len(set(ids)) != len(ids):
        raise errors.ValidationError("task.template.id", "renders the same id for two examples")
    return docs
