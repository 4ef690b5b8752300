"""A synthetic visual world: scenes of coloured shapes rendered with Pillow, their captions,
interleaved documents describing several scenes, VQA chats and the world's plain text.

A scene puts 1-4 objects into distinct cells of a 2 x 2 grid (``top left`` ... ``bottom right``);
each object has a shape (circle, square, triangle), a colour (six) and a size (small, big), and no
two objects share both shape and colour. Everything is a pure function of a seed: the same seed
gives the same scenes, bytes, captions and questions (numpy's ``default_rng`` and Pillow's
deterministic rasteriser; PNG written without timestamps).

Questions come from templates of four types (colour, shape, count, position). Each type has
**held-out** templates (:data:`HELD_OUT`, one a type) that recombine phrasings other types use,
so a model is tested on wordings it never saw with the same meaning; they are used only for
evaluation (:func:`vqa_items` with ``held_out=True``), never for training or model selection.
The train side is many paraphrases (:data:`CORES`: 12 wordings a type, questions and requests,
synonyms and word orders, crossed with :data:`FRAMES`), filtered so that none equals, contains or
is contained in a held-out template; two cores a type are kept out of training as **dev**
templates (:data:`DEV_TEMPLATES`) for the ``eval/val`` set, so model selection measures
generalisation to unseen wordings without the held-out ones.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

#: Bumped whenever rendering, text or sampling changes, so cached worlds are rewritten.
VERSION = 3
SHAPES = ("circle", "square", "triangle")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (50, 80, 230),
    "yellow": (235, 215, 40),
    "purple": (150, 60, 190),
    "white": (245, 245, 245),
}
SIZES = ("small", "big")
CELLS = ("top left", "top right", "bottom left", "bottom right")
NUMBERS = ("zero", "one", "two", "three", "four")
BACKGROUND = (30, 30, 30)

#: Held-out question templates by type: evaluation only (``eval/held_out``), never trained on or
#: used for choices. Placeholders: {shape}, {colour}, {pos}.
HELD_OUT: dict[str, tuple[str, ...]] = {
    "colour": ("Tell me the colour of the {shape}.",),
    "shape": ("What shape is in the {pos}?",),
    "count": ("How many shapes does the picture show?",),
    "position": ("Tell me where the {colour} {shape} is.",),
}
#: Core wordings of each type, each written as a question (``?``) or a request (``.``); the train
#: and dev templates are these crossed with :data:`FRAMES` (instruction-template diversity as in
#: LLaVA / InstructBLIP), so no type owns a sentence frame.
CORES: dict[str, tuple[str, ...]] = {
    "colour": (
        "What colour is the {shape}?",
        "Which colour does the {shape} have?",
        "What is the colour of the {shape}?",
        "What color is the {shape}?",
        "Which colour is the {shape}?",
        "The {shape} is which colour?",
        "Name the colour of the {shape}.",
        "Say which colour the {shape} has.",
        "Give the colour of the {shape}.",
        "State the color of the {shape}.",
        "Tell me which colour the {shape} has.",
        "Identify the colour of the {shape}.",
    ),
    "shape": (
        "Which shape is in the {pos}?",
        "What is the shape in the {pos}?",
        "What kind of shape is in the {pos}?",
        "Which shape sits in the {pos}?",
        "In the {pos}, which shape is there?",
        "What is drawn in the {pos}?",
        "Tell me the shape in the {pos}.",
        "Name the shape in the {pos}.",
        "Say which shape is in the {pos}.",
        "Give the shape in the {pos}.",
        "Identify the shape found in the {pos}.",
        "State the kind of shape in the {pos}.",
    ),
    "count": (
        "How many shapes are there?",
        "How many shapes are in the picture?",
        "How many objects can you see?",
        "What is the number of shapes?",
        "How many shapes are shown?",
        "How many things are in the image?",
        "Count the shapes.",
        "Tell me how many shapes there are.",
        "Say how many objects the image has.",
        "Give the number of shapes.",
        "State the count of objects.",
        "Count the objects in the image.",
    ),
    "position": (
        "Where is the {colour} {shape}?",
        "In which corner is the {colour} {shape}?",
        "Which corner has the {colour} {shape}?",
        "Where can the {colour} {shape} be found?",
        "What is the position of the {colour} {shape}?",
        "Where does the {colour} {shape} sit?",
        "Name the corner of the {colour} {shape}.",
        "Say where the {colour} {shape} is.",
        "Give the position of the {colour} {shape}.",
        "Tell me the corner with the {colour} {shape}.",
        "State where the {colour} {shape} is located.",
        "Identify the corner holding the {colour} {shape}.",
    ),
}
#: Sentence frames around a core: ``{q}`` is the core as written.
FRAMES = ("{q}", "Look at the picture. {q}", "Question: {q}", "{q} Answer briefly.")


def _norm(text: str) -> str:
    return " ".join(re.sub(r"[^a-z{} ]", " ", text.lower()).split())


def _split(qtype: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(train, dev) templates of ``qtype``: every core in every frame, minus any that equals,
    contains or is contained in a held-out template of any type (after lower-casing and dropping
    punctuation). Dev holds two whole cores (cores 4 and 11, every frame) out of training, so
    model selection sees unseen wordings without ever reading the held-out templates."""
    held = [_norm(t) for ts in HELD_OUT.values() for t in ts]
    train: list[str] = []
    dev: list[str] = []
    for i, core in enumerate(CORES[qtype]):
        for frame in FRAMES:
            text = frame.format(q=core)
            n = _norm(text)
            if not any(h in n or n in h for h in held):
                (dev if i in (4, 11) else train).append(text)
    return tuple(train), tuple(dev)


