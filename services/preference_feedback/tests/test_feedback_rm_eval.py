"""`forge rm eval`: a tiny real reward model whose rewards are known, HH-RLHF-format pairs, the
benchmark contract's summary.json, and a version resolved through the registry over gRPC.

The model is a real ``LlamaForSequenceClassification`` (one layer, one label) saved with
``save_pretrained`` next to a word-level tokenizer with the trainer's chat template. Its one
layer adds nothing to the residual stream (zero output projections), so the reward is a fixed
function of the last non-padding token: "good" scores +2.83, "bad" -2.83, every other word 0.
That makes the accuracy of a pairs file computable by hand — and checks that the reward is read
at the last token of the response, past the padding of the shorter sequence in the batch.
"""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from forge.feedback.v1 import feedback_pb2_grpc
from typer.testing import CliRunner

from forge_kit.grpckit import GrpcServer
from forge_kit.stats import wilson_interval
from forge_kit.testing.grpcserver import grpc_test_server
from forge_preference_feedback.api import FeedbackApi
from forge_preference_feedback.registry import HeldoutAccuracy, RewardModelRegistry
from forge_preference_feedback.rm_cli import app
from forge_training.pairs import fit

if TYPE_CHECKING:
    from forge_preference_feedback.service import FeedbackService

torch = pytest.importorskip("torch", reason="pip install -e 'services/preference_feedback[rm]'")
transformers = pytest.importorskip("transformers", reason="pip install -e 'services/preference_feedback[rm]'")
tokenizers = pytest.importorskip("tokenizers")

EOT = "<|endoftext|>"
# The trainer's chat template (services/trainer_agent/.../pairs.py), as its export stores it.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ 'User: ' + m['content'] + '\\n' }}"
    "{% else %}{{ 'Assistant: ' + m['content'] + eos_token + '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
WORDS = [
    "User",
    "Assistant",
    ":",
    "question",
    "answer",
    "is",
    "it",
    "a",
    "the",
    "good",
    "bad",
    "fine",
    "okay",
    "maybe",
    "more",
    "about",
    "cats",
    "dogs",
]
TOKEN = "rm-test-token"


def transcript(*turns: str) -> str:
    """``"\\n\\nHuman: …\\n\\nAssistant: …"`` from alternating turns, Human first."""
    return "".join(f"\n\n{'Human' if i % 2 == 0 else 'Assistant'}: {t}" for i, t in enumerate(turns))


def pair(question: str, chosen: str, rejected: str, *earlier: str) -> dict[str, str]:
    return {
        "chosen": transcript(*earlier, question, chosen),
        "rejected": transcript(*earlier, question, rejected),
    }


# 5 ranked right, 2 ranked wrong, 3 ties (neither last word is good or bad); 2 unusable rows.
PAIRS = [
    pair("question about cats", "the answer is good", "the answer is bad"),
    pair("question about dogs", "good", "a bad"),
    pair("question", "it is maybe more good", "bad"),
    pair("question about cats", "answer good", "answer fine", "question", "answer"),  # multi-turn
    pair("question about dogs", "okay", "the answer is more bad"),
    pair("question", "the answer is bad", "it is good"),
    pair("question about cats", "bad", "good"),
    pair("question", "fine", "okay"),
    pair("question about dogs", "the answer is fine", "maybe"),
    pair("question", "okay okay", "it is a cats answer"),
    pair("question", "same answer", "same answer"),  # identical: skipped
    {"chosen": "\n\nHuman: question", "rejected": "\n\nHuman: question"},  # no Assistant turn: skipped
]
RIGHT, WRONG, TIES = 5, 2, 3
# By which reply has more words: preferred-longer rows 3, 6, 9 (right, wrong, tie: 1.5 of 3),
# preferred-shorter rows 2, 5, 10 (right, right, tie: 2.5 of 3), equal rows 1, 4, 7, 8 (2.5 of 4).
BY_LENGTH = {"preferred_longer": (1.5, 3), "preferred_shorter": (2.5, 3), "tie": (2.5, 4)}


