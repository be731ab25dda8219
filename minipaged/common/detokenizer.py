"""Incremental detokenization: a sequence's text grown token by token, in O(1) work per token.

Streaming a sequence's text asks, after every token, what text that token completed. Decoding
the whole output again each time (``tokenizer.decode(ids)``) answers it, but the work per token
grows with the output: a sequence of ``n`` tokens costs ``O(n**2)``. vLLM's
``detokenize_incrementally`` decodes only a window of recent tokens instead; this module does
the same, and exactly where it can:

* **Byte-level BPE** (GPT-2, Llama 3, Qwen, the tiny model: a ``ByteLevel`` decoder). A token's
  vocabulary string stands for bytes, one character each (GPT-2's ``bytes_to_unicode``); a token
  with a character outside that alphabet (an added token such as ``"你好"``) stands for its own
  UTF-8. The decoder joins every token's bytes and decodes them as UTF-8, an invalid or unfinished
  sequence becoming U+FFFD. Found by experiment with ``tokenizers``: added tokens, special or not,
  go through the same decoder; a skipped special token leaves no bytes, so a character may begin
  before it and end after it; an id outside the vocabulary is skipped. Each token's bytes, fed to
  Python's incremental UTF-8 decoder (``errors="replace"``: the same replacement rule as Rust's
  ``from_utf8_lossy``), give exactly what a full decode gives, without ever decoding twice.
* **Any other decoder** (WordPiece, Metaspace with ``ByteFallback``, ...): vLLM's window. The text
  of ``ids[prefix_offset:]`` beyond that of ``ids[prefix_offset:read_offset]`` is emitted once it
  does not end in U+FFFD (an unfinished character), and both offsets move on; after ``MAX_WINDOW``
  tokens without a finished character the window is emitted as it is. A decoder may look beyond
  the window (``ByteFallback`` turns a whole run of byte tokens into U+FFFD when one of them is
  invalid, valid ones before it included), so before ``finish()`` this text may differ from a
  full decode; ``finish()`` decodes everything once and corrects it.

The rules, tested in ``tests/test_detokenizer.py``: after ``finish()``, ``text`` is exactly
``tokenizer.decode(all_ids, skip_special_tokens=...)``; with a byte-level decoder, at every point
``text`` is a prefix of that and of the decode of the tokens so far (it never retracts), and a
token costs O(1) whatever the length of the output. ``tokenizers``' own ``DecodeStream`` is not
used: it has no flush, and it holds text back while it ends in U+FFFD, so a sequence that ends in
an unfinished or invalid character loses that tail (1 in 20 random sequences of the tiny model).
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders

MAX_WINDOW = 8  # the fallback emits its window as it is after this many tokens without a finished character


def byte_alphabet() -> dict[int, str]:
    """GPT-2's ``bytes_to_unicode``: byte -> the character that stands for it in a byte-level vocabulary.

    The printable Latin-1 bytes stand for themselves; the other 68 (controls, space, DEL, NBSP,
    soft hyphen) take the characters from U+0100 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(0x100 + i) for i, b in enumerate(others)}


BYTE_OF = {char: byte for byte, char in byte_alphabet().items()}


class IncrementalDetokenizer:
    """One sequence's text as its tokens arrive: ``add(ids)`` returns the new text, ``finish()`` the rest.

    ``add`` returns the text the new tokens completed ("" while a character is unfinished);
    ``text`` is all of it so far; ``finish()``, called once at the end, flushes what is left (an
    unfinished character becomes U+FFFD, as in a full decode) and returns it. Then ``text`` is
    exactly ``tokenizer.decode(all_ids, skip_special_tokens=skip_special_tokens)``. ``exact``:
    the tokenizer has a byte-level decoder, so ``text`` only ever grows into that. Otherwise
    (vLLM's window) ``finish()`` may have to correct ``text``: it then returns what follows the
    part that stands, and ``text`` is replaced.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.exact = isinstance(tokenizer.decoder, decoders.ByteLevel)
        self._pieces: list[str] = []  # joined when ``text`` is read: adding a token costs O(1)
        if self.exact:
            added = tokenizer.get_added_tokens_decoder().values()
            self._skipped = {t.content for t in added if t.special} if skip_special_tokens else set()
            self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        else:
            self._ids: list[int] = []
            self.prefix_offset = self.read_offset = 0
            self._prefix_text: str | None = ""  # the text of ids[prefix_offset:read_offset]; None: to decode

    @property
    def text(self) -> str:
        """All the text so far (reading it joins the pieces added since the last read)."""
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def add(self, token_ids: Iterable[int]) -> str:
        if self.exact:
            delta = "".join(self._utf8.decode(self.token_bytes(t)) for t in token_ids)
        else:
            delta = "".join(self._step(t) for t in token_ids)
        if delta:
            self._pieces.append(delta)
        return delta

    def finish(self) -> str:
        if self.exact:
            delta = self._utf8.decode(b"", final=True)
        else:  # one full decode, and the text corrected to it
            old, full = self.text, self._decode(self._ids)
            same = next((i for i, (a, b) in enumerate(zip(old, full)) if a != b), min(len(old), len(full)))
            self._pieces[:] = [full[:same]]
            delta = full[same:]
        if delta:
            self._pieces.append(delta)
        return delta

    def token_bytes(self, token_id: int) -> bytes:
        """What one token adds to a byte-level decode: its bytes; b"" for a skipped or unknown id."""
        token = self.tokenizer.id_to_token(token_id)
        if token is None or token in self._skipped:
            return b""
        try:
            return bytes(BYTE_OF[char] for char in token)
        except KeyError:  # a character outside the byte alphabet: the ByteLevel decoder keeps the token's UTF-8
            return token.encode()

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _step(self, token_id: int) -> str:
        """vLLM's ``detokenize_incrementally``, one token: decode the window, emit what the token added."""
        self._ids.append(token_id)
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self._ids[self.prefix_offset:])
        unfinished = len(new_text) <= len(self._prefix_text) or new_text.endswith("\ufffd")
        if unfinished and len(self._ids) - self.read_offset < MAX_WINDOW:
            return ""  # perhaps a character that the next token finishes
        delta = new_text[len(self._prefix_text):]
        self.prefix_offset, self.read_offset, self._prefix_text = self.read_offset, len(self._ids), None
        return delta