#: Question templates by type: (train, held-out).
TEMPLATES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    qtype: (_split(qtype)[0], HELD_OUT[qtype]) for qtype in HELD_OUT
}
#: Dev templates by type: unseen in training, used for the ``eval/val`` set (model selection).
DEV_TEMPLATES: dict[str, tuple[str, ...]] = {qtype: _split(qtype)[1] for qtype in HELD_OUT}
QUESTION_TYPES = tuple(TEMPLATES)
#: The captioning instruction of the chat data (a train template; evaluation uses the same).
DESCRIBE = "Describe the picture."


@dataclass(frozen=True)
class Thing:
    shape: str
    colour: str
    size: str
    cell: int

    def phrase(self) -> str:
        return f"a {self.size} {self.colour} {self.shape} in the {CELLS[self.cell]}"


@dataclass(frozen=True)
class Scene:
    things: tuple[Thing, ...]
    """In cell order; each object centred in its cell."""


@dataclass(frozen=True)
class Question:
    qtype: str
    template: str
    question: str
    answer: str


def make_scene(rng: np.random.Generator) -> Scene:
    n = int(rng.integers(1, 5))
    cells = rng.permutation(4)[:n]
    pairs = rng.permutation(len(SHAPES) * len(COLOURS))[:n]
    colours = list(COLOURS)
    things = tuple(
        Thing(
            SHAPES[int(p) % len(SHAPES)],
            colours[int(p) // len(SHAPES)],
            SIZES[int(rng.integers(0, 2))],
            int(c),
        )
        for p, c in sorted(zip(pairs, cells, strict=True), key=lambda pc: int(pc[1]))
    )
    return Scene(things)


def scenes(seed: int, count: int) -> list[Scene]:
    """``count`` scenes drawn from ``seed`` (the same list for the same arguments)."""
    rng = np.random.default_rng([seed, 0x5CE])
    return [make_scene(rng) for _ in range(count)]


def render(scene: Scene, size: int = 32) -> Image.Image:
    """The scene as an RGB image of ``size`` x ``size`` (drawn at 4x and downsampled)."""
    big = size * 4
    image = Image.new("RGB", (big, big), BACKGROUND)
    draw = ImageDraw.Draw(image)
    half = big // 2
    for thing in scene.things:
        radius = (0.42 if thing.size == "big" else 0.28) * half
        cx = (thing.cell % 2) * half + half / 2
        cy = (thing.cell // 2) * half + half / 2
        box = (cx - radius, cy - radius, cx + radius, cy + radius)
        fill = COLOURS[thing.colour]
        if thing.shape == "circle":
            draw.ellipse(box, fill=fill)
        elif thing.shape == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon(
                [(cx, cy - radius), (cx - radius, cy + radius), (cx + radius, cy + radius)], fill=fill
            )
    return image.resize((size, size), Image.Resampling.BOX)


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG", optimize=False)
    return out.getvalue()


def caption(scene: Scene) -> str:
    """One sentence naming every object, in cell order."""
    count = NUMBERS[len(scene.things)]
    noun = "shape" if len(scene.things) == 1 else "shapes"
    return f"{count} {noun}: " + ", ".join(t.phrase() for t in scene.things) + "."


def description(scene: Scene) -> str:
    """Sentences for a document: the count, then one sentence per object."""
    noun = "shape" if len(scene.things) == 1 else "shapes"
    head = f"It shows {NUMBERS[len(scene.things)]} {noun}."
    return " ".join(
        [head, *(f"The {t.colour} {t.shape} is {t.size} and in the {CELLS[t.cell]}." for t in scene.things)]
    )


def _fill(template: str, thing: Thing | None) -> str:
    if thing is None:
        return template
    return template.format(shape=thing.shape, colour=thing.colour, pos=CELLS[thing.cell])


def question(scene: Scene, qtype: str, template: str, rng: np.random.Generator) -> Question | None:
    """A question of ``qtype`` about ``scene`` phrased by ``template``, with its answer; ``None``
    when the scene cannot answer it unambiguously (a colour question needs a shape seen once)."""
    things = scene.things
    if qtype == "count":
        return Question(qtype, template, template, NUMBERS[len(things)])
    if qtype == "colour":
        unique = [t for t in things if sum(u.shape == t.shape for u in things) == 1]
        if not unique:
            return None
        thing = unique[int(rng.integers(0, len(unique)))]
        return Question(qtype, template, _fill(template, thing), thing.colour)
    thing = things[int(rng.integers(0, len(things)))]
    answer = thing.shape if qtype == "shape" else CELLS[thing.cell]
    return Question(qtype, template, _fill(template, thing), answer)


def vqa_items(
    seed: int, count: int, held_out: bool, size: int = 32, dev: bool = False
) -> list[tuple[Scene, Question]]:
    """``count`` (scene, question) pairs, question types in turn, templates drawn from the train
    set (``held_out=False``), the dev set (``dev=True``: train-side wordings never trained on) or
    only from the held-out set."""
    rng = np.random.default_rng([seed, 0x0A, int(held_out)])
    out: list[tuple[Scene, Question]] = []
    while len(out) < count:
        scene = make_scene(rng)
        qtype = QUESTION_TYPES[len(out) % len(QUESTION_TYPES)]
        train_pool = DEV_TEMPLATES[qtype] if dev else TEMPLATES[qtype][0]
        pool = TEMPLATES[qtype][1] if held_out else train_pool
        q = question(scene, qtype, pool[int(rng.integers(0, len(pool)))], rng)
        if q is not None:
            out.append((scene, q))
    return out


def chat(text: str, answer: str) -> list[dict[str, object]]:
    """A one-turn VQA chat in the OpenAI content-part shape: image, then the question."""
    return [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]},
        {"role": "assistant", "content": answer},
    ]