def tiny_reward_model(folder: Path) -> Path:
    """Save the model described in the module docstring and its tokenizer to ``folder``."""
    vocab = {EOT: 0, "[UNK]": 1} | {w: i + 2 for i, w in enumerate(WORDS)}
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.Sequence(
        [tokenizers.pre_tokenizers.Whitespace(), tokenizers.pre_tokenizers.Punctuation()]
    )
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=EOT, pad_token=EOT, unk_token="[UNK]"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    hidden = 8
    config = transformers.LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=hidden,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        num_labels=1,
        pad_token_id=0,
    )
    model = transformers.LlamaForSequenceClassification(config)
    with torch.no_grad():
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, 1] = 1.0  # every word: reward 0
        model.model.embed_tokens.weight[vocab["good"]] = torch.eye(hidden)[0]
        model.model.embed_tokens.weight[vocab["bad"]] = -torch.eye(hidden)[0]
        model.score.weight.zero_()
        model.score.weight[0, 0] = 1.0
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_reward_model(tmp_path_factory.mktemp("rm") / "hf")


@pytest.fixture
def pairs_file(tmp_path: Path) -> Path:
    path = tmp_path / "test.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        for row in PAIRS:
            handle.write(json.dumps(row) + "\n")
    return path


def test_eval_writes_the_contract_summary_with_known_accuracy(
    checkpoint: Path, pairs_file: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app,
        [
            "eval",
            "--checkpoint",
            str(checkpoint),
            "--pairs",
            str(pairs_file),
            "--out",
            str(out),
            "--batch-size",
            "3",
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    n = RIGHT + WRONG + TIES
    low, high = wilson_interval(RIGHT + TIES / 2, n)
    assert set(summary) == {"accuracy", "ci95_low", "ci95_high", "n", "by_length"}
    assert summary["n"] == n and summary["accuracy"] == pytest.approx((RIGHT + TIES / 2) / n)
    assert (summary["ci95_low"], summary["ci95_high"]) == (pytest.approx(low), pytest.approx(high))
    assert summary["by_length"]["unit"] == "words"
    for stratum, (wins, count) in BY_LENGTH.items():
        figures = summary["by_length"][stratum]
        s_low, s_high = wilson_interval(wins, count)
        assert figures == {
            "accuracy": pytest.approx(wins / count),
            "ci95_low": pytest.approx(s_low),
            "ci95_high": pytest.approx(s_high),
            "n": count,
        }
    details = json.loads((out / "details.json").read_text())
    assert details["interval"] == "wilson" and details["ties"] == TIES
    assert details["skipped"] == {"identical responses": 1, "no final Assistant turn": 1}
    with gzip.open(out / "scores.jsonl.gz", "rt") as handle:
        first = json.loads(handle.readline())
    assert (
        first["line"] == 1
        and first["length"] == "tie"
        and first["reward_chosen"] == pytest.approx(8**0.5, rel=1e-3)
    )
    assert first["reward_rejected"] == pytest.approx(-(8**0.5), rel=1e-3)


def test_bad_input_is_refused_naming_the_line_and_field(checkpoint: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(PAIRS[0]) + "\n" + json.dumps({"chosen": "x"}) + "\n")
    refused = runner.invoke(
        app, ["eval", "--checkpoint", str(checkpoint), "--pairs", str(broken), "--out", str(tmp_path / "o")]
    )
    assert refused.exit_code == 2 and "line 2: 'rejected' must be a string" in refused.output
    assert not (tmp_path / "o" / "summary.json").exists()
    both = runner.invoke(
        app,
        [
            "eval",
            "--checkpoint",
            str(checkpoint),
            "--version",
            "latest",
            "--pairs",
            str(broken),
            "--out",
            "o",
        ],
    )
    assert both.exit_code == 2 and "exactly one of --checkpoint" in both.output
    not_a_model = runner.invoke(
        app, ["eval", "--checkpoint", str(tmp_path), "--pairs", str(broken), "--out", str(tmp_path / "o")]
    )
    assert not_a_model.exit_code == 2 and "no config.json" in not_a_model.output


def test_long_pairs_keep_half_for_the_response_and_cut_the_prompt_from_the_left() -> None:
    prompt, (good, bad) = fit(list(range(100)), [list(range(200, 230)), list(range(300, 305))], 40)
    assert good == list(range(200, 220)) and bad == list(range(300, 305))
    assert prompt == list(range(80, 100))  # the latest 20 prompt tokens
    assert fit([1, 2], [[3], [4, 5]], 40) == ([1, 2], [[3], [4, 5]])


@pytest.fixture
async def registry_server(
    service: FeedbackService, registry: RewardModelRegistry
) -> AsyncIterator[GrpcServer]:
    async with grpc_test_server(
        feedback_pb2_grpc.add_PreferenceFeedbackServiceServicer_to_server,
        FeedbackApi(service, registry, max_page_size=100),
        "forge.feedback.v1.PreferenceFeedbackService",
        token=TOKEN,
        service="preference_feedback",
    ) as started:
        yield started


@pytest.mark.asyncio
async def test_version_latest_resolves_through_the_registry(
    registry_server: GrpcServer,
    registry: RewardModelRegistry,
    checkpoint: Path,
    pairs_file: Path,
    tmp_path: Path,
) -> None:
    heldout = HeldoutAccuracy(0.6, 0.5, 0.7, 100, "wilson")
    for uri in ("file:///nowhere/old", f"file://{checkpoint}"):
        await registry.register(
            "rm-tiny", "", uri=uri, snapshot_id="snap-1", backbone="tiny", heldout=heldout, registered_by="t"
        )
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    args = ["eval", "--version", "latest", "--name", "rm-tiny", "--pairs", str(pairs_file)]
    args += [
        "--out",
        str(tmp_path / "out"),
        "--target",
        f"127.0.0.1:{registry_server.port}",
        "--token-file",
        str(token_file),
    ]
    # The CLI runs its own event loop (asyncio.run); the test's loop serves the registry.
    result = await asyncio.to_thread(CliRunner().invoke, app, args)
    assert result.exit_code == 0, result.output
    details = json.loads((tmp_path / "out" / "details.json").read_text())
    assert details["reward_model"] == "rm-tiny:2" and details["checkpoint"] == str(checkpoint)
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["n"] == RIGHT + WRONG + TIES
    missing = await asyncio.to_thread(CliRunner().invoke, app, [*args[:4], "other", *args[5:]])
    assert missing.exit_code == 1 and "NOT_FOUND" in missing.output
    # Registering from that summary records the accuracy by which reply is longer with the version.
    target = ["--target", f"127.0.0.1:{registry_server.port}", "--token-file", str(token_file)]
    summary_file = str(tmp_path / "out" / "summary.json")
    register = ["register", "rm-tiny", "--uri", f"file://{checkpoint}", "--snapshot", "snap-2"]
    register += ["--backbone", "tiny", "--summary", summary_file, "--json", *target]
    result = await asyncio.to_thread(CliRunner().invoke, app, register)
    assert result.exit_code == 0, result.output
    row = await registry.get("rm-tiny", "3")
    wins, count = BY_LENGTH["preferred_shorter"]
    assert row.metrics["heldout_preferred_shorter_accuracy"] == pytest.approx(wins / count)
    assert row.metrics["heldout_preferred_shorter_n"] == count
    assert row.metrics["heldout_preferred_shorter_ci95_low"] == pytest.approx(wilson_interval(wins, count)[0])
    listed = await asyncio.to_thread(
        CliRunner().invoke, app, ["list", "--name", "rm-tiny", *target], env={"COLUMNS": "250"}
    )
    assert listed.exit_code == 0 and f"{wins / count:.3f} [" in listed.output


# -- an encoder (BERT) reward model ------------------------------------------------------------

# The trainer's template for encoders (services/trainer_agent/.../pairs.py): no end-of-text token.
ENCODER_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ 'User: ' + m['content'] + '\\n' }}"
    "{% else %}{{ 'Assistant: ' + m['content'] + '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
