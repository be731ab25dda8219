"""What the OpenAI routes share (vLLM's ``OpenAIServing``): the served model, the checks, tokenizing, admission.

``OpenAIServing`` is built once by ``build_app`` and kept in ``app.state.serving``, the
``EngineClient`` in ``app.state.engine``; a route receives them with ``Depends(get_serving)`` and
``Depends(get_engine_client)``.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from fastapi import Request

from minipaged.common.sampling_params import SamplingParams
from minipaged.serving.engine_client import EngineClient, Handle, QueueFullError, RequestFailed
from minipaged.serving.protocol import (
    ChatMessage,
    OpenAIError,
    load_chat_template,
    render_chat,
    special_tokens,
)


@dataclasses.dataclass
class ServedModel:
    """The model as clients see it: its name, its folder, when the server started, its chat template."""

    name: str
    root: Path
    created: int
    chat_template: str | None
    template_tokens: dict[str, str]

    @classmethod
    def load(cls, name: str, model_path: str | Path | None = None) -> ServedModel:
        """The model served as ``name`` from ``model_path`` (default: ``name``); a name that is no folder
        and no known model has no chat template."""
        from minipaged.models import resolve_model_path

        try:
            root = resolve_model_path(str(model_path if model_path is not None else name))
        except (ValueError, FileNotFoundError):  # a served name that is no folder: no chat template
            root = Path(str(model_path or name))
        return cls(name, root, int(time.time()), load_chat_template(root), special_tokens(root))


class OpenAIServing:
    """The checks and steps every OpenAI route takes before its requests reach the engine."""

    def __init__(self, client: EngineClient, model: ServedModel, max_logprobs: int) -> None:
        self.client, self.model, self.max_logprobs = client, model, max_logprobs

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model.name:
            raise OpenAIError(f"The model `{name}` does not exist.", 404, "model")

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool, extra: dict | None) -> str:
        """The prompt text of a chat, through the model's template."""
        return render_chat(self.model.chat_template, messages, add_generation_prompt, extra,
                           self.model.template_tokens)

    async def encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """The token ids of a prompt; a text that cannot fit the context, whatever its tokens, is refused
        without being tokenized."""
        client = self.client
        if not client.has_tokenizer:
            raise OpenAIError("this model has no tokenizer: give token ids", 400, param)
        if len(text) > client.max_model_len * client.max_token_chars * 4:
            raise OpenAIError(f"the prompt ({len(text)} characters) is longer than this model's maximum context "
                              f"length ({client.max_model_len} tokens)", 400, param)
        return await client.encode(text, add_special_tokens)

    def check_prompt(self, ids: list[int], max_tokens: int, param: str) -> None:
        max_model_len, vocab_size = self.client.max_model_len, self.client.vocab_size
        if not ids:
            raise OpenAIError("the prompt is empty: a request needs at least one token", 400, param)
        if len(ids) + max_tokens > max_model_len:
            raise OpenAIError(f"This model's maximum context length is {max_model_len} tokens. However, you "
                              f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} "
                              f"in the completion).", 400, param)
        if not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
            raise OpenAIError(f"token ids must be in 0 .. {vocab_size - 1}", 400, param)

    def check_logprobs(self, value: int | None, param: str) -> None:
        if value is not None and value > self.max_logprobs:
            raise OpenAIError(f"Requested sample logprobs of {value}, which is greater than max allowed: "
                              f"{self.max_logprobs}", 400, param)

    async def submit_all(self, prompts: list[list[int]], params: SamplingParams) -> list[Handle]:
        """One engine request per prompt, each admitted by the engine; on any refusal none stays."""
        handles = []
        try:
            for ids in prompts:
                handles.append(self.client.submit(ids, params))
            for handle in handles:
                await handle.admitted
        except QueueFullError as err:
            raise OpenAIError(str(err), 503) from None
        except (ValueError, TypeError) as err:
            raise OpenAIError(str(err), 400, "prompt") from None
        except RequestFailed as err:
            raise OpenAIError(str(err), err.status) from None
        finally:
            if not all(h.admitted.done() and not h.admitted.cancelled() and h.admitted.exception() is None
                       for h in handles):
                for handle in handles:
                    self.client.release(handle)
        return handles


# --- dependencies of the routes


def get_serving(request: Request) -> OpenAIServing:
    return request.app.state.serving


def get_engine_client(request: Request) -> EngineClient:
    return request.app.state.engine
