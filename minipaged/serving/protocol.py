"""The OpenAI-compatible protocol of ``minipaged serve``: request bodies, errors, streamed text.

vLLM's ``entrypoints/openai/protocol.py`` is the reference for names, defaults and checks:

* ``CompletionRequest``, ``ChatCompletionRequest``, ``TokenizeRequest``, ``DetokenizeRequest``:
  OpenAI's fields and vLLM's sampling extras. ``null`` for a field means its default.
  A field this server does not implement is refused with a 400 whose ``param`` names it
  (``REFUSED``), unless it holds its no-op value; any other unknown field is ignored with a
  warning in the log, as vLLM does. ``prompt_logprobs`` (vLLM's extra field) asks the engine
  for the prompt's log-probabilities; completions with ``echo`` and ``logprobs`` ask for them
  too (``CompletionRequest.engine_prompt_logprobs``), and ``max_tokens: 0`` with ``echo`` is
  the prompt alone (``CompletionRequest.prompt_only``): what a scorer such as
  lm-evaluation-harness sends.
* ``OpenAIError``: an HTTP error with OpenAI's body ``{"error": {"message", "type", "param",
  "code"}}`` and vLLM's type names (``BadRequestError``, ``NotFoundError``, ...).
* ``ChoiceText``: one choice's text as its tokens arrive: decoded incrementally (each token
  once, ``minipaged.common.detokenizer``), cut at the first stop string, and, while it runs,
  holding back any tail that could still become a stop string (or an unfinished UTF-8
  character), so that the streamed pieces join to the final text.
* ``render_chat``: a chat's messages through the model's chat template (Jinja, sandboxed,
  with transformers' settings).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from http import HTTPStatus
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from minipaged.common.detokenizer import IncrementalDetokenizer
from minipaged.common.sampling_params import SamplingParams, find_stop_string

logger = logging.getLogger("minipaged.serving")

DEFAULT_MAX_LOGPROBS = 20  # vLLM's --max-logprobs


class OpenAIError(Exception):
    """An HTTP error answered with OpenAI's error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param

    def body(self) -> dict:
        return error_body(self.message, self.status, self.param)


def error_type(status: int) -> str:
    """vLLM's type names: the status phrase, CamelCase, ending in ``Error``."""
    if status == 413:  # Python 3.13 renamed its phrase; keep one name
        return "RequestEntityTooLargeError"
    phrase = HTTPStatus(status).phrase.replace("-", " ").title().replace(" ", "")
    return phrase if phrase.endswith("Error") else phrase + "Error"


