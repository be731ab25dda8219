"""What completions and chat completions share once their requests are admitted.

* ``Run``: the choices of one HTTP request (``n`` per prompt) as the engine's outputs arrive,
  each a ``ChoiceText`` (stop strings, held-back tails), with its tokens and logprobs, and each
  prompt's logprobs when the engine was asked for them.
* ``Chunks``: how one route writes a streamed chunk (``completions`` and ``chat`` each define one).
* ``stream_events``: server-sent events, a chunk per change, usage if asked, an error as an
  event, then ``data: [DONE]``; ``collect``: the same run to its end, for an answer in one piece.
* ``floor_logprob``: a logprob as JSON can carry it; ``top_entries``: a position's ``k`` most
  likely tokens and its own; ``prompt_logprobs_json``: a prompt's logprobs in vLLM's shape.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing

from fastapi import Request

from minipaged.common.sampling_params import RequestOutput
from minipaged.serving.engine_client import EngineClient, Handle, RequestFailed
from minipaged.serving.protocol import ChoiceText, OpenAIError, StreamOptions, error_body

logger = logging.getLogger("minipaged.serving")


def floor_logprob(value: float) -> float:
    return max(value, -9999.0)  # JSON has no -inf: vLLM's floor


def top_entries(top: dict[int, float], token: int, k: int) -> dict[int, float]:
    """The ``k`` most likely tokens of one position and the position's own ``token`` (``k`` or ``k + 1``
    entries, as OpenAI's ``top_logprobs``). The engine's dicts hold their top tokens first, most likely
    first, then the token itself if it is not among them; a dict with more top tokens than ``k`` (prompt
    logprobs asked with a larger ``prompt_logprobs``) is cut to ``k``."""
    best = dict(itertools.islice(top.items(), k))
    if token in top:
        best[token] = top[token]
    return best


def prompt_logprobs_json(client: EngineClient, prompt: list[int], entries: list[dict[int, float] | None],
                         k: int) -> list[dict[str, dict] | None]:
    """A prompt's logprobs in vLLM's shape: per prompt token ``None`` (the first: nothing comes before
    it) or ``{token id as a string: {"logprob", "rank", "decoded_token"}}``, the prompt's own token first,
    then the ``k`` most likely. ``rank`` is 1 for the most likely token; the prompt's token, when it is
    not among the ``k`` most likely, has ``rank`` null (the engine returns only the top ``k``)."""
    out: list[dict[str, dict] | None] = []
    for token, top in zip(prompt, entries, strict=False):
        if top is None:
            out.append(None)
            continue
        ranks = {t: r for r, t in enumerate(itertools.islice(top, k), start=1)}
        order = [token, *(t for t in top if t != token)]
        out.append({str(t): {"logprob": floor_logprob(top[t]), "rank": ranks.get(t),
                             "decoded_token": client.decode([t])} for t in order})
    return out


def sse(data) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(data)}\n\n"


class Run:
    """The choices of one HTTP request (``n`` per prompt) as the engine's outputs arrive.

    ``prompt_only`` (completions' ``echo`` with ``max_tokens: 0``): the engine's one token is dropped,
    and each choice finishes with ``"length"`` and no token when its request does.
    ``prompt_logprobs[i]``: prompt ``i``'s logprobs as the engine's last output gave them (None
    unless asked for).
    """

    def __init__(self, client: EngineClient, handles: list[Handle], n: int, stops: list[str], include_stop: bool,
                 logprobs: int | None, prompt_only: bool = False) -> None:
        self.client, self.handles, self.n, self.logprobs = client, handles, n, logprobs
        self.prompt_only = prompt_only
        self.prompt_logprobs: list[list[dict[int, float] | None] | None] = [None] * len(handles)
        self.texts = [ChoiceText(client.detokenizer(), stops, include_stop, h.params.min_tokens)
                      for h in handles for _ in range(n)]  # each decodes its new tokens only
        self.tokens: list[list[int]] = [[] for _ in self.texts]
        self.token_logprobs: list[list[dict[int, float]]] = [[] for _ in self.texts]
        self.sent = [0] * len(self.texts)  # characters streamed
        self.sent_tokens = [0] * len(self.texts)  # tokens whose logprobs were streamed

    def update(self, i: int, output: RequestOutput) -> list[int]:
        """Apply one output of prompt ``i``; the choice indexes that changed. Releases a
        prompt's engine request once all its choices are finished."""
        changed = []
        if output.prompt_logprobs is not None:
            self.prompt_logprobs[i] = output.prompt_logprobs
        for c in output.outputs:
            k = i * self.n + c.index
            text = self.texts[k]
            if text.finished:
                continue
            if self.prompt_only:  # the engine's one token is not part of the answer
                text.update([], None if c.finish_reason is None else "length")
                changed.append(k)
                continue
            text.update(c.token_ids, c.finish_reason)
            self.tokens[k].extend(c.token_ids[len(self.tokens[k]): text.num_tokens])  # the new ones: no copy of all
            if c.logprobs is not None:
                self.token_logprobs[k].extend(c.logprobs[len(self.token_logprobs[k]): text.num_tokens])
            changed.append(k)
            if text.finished and text.finish_reason == "stop" and text.stop_reason is None:
                last = text.num_tokens and c.token_ids[text.num_tokens - 1]
                text.stop_reason = last if last in self.handles[i].params.stop_token_ids else None
        mine = self.texts[i * self.n:(i + 1) * self.n]
        if all(t.finished for t in mine):
            self.client.release(self.handles[i], [t.finish_reason or "abort" for t in mine])
        return changed

    @property
    def done(self) -> bool:
        return all(t.finished for t in self.texts)

    def usage(self) -> dict:
        prompt = sum(len(h.prompt_token_ids) for h in self.handles)
        completion = sum(t.num_tokens for t in self.texts)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def release(self, reason: str | None = None) -> None:
        """Release every engine request: aborted (``reason`` None) or failed (``"error"``)."""
        for handle in self.handles:
            self.client.release(handle, [reason] * handle.params.n if reason else None)

    def outputs(self) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """(prompt index, output) from every prompt's engine request as they come."""
        return self.client.stream_all(self.handles)


class Chunks:
    """How one route writes its streamed chunks: the envelope is shared, the choices are the route's."""

    object = ""  # the chunks' ``object``: "text_completion", "chat.completion.chunk"

    def __init__(self, request_id: str, model_name: str) -> None:
        self.request_id, self.model_name = request_id, model_name

    def envelope(self, choices: list[dict]) -> dict:
        return {"id": self.request_id, "object": self.object, "created": int(time.time()), "model": self.model_name,
                "choices": choices}

    def initial(self, k: int) -> dict | None:
        """The chunk choice ``k`` opens with before any token (None: no such chunk)."""
        return None

    def chunk(self, k: int, delta: str, finish: str | None, stop_reason, tokens: list[int],
              tops: list[dict] | None) -> dict:
        """The chunk for choice ``k``'s new text (``delta``) and ``tokens`` (``tops``: their logprobs, if asked)."""
        raise NotImplementedError


async def stream_events(run: Run, chunks: Chunks, options: StreamOptions | None) -> AsyncIterator[str]:
    """Server-sent events: a chunk per change, usage if asked, errors as an event, then [DONE]."""
    include_usage = bool(options and options.include_usage)
    continuous = bool(options and options.continuous_usage_stats)
    try:
        for k in range(len(run.texts)):
            start = chunks.initial(k)
            if start is not None:
                yield sse(start)
        async with aclosing(run.outputs()) as merged:
            async for i, output in merged:
                for k in run.update(i, output):
                    text = run.texts[k]
                    ready = text.ready()
                    delta, run.sent[k] = ready[run.sent[k]:], len(ready)
                    new_tokens = run.tokens[k][run.sent_tokens[k]:]
                    tops = run.token_logprobs[k][run.sent_tokens[k]:] if run.logprobs is not None else None
                    finish = text.finish_reason if text.finished else None
                    if not delta and finish is None and not (tops and new_tokens):
                        continue
                    run.sent_tokens[k] = len(run.tokens[k])
                    data = chunks.chunk(k, delta, finish, text.stop_reason if finish else None, new_tokens, tops)
                    if continuous:
                        data["usage"] = run.usage()
                    yield sse(data)
                if run.done:
                    break
        if include_usage:
            yield sse({**chunks.envelope([]), "usage": run.usage()})
    except RequestFailed as err:
        run.release("error" if err.status == 500 else None)
        yield sse(error_body(str(err), err.status))
    except Exception as err:  # a failure during a stream is an error event, then [DONE]
        logger.exception("a stream failed")
        run.release("error")
        yield sse(error_body(f"internal server error: {type(err).__name__}", 500))
    finally:
        run.release()
    yield "data: [DONE]\n\n"


async def collect(run: Run, request: Request) -> bool:
    """Run to the end; False if the client went away (its requests are aborted)."""
    try:
        async with aclosing(run.outputs()) as merged:
            async for i, output in merged:
                run.update(i, output)
                if run.done:
                    break
                if await request.is_disconnected():
                    return False
        return True
    except RequestFailed as err:
        run.release("error" if err.status == 500 else None)
        raise OpenAIError(str(err), err.status) from None
    finally:
        run.release()