ENCODER_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]


def tiny_bert_reward_model(folder: Path, model_max_length: int) -> Path:
    """A seeded random one-layer ``BertForSequenceClassification`` (one label) and a word-level
    tokenizer that wraps every sequence in ``[CLS] … [SEP]``, as the trainer's encoder export is."""
    vocab = {t: i for i, t in enumerate(ENCODER_SPECIALS)} | {w: i + 4 for i, w in enumerate(WORDS)}
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.Sequence(
        [tokenizers.pre_tokenizers.Whitespace(), tokenizers.pre_tokenizers.Punctuation()]
    )
    core.post_processor = tokenizers.processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
    )
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core,
        cls_token="[CLS]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        unk_token="[UNK]",
        model_max_length=model_max_length,
        truncation_side="left",
    )
    tokenizer.chat_template = ENCODER_CHAT_TEMPLATE
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=len(vocab),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=64,
        num_labels=1,
        pad_token_id=0,
    )
    transformers.BertForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_an_encoder_checkpoint_is_read_at_cls_with_the_end_of_each_transcript_kept(tmp_path: Path) -> None:
    from forge_training.rm.eval import RewardModel

    folder = tiny_bert_reward_model(tmp_path / "bert", model_max_length=12)
    model = RewardModel(folder)
    assert model.max_length == 12  # the length it was trained at, not its 64 positions
    assert RewardModel(folder, max_length=40).max_length == 40
    assert RewardModel(folder, max_length=100).max_length == 64  # never past the positions
    tok = model.tokenizer
    cls_id, sep_id = tok.convert_tokens_to_ids(["[CLS]", "[SEP]"])
    long_answer = "the answer is fine it is more about cats maybe good okay"  # 12 words: longer than 10
    row = pair("question about dogs", long_answer, "bad", "question about cats", "okay")
    (scored,) = read_pairs_from([row], tmp_path)
    chosen, rejected = model.encode(scored)
    assert len(chosen) == 12 and chosen[0] == cls_id and chosen[-1] == sep_id
    assert tok.decode(chosen[1:-1]) == " ".join(long_answer.split()[-10:])  # the response's end
    # the oldest turns go first: 10 tokens from the end of the conversation
    assert tok.decode(rejected[1:-1]) == ": okay User : question about dogs Assistant : bad"
    # forge rm eval scores those sequences: each reward is the model's own output on them.
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app,
        ["eval", "--checkpoint", str(folder), "--pairs", str(tmp_path / "pairs.jsonl"), "--out", str(out)],
    )
    assert result.exit_code == 0, result.output
    assert json.loads((out / "summary.json").read_text())["n"] == 1
    with gzip.open(out / "scores.jsonl.gz", "rt") as handle:
        scores = json.loads(handle.readline())
    bert = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        direct = [float(bert(input_ids=torch.tensor([ids])).logits) for ids in (chosen, rejected)]
    assert scores["reward_chosen"] == pytest.approx(direct[0], abs=1e-5)
    assert scores["reward_rejected"] == pytest.approx(direct[1], abs=1e-5)
    assert json.loads((out / "details.json").read_text())["max_length"] == 12


def read_pairs_from(rows: list[dict[str, str]], folder: Path) -> list[Any]:
    """``rows`` written to ``folder/pairs.jsonl`` and read back as scorable pairs."""
    from collections import Counter

    from forge_training.rm.eval import read_pairs

    path = folder / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return list(read_pairs(path, Counter()))