def error_body(message: str, status: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": status}}


# Fields of OpenAI's or vLLM's API that minipaged does not implement, with the values that
# ask for nothing (accepted); any other value is a 400 naming the field.
REFUSED: dict[str, tuple] = {
    "suffix": (None, ""),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "logits_processors": (None,),
    "truncate_prompt_tokens": (None,),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "guided_decoding_backend": (None,), "guided_whitespace_pattern": (None,), "structured_outputs": (None,),
    "response_format": (None, {"type": "text"}),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0),
    "priority": (None, 0),
    "prompt_embeds": (None,),
    "return_tokens_as_token_ids": (None, False),
    "return_token_ids": (None, False),
    "cache_salt": (None,),
    "kv_transfer_params": (None,),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "chat_template": (None,),
    "continue_final_message": (None, False),
    "documents": (None,),
    "mm_processor_kwargs": (None,),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "request_id": (None,),
}
ACCEPTED_NO_OP = {"user", "store", "metadata", "service_tier", "parallel_tool_calls"}  # no effect on the output


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class OpenAIRequest(BaseModel):
    """What completions and chat share: sampling fields, with OpenAI's and vLLM's defaults."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = Field(1, ge=1)
    best_of: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1  # vLLM: -1 or 0 keep every token
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(0, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    prompt_logprobs: int | None = Field(None, ge=0)  # vLLM's: per prompt token, its logprob and the top k

    @model_validator(mode="before")
    @classmethod
    def null_means_default(cls, data: Any) -> Any:
        """``null`` for a field means its default, as if the field were absent."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    def check_fields(self) -> None:
        """Refuse what is not implemented (400 naming the field); log what is unknown."""
        for name, value in (self.model_extra or {}).items():
            if name in REFUSED:
                if value not in REFUSED[name]:
                    raise OpenAIError(f"{name} is not supported by this server", 400, name)
            elif name not in ACCEPTED_NO_OP:
                logger.warning("The following field was present in the request but ignored: %s", name)
        if self.best_of is not None and self.best_of != self.n:
            raise OpenAIError("best_of other than n is not supported", 400, "best_of")
        if self.stream_options is not None and not self.stream:
            raise OpenAIError("stream_options may only be set when stream is true", 400, "stream_options")
        if self.prompt_logprobs is not None and self.stream:  # vLLM's rule: a stream has no place for them
            raise OpenAIError("prompt_logprobs are not available when stream is true", 400, "prompt_logprobs")
        if self.top_k < -1:
            raise OpenAIError("top_k must be -1 or 0 (off), or at least 1", 400, "top_k")

    @property
    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    def sampling_params(self, max_tokens: int, logprobs: int | None, vocab_size: int,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's ``SamplingParams``; 400 naming the field for anything out of range."""
        bias = None
        if self.logit_bias:
            bias = {}
            for key, value in self.logit_bias.items():
                try:
                    token = int(key)
                except ValueError:
                    raise OpenAIError(f"logit_bias keys must be token ids, got {key!r}", 400, "logit_bias") from None
                if not 0 <= token < vocab_size or not math.isfinite(value):
                    raise OpenAIError(f"logit_bias: token {token} is outside the vocabulary ({vocab_size})",
                                      400, "logit_bias")
                bias[token] = min(100.0, max(-100.0, value))  # OpenAI's range, clamped as vLLM does
        bad_stop = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad_stop:
            raise OpenAIError(f"stop_token_ids outside the vocabulary: {bad_stop[:5]}", 400, "stop_token_ids")
        fields: dict[str, Any] = {
            "n": self.n, "max_tokens": max_tokens, "temperature": self.temperature,
            "top_k": -1 if self.top_k in (0, -1) else self.top_k, "top_p": self.top_p, "min_p": self.min_p,
            "seed": self.seed, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "repetition_penalty": self.repetition_penalty,
            "logit_bias": bias, "min_tokens": self.min_tokens, "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos, "logprobs": logprobs, "prompt_logprobs": prompt_logprobs}
        try:
            return SamplingParams(**fields)
        except ValueError as err:
            param = next((name for name in fields if f"SamplingParams.{name}" in str(err)), None)
            raise OpenAIError(str(err), 400, param) from None


def is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(type(t) is int for t in value)


class CompletionRequest(OpenAIRequest):
    """``POST /v1/completions``."""

    # a string, strings, token ids, or lists of token ids: checked by hand below, because a
    # union of lists makes pydantic try each member on every item (seconds for 10 MB of ids)
    prompt: Any

    @model_validator(mode="after")
    def check_prompt(self) -> CompletionRequest:
        p = self.prompt
        if isinstance(p, str) or is_token_ids(p) and p:
            return self
        if isinstance(p, list) and p and (all(isinstance(x, str) for x in p) or all(is_token_ids(x) for x in p)):
            return self
        raise OpenAIError("prompt must be a string, a list of strings, a list of token ids, or a list of lists "
                          "of token ids (none empty)", 400, "prompt")
    max_tokens: int = Field(16, ge=0)  # 0 only with echo: the prompt alone
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)
    add_special_tokens: bool = True

    @property
    def prompt_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the answer is the prompt alone (its text, and its logprobs
        if asked). The engine is asked for one token, which is dropped, as vLLM does."""
        return self.echo and self.max_tokens == 0

    @property
    def engine_max_tokens(self) -> int:
        """The ``max_tokens`` the engine is asked for: 1 for a prompt alone, else the request's."""
        return 1 if self.prompt_only else self.max_tokens

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """The ``prompt_logprobs`` the engine is asked for: the request's, else, with ``echo``, its
        ``logprobs`` (the echoed prompt's tokens carry logprobs as the generated ones do), as vLLM does."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict] | None = None
    name: str | None = None


class ChatCompletionRequest(OpenAIRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: a prompt, or chat messages through the chat template."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


def message_text(message: ChatMessage) -> str:
    """The text of a message: a string, or a list of text parts (other kinds are refused)."""
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for part in message.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise OpenAIError(f"only text content parts are supported, got {part.get('type')!r}", 400, "messages")
        texts.append(part["text"])
    return "\n".join(texts)


def load_chat_template(model_dir: Path) -> str | None:
    """The model's chat template: ``chat_template.jinja``, else ``tokenizer_config.json``'s, as transformers reads."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    config = model_dir / "tokenizer_config.json"
    if config.exists():
        template = json.loads(config.read_text()).get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return template
    return None


def special_tokens(model_dir: Path) -> dict[str, str]:
    config = model_dir / "tokenizer_config.json"
    data = json.loads(config.read_text()) if config.exists() else {}
    return {k: v for k, v in data.items() if k in ("bos_token", "eos_token") and isinstance(v, str)}


def render_chat(template: str | None, messages: list[ChatMessage], add_generation_prompt: bool,
                extra: dict[str, Any] | None = None, tokens: dict[str, str] | None = None) -> str:
    """The prompt text of a chat; 400 if the model has no template or the template refuses it."""
    if template is None:
        raise OpenAIError("this model has no chat template (as of transformers v4.44 a default one is no longer "
                          "allowed): give it one, or use /v1/completions", 400, "messages")
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    plain = [{"role": m.role, "content": message_text(m), **({"name": m.name} if m.name else {})} for m in messages]
    try:
        return env.from_string(template).render(messages=plain, add_generation_prompt=add_generation_prompt,
                                                **(tokens or {}), **(extra or {}))
    except TemplateError as err:
        raise OpenAIError(f"the chat template refused the messages: {err}", 400, "messages") from None


class Redecode:
    """A whole-sequence ``decode(ids) -> str`` in the shape of ``IncrementalDetokenizer``: it decodes
    every token again on each ``add`` (quadratic; for tests and small tools). Its text may end in
    U+FFFD while a character is unfinished, and change when the character is finished."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode, self.text = decode, ""
        self.ids: list[int] = []

    def add(self, token_ids: Iterable[int]) -> str:
        self.ids.extend(token_ids)
        self.text = self.decode(self.ids)
        return ""

    def finish(self) -> str:
        return ""


class ChoiceText:
    """One choice's text as its tokens arrive, cut at the first stop string (vLLM's detokenizer rules).

    ``detokenizer`` makes the text: an ``IncrementalDetokenizer`` (``EngineClient.detokenizer()``),
    which decodes each token once; a plain ``decode(ids)`` function (decoding everything again:
    ``Redecode``); or None (no tokenizer: the text stays ""). ``update(token_ids, finished)`` takes
    every token so far, and hands only the new ones to the detokenizer. The text is the decoded
    tokens, cut where the earliest stop string begins (or, with ``include_stop_str_in_output``,
    where it ends); a stop string ends the choice with finish reason ``"stop"``. Only the new text
    (and the ``len(stop) - 1`` characters before it) is searched. ``ready()`` is the text
    that may be sent now: all of it once finished; while running, without an unfinished UTF-8
    character (``U+FFFD`` at the end) and, unless stop strings are included in the output, without
    the longest tail that is the beginning of a stop string.
    """

    def __init__(self, detokenizer: IncrementalDetokenizer | Redecode | Callable[[list[int]], str] | None,
                 stops: list[str], include_stop_str_in_output: bool = False, min_tokens: int = 0) -> None:
        self.detokenizer = Redecode(detokenizer) if callable(detokenizer) else detokenizer
        self.stops, self.include = stops, include_stop_str_in_output
        self.min_tokens = min_tokens  # no stop string counts before this many tokens (vLLM's rule)
        self.text, self.num_tokens, self.finished, self.checked = "", 0, False, 0
        self.stop_reason: str | int | None = None
        self.finish_reason: str | None = None

    def update(self, token_ids: Sequence[int], finish_reason: str | None) -> None:
        if self.finished:
            return
        new = token_ids[self.num_tokens:]
        self.num_tokens += len(new)
        if self.detokenizer is not None:
            self.detokenizer.add(new)
            if finish_reason is not None:
                self.detokenizer.finish()
            self.text = self.detokenizer.text
        found = find_stop_string(self.text, self.stops, self.include, self.checked)  # in the new text only
        self.checked = len(self.text)
        if found and self.num_tokens >= self.min_tokens:
            self.text, self.stop_reason = found
            self.finished, self.finish_reason = True, "stop"
            return
        if finish_reason is not None:
            self.finished, self.finish_reason = True, finish_reason

    def ready(self) -> str:
        if self.finished:
            return self.text
        end = len(self.text)
        while end and self.text[end - 1] == "\ufffd":
            end -= 1
        held = 0
        for stop in [] if self.include else self.stops:  # an included stop string cuts after itself: no risk
            for k in range(min(len(stop) - 1, end), held, -1):
                if self.text.endswith(stop[:k], 0, end):
                    held = k
                    break
        return self.text[: end - held]

