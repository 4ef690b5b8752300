"""The OpenAI request bodies Forge serves, in one copy: the model server parses them (as vLLM does)
and the gateway validates and documents them (its OpenAPI document).

Fields the OpenAI API defines that Forge cannot honour are refused by name
(:func:`refuse_unsupported`: 400 ``unsupported_parameter``) rather than silently ignored; other
unknown fields are ignored, as vLLM ignores them. The new sampling parameters are checked here
against vLLM's ranges (400 naming the parameter); the vocabulary-dependent checks (``logit_bias``
token ids, token-id prompts) belong to the engine that knows the vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, GetJsonSchemaHandler, model_validator
from pydantic import ValidationError as PydanticValidationError
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

from forge_kit import errors
from forge_kit.modelref import NAME_MAX, VERSION_MAX, ModelRef
from forge_kit.openai_errors import error_path
from forge_kit.validate import MAX_URI_CHARS, FiniteFloat, PrintableName, Seed

#: Most choices one request may ask for (``n``).
MAX_N = 16
#: Most entries of ``logit_bias`` (OpenAI's own limit).
MAX_LOGIT_BIAS = 300
#: Most inputs one ``/v1/embeddings`` call may carry.
MAX_EMBEDDING_INPUTS = 256
#: Most characters of one embedding input.
MAX_EMBEDDING_CHARS = 8192
#: Most ``image_url`` parts in one chat message.
MAX_IMAGES_PER_MESSAGE = 16

BodyT = TypeVar("BodyT", bound=BaseModel)
_WORD = r"[A-Za-z0-9][A-Za-z0-9._-]"
#: What a generation's ``model`` may be: a model or alias name, or ``name:version`` — the kit's
#: :class:`~forge_kit.modelref.ModelRef` grammar, as a JSON-schema pattern.
MODEL_PATTERN = rf"^{_WORD}{{0,{NAME_MAX - 1}}}(:{_WORD}{{0,{VERSION_MAX - 1}}})?$"
#: What an embedding ``model`` may be: the embedder's name, ``org/name`` included.
EMBEDDING_MODEL_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,255}$"
TokenId = Annotated[int, Field(ge=0)]


def _model_ref(model: str) -> str:
    """``model`` when it is a model reference (the kit's grammar, its error message otherwise)."""
    ModelRef.parse(model)
    return model


#: OpenAI fields this server cannot honour, with the values that ask for nothing (and so pass).
_UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    "use_beam_search": (None, False),
    "best_of": (None, 1),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "suffix": (None, ""),
    "web_search_options": (None,),
}