def document(group: list[Scene]) -> list[dict[str, object]]:
    """An interleaved document: text, image, text, ... (segments ``{"text"}`` / ``{"image": i}``)."""
    ordinals = ("first", "second", "third", "fourth")
    segments: list[dict[str, object]] = [{"text": f"Here are {NUMBERS[len(group)]} pictures."}]
    for i, scene in enumerate(group):
        segments.append({"text": f" The {ordinals[i]} picture:"})
        segments.append({"image": i})
        segments.append({"text": " " + description(scene)})
    return segments


def world_text(seed: int, count: int) -> str:
    """Plain text of the world for pre-training the language model (captions, descriptions and
    train-template questions with answers, one paragraph each; no held-out template)."""
    rng = np.random.default_rng([seed, 0x7E])
    paragraphs = []
    for scene in scenes(seed, count):
        paragraphs.append(f"The picture shows {caption(scene)}")
        paragraphs.append(description(scene))
        qtype = QUESTION_TYPES[int(rng.integers(0, len(QUESTION_TYPES)))]
        pool = TEMPLATES[qtype][0]
        q = question(scene, qtype, pool[int(rng.integers(0, len(pool)))], rng)
        if q is not None:
            paragraphs.append(f"User: {q.question}\nAssistant: {q.answer}")
    return "\n\n".join(paragraphs) + "\n"