#: Parameters whose ``null`` is their default (clients send ``null`` for "not set").
_NULL_MEANS_DEFAULT = frozenset(
    {"n", "stream", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "priority",
     "ignore_eos", "echo", "logprobs"}
)  # fmt: skip


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingBody(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="allow")

    model: Annotated[str, AfterValidator(_model_ref)] = Field(
        json_schema_extra={"pattern": MODEL_PATTERN},
        description="A served model (``name[:version]``) or an alias.",
    )
    max_tokens: int | None = None
    temperature: FiniteFloat | None = None
    top_p: FiniteFloat | None = None
    n: int = Field(default=1, ge=1, le=MAX_N, description="Choices to generate.")
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    top_k: int | None = Field(
        default=None, ge=-1, description="Keep the k most likely tokens; -1 or 0 keeps all."
    )
    prompt_logprobs: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = Field(
        default=0.0, ge=-2, le=2, description="Subtracted from the logits of tokens already generated."
    )
    frequency_penalty: float = Field(
        default=0.0, ge=-2, le=2, description="Subtracted per time a token was generated."
    )
    repetition_penalty: float = Field(
        default=1.0, gt=0, description="Divides the logits of prompt and generated tokens (1 = off)."
    )
    logit_bias: dict[str, float] | None = Field(
        default=None, description="Token id → bias added to its logit, -100 to 100."
    )
    min_tokens: int = Field(default=0, ge=0, description="Tokens to generate before EOS or a stop may end.")
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """``null`` for a parameter with a default means the default, as OpenAI's API reads it."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in _NULL_MEANS_DEFAULT)}
        return data

    @classmethod
    def __get_pydantic_json_schema__(cls, core: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        """The document says what the validator does: those parameters may be ``null``."""
        schema = handler.resolve_ref_schema(handler(core))
        for name, prop in schema.get("properties", {}).items():
            if name in _NULL_MEANS_DEFAULT and "anyOf" not in prop:
                nullable = {k: v for k, v in prop.items() if k not in ("title", "description", "default")}
                for key in nullable:
                    prop.pop(key)
                prop["anyOf"] = [nullable, {"type": "null"}]
        return schema

    def extra_fields(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class CompletionBody(SamplingBody):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]] = Field(
        description="Text, a list of texts, token ids, or a list of token-id lists."
    )
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageUrl(BaseModel):
    url: str
    detail: str | None = None


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessageBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionBody(SamplingBody):
    messages: list[ChatMessageBody]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = Field(default=None, description="Newer name of max_tokens.")


class EmbeddingBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(pattern=EMBEDDING_MODEL_PATTERN)
    input: str | list[str] | list[TokenId] | list[list[TokenId]] = Field(
        description=f"A text or a list of 1 to {MAX_EMBEDDING_INPUTS} texts (token ids are refused)."
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


#: Most token ids one ``/detokenize`` call may carry.
MAX_DETOKENIZE_TOKENS = 1 << 17


class TokenizeBody(BaseModel):
    """vLLM's ``/tokenize`` body: a ``prompt``, or chat ``messages`` rendered with the template.
    Without ``model``, the one model served (as vLLM, which serves one, reads it: what
    lm-evaluation-harness's remote tokenizer sends)."""

    model_config = ConfigDict(extra="ignore")

    model: PrintableName | None = None
    prompt: str | None = None
    messages: list[ChatMessageBody] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeBody(BaseModel):
    """vLLM's ``/detokenize`` body: token ids to decode; ``model`` as in :class:`TokenizeBody`."""

    model_config = ConfigDict(extra="ignore")

    model: PrintableName | None = None
    tokens: list[TokenId] = Field(max_length=MAX_DETOKENIZE_TOKENS)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """Every error answer: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail


def parse(model: type[BodyT], raw: object) -> BodyT:
    """``raw`` JSON as ``model``; a malformed field is a 400 naming it (dotted path)."""
    try:
        return model.model_validate(raw)
    except PydanticValidationError as exc:
        first = exc.errors()[0]
        field = error_path(raw, first["loc"], missing=first["type"] == "missing")
        raise errors.ValidationError(field, str(first["msg"])) from None


def message_text(message: ChatMessageBody, index: int) -> str:
    """A message's text: a string as is, a list of text parts joined with newlines (as vLLM joins
    them); an image part is refused, naming it (for the callers that take text only)."""
    texts = []
    for part in message_parts(message, index):
        if isinstance(part, ImageRef):
            raise errors.ValidationError(part.param, "image parts are not supported here")
        texts.append(part)
    return "\n".join(texts)


@dataclass(frozen=True)
class ImageRef:
    """An ``image_url`` part of a chat message: where it is (``messages.0.content.1``) and its URL
    (a ``data:`` URI or an http(s) address), checked for form only."""

    param: str
    url: str


def message_parts(message: ChatMessageBody, index: int) -> list[str | ImageRef]:
    """A message's content in order: texts, and the images as :class:`ImageRef` (form checked:
    a ``data:image/…`` URI, or an http(s) URL of at most :data:`MAX_URI_CHARS` characters)."""
    content = message.content
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    parts: list[str | ImageRef] = []
    for j, part in enumerate(content):
        if isinstance(part, TextPart):
            parts.append(part.text)
            continue
        param, url = f"messages.{index}.content.{j}", part.image_url.url
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            if not url[5:].lower().startswith("image/"):
                raise errors.ValidationError(param, "a data URI must hold an image (data:image/...)")
        elif scheme in ("http", "https"):
            if len(url) > MAX_URI_CHARS:
                raise errors.ValidationError(
                    param, f"an image URL must be at most {MAX_URI_CHARS} characters"
                )
        else:
            raise errors.ValidationError(
                param, "image_url.url must be a data:image/... URI or an http(s) URL"
            )
        parts.append(ImageRef(param, url))
    if sum(isinstance(p, ImageRef) for p in parts) > MAX_IMAGES_PER_MESSAGE:
        raise errors.ValidationError(
            f"messages.{index}.content", f"at most {MAX_IMAGES_PER_MESSAGE} images per message"
        )
    return parts


def refuse_unsupported(fields: dict[str, Any]) -> None:
    """400 ``unsupported_parameter`` for the first field asking for what Forge cannot do."""
    for name in sorted(fields):
        allowed = _UNSUPPORTED.get(name)
        if allowed is not None and fields[name] not in allowed:
            raise errors.UnsupportedParameterError(name, "is not supported by this server")


def check_sampling(body: SamplingBody) -> None:
    """The new sampling parameters against vLLM's ranges; the first bad one is named."""
    refuse_unsupported(body.extra_fields())
    if not 1 <= body.n <= MAX_N:
        raise errors.ValidationError("n", f"must be between 1 and {MAX_N}, got {body.n}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(body, name)
        if not (math.isfinite(value) and -2.0 <= value <= 2.0):
            raise errors.ValidationError(name, f"must be between -2 and 2, got {value}")
    if not (math.isfinite(body.repetition_penalty) and body.repetition_penalty > 0.0):
        raise errors.ValidationError(
            "repetition_penalty", f"must be a number above 0, got {body.repetition_penalty}"
        )
    if body.top_k is not None and body.top_k < -1:
        raise errors.ValidationError("top_k", f"must be -1 (all), 0 (all) or positive, got {body.top_k}")
    if body.min_tokens < 0:
        raise errors.ValidationError("min_tokens", f"must not be negative, got {body.min_tokens}")
    if body.min_tokens and body.max_tokens is not None and body.min_tokens > body.max_tokens:
        raise errors.ValidationError(
            "min_tokens", f"must not exceed max_tokens ({body.max_tokens}), got {body.min_tokens}"
        )
    logit_bias(body.logit_bias)


def logit_bias(raw: dict[str, float] | None) -> dict[int, float]:
    """``logit_bias`` with integer token ids; ids and biases out of range are named."""
    if not raw:
        return {}
    if len(raw) > MAX_LOGIT_BIAS:
        raise errors.ValidationError("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(raw)}")
    out: dict[int, float] = {}
    for key, value in raw.items():
        try:
            token = int(key)
        except ValueError:
            raise errors.ValidationError("logit_bias", f"keys must be token ids, got {key!r}") from None
        if token < 0:
            raise errors.ValidationError("logit_bias", f"token id {token} is negative")
        if not (math.isfinite(value) and -100.0 <= value <= 100.0):
            raise errors.ValidationError("logit_bias", f"biases must be between -100 and 100, got {value}")
        out[token] = float(value)
    return out
