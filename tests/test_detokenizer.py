"""The incremental detokenizer: exactly the full decode, never retracting, O(1) work per token.

Token sequences are drawn from the encodings of random text (accents, CJK, emoji: byte-level
merges and multi-byte characters split across tokens), from random ids (special, added and
unknown ones included, so invalid and unfinished UTF-8 too) and fed in random chunks.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models

from minipaged.common.detokenizer import MAX_WINDOW, IncrementalDetokenizer, byte_alphabet
from minipaged.models import load_tokenizer, resolve_model_path
from minipaged.serving.protocol import ChoiceText

pytestmark = pytest.mark.common

TINY = load_tokenizer(resolve_model_path("tiny"))
assert TINY is not None
EOS = TINY.token_to_id("<|endoftext|>")
ADDED = Tokenizer.from_str(TINY.to_str())  # the tiny tokenizer with added tokens, special or not
ADDED.add_tokens(["ÃÃ", "Ã你", "<plain>"])  # bytes of the alphabet; a character outside it; plain ASCII
ADDED.add_special_tokens([AddedToken("<spec>", special=True), AddedToken("©©", special=True)])
EXTRA = [ADDED.token_to_id(t) for t in ("ÃÃ", "Ã你", "<plain>", "<spec>", "©©")]

CHARS = st.characters(codec="utf-8", categories=["L", "N", "P", "S", "Zs"]) | st.sampled_from(
    list("éüß—€你好世界한글😀🎉👍🏽\u200d❤️ \n"))
TEXT_IDS = st.text(CHARS, max_size=12).map(lambda s: TINY.encode(s).ids)
RANDOM_IDS = st.lists(st.integers(0, ADDED.get_vocab_size() + 2), max_size=6)  # unknown ids too
SPECIAL_IDS = st.lists(st.sampled_from([EOS, *EXTRA]), min_size=1, max_size=2)
IDS = st.lists(TEXT_IDS | RANDOM_IDS | SPECIAL_IDS, max_size=6).map(lambda parts: [t for p in parts for t in p])


@st.composite
def splits(draw, ids=IDS):
    """A sequence and a way to feed it: with specials inserted anywhere (inside a character, too)."""
    ids = list(draw(ids))
    for at, special in draw(st.lists(st.tuples(st.integers(0, len(ids)), st.sampled_from([EOS, *EXTRA])),
                                     max_size=3)):
        ids.insert(at, special)
    sizes = draw(st.lists(st.integers(0, 5), min_size=len(ids), max_size=len(ids)))
    chunks, at = [], 0
    for size in sizes:
        if at >= len(ids):
            break
        chunks.append(ids[at:at + size])
        at += size
    return ids, chunks + [ids[at:]]


def feed(tokenizer, chunks, skip=True):
    """Feed the chunks; (ids so far, text, delta) after each, and the detokenizer after finish()."""
    detok, ids, seen = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip), [], []
    for chunk in chunks:
        delta = detok.add(chunk)
        ids += chunk
        seen.append((list(ids), detok.text, delta))
    seen.append((list(ids), None, detok.finish()))
    return detok, seen


CASES = st.tuples(st.sampled_from([TINY, ADDED]), splits(), st.booleans())


@settings(deadline=None, max_examples=300)
@given(CASES)
def test_after_finish_the_text_is_the_full_decode(case):
    tokenizer, (ids, chunks), skip = case
    detok, seen = feed(tokenizer, chunks, skip)
    assert detok.exact
    assert detok.text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert "".join(delta for _, _, delta in seen) == detok.text  # the deltas join to it


@settings(deadline=None, max_examples=300)
@given(CASES)
def test_the_text_never_retracts(case):
    tokenizer, (ids, chunks), skip = case
    detok, seen = feed(tokenizer, chunks, skip)
    texts = [text for _, text, _ in seen[:-1]] + [detok.text]
    for before, after in zip(texts, texts[1:]):
        assert after.startswith(before)


@settings(deadline=None, max_examples=300)
@given(CASES)
def test_the_text_is_a_prefix_of_the_decode_of_the_tokens_so_far(case):
    tokenizer, (ids, chunks), skip = case
    for ids_so_far, text, _ in feed(tokenizer, chunks, skip)[1][:-1]:
        decoded = tokenizer.decode(ids_so_far, skip_special_tokens=skip)
        assert decoded.startswith(text)
        assert decoded[len(text):] in ("", "\ufffd")  # it holds back an unfinished character, nothing else


def test_the_byte_alphabet_is_the_one_of_the_tiny_vocabulary():
    alphabet = byte_alphabet()
    assert len(set(alphabet.values())) == 256
    for byte, char in alphabet.items():
        assert TINY.decode([TINY.token_to_id(char)]) == bytes([byte]).decode("utf-8", "replace")


def test_added_and_special_tokens_decode_as_tokenizers_does():
    e_acute = TINY.encode("é").ids  # two byte tokens: Ã ©
    assert len(e_acute) == 2
    for tokenizer, ids, skip, text in [
        (TINY, [e_acute[0], EOS, e_acute[1]], True, "é"),  # a skipped special token: the bytes join across it
        (TINY, [e_acute[0], EOS, e_acute[1]], False, "\ufffd<|endoftext|>\ufffd"),
        (ADDED, [e_acute[0], ADDED.token_to_id("ÃÃ"), e_acute[1]], True, "\ufffd\ufffdé"),  # bytes of the alphabet
        (ADDED, [ADDED.token_to_id("Ã你")], True, "Ã你"),  # a character outside it: the token's own UTF-8
        (ADDED, [e_acute[0], ADDED.token_to_id("<spec>"), e_acute[1]], True, "é"),
        (TINY, [e_acute[0]], True, "\ufffd"),  # an unfinished character, flushed by finish()
        (TINY, [], True, ""),
    ]:
        assert tokenizer.decode(ids, skip_special_tokens=skip) == text
        detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
        assert "".join(detok.add([t]) for t in ids) + detok.finish() == text == detok.text


def sentencepiece_like() -> Tokenizer:
    """Llama 2's and Mistral's kind: Metaspace pieces, byte fallback tokens, not byte-level."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in ["▁", "▁the", "▁cat", "a", "b", "é", "▁你", "好", "▁😀", "s", "."]:
        vocab[piece] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens(["<s>", "</s>"])
    return tokenizer


def wordpiece() -> Tokenizer:
    vocab = ["[UNK]", "[CLS]", "[SEP]", "the", "cat", "##s", ".", "un", "##able", "'", "t", "do", "not", "##'t"]
    tokenizer = Tokenizer(models.WordPiece(vocab={w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    tokenizer.add_special_tokens(["[CLS]", "[SEP]"])
    return tokenizer


OTHERS = [sentencepiece_like(), wordpiece()]


@settings(deadline=None, max_examples=200)
@given(tokenizer=st.sampled_from(OTHERS), data=st.data(), skip=st.booleans())
def test_the_window_fallback_is_exact_after_finish(tokenizer, data, skip):
    ids = st.lists(st.integers(0, tokenizer.get_vocab_size() - 1), max_size=40)
    ids, chunks = data.draw(splits(ids))
    detok, seen = feed(tokenizer, chunks, skip)
    assert not detok.exact
    assert detok.text == tokenizer.decode(ids, skip_special_tokens=skip)


class Counting:
    """A tokenizer that records the length of every id list it decodes, and the ids it looks up."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.decoded, self.looked_up = tokenizer, [], 0
        self.decoder = tokenizer.decoder

    def get_added_tokens_decoder(self):
        return self.tokenizer.get_added_tokens_decoder()

    def id_to_token(self, token_id):
        self.looked_up += 1
        return self.tokenizer.id_to_token(token_id)

    def decode(self, ids, skip_special_tokens=True):
        self.decoded.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("tokenizer", [TINY, *OTHERS], ids=["byte-level", "sentencepiece-like", "wordpiece"])
def test_a_token_costs_the_same_work_however_long_the_output(tokenizer):
    text = TINY.encode("Stream 你好, wörld 😀! ").ids
    pieces = text if tokenizer is TINY else list(range(tokenizer.get_vocab_size()))  # byte runs, invalid ones too
    ids = (pieces * (3000 // len(pieces) + 1))[:3000]
    counting = Counting(tokenizer)
    detok = IncrementalDetokenizer(counting)
    work = []  # per token: (id lookups, tokens decoded)
    for t in ids:
        looked_up, decoded = counting.looked_up, len(counting.decoded)
        detok.add([t])
        work.append((counting.looked_up - looked_up, sum(counting.decoded[decoded:])))
    if detok.exact:  # one vocabulary lookup per token, no decode
        assert set(work) == {(1, 0)}
    else:  # at most two decodes of a window of at most 2 * MAX_WINDOW tokens, at token 10 as at token 3000
        assert max(w for _, w in work[2000:]) <= 4 * MAX_WINDOW and max(counting.decoded) <= 2 * MAX_WINDOW
        assert max(w for _, w in work[2000:]) <= max(w for _, w in work[:1000])
    detok.finish()
    assert detok.text == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.serving
@settings(deadline=None, max_examples=100)
@given(ids=IDS, stops=st.lists(st.text("abcdefghijklmnopqrstuvwxyz .,", min_size=1, max_size=3), max_size=2),
       include=st.booleans(), min_tokens=st.integers(0, 4), step=st.integers(1, 3))
def test_choice_text_with_the_detokenizer_is_the_choice_text_that_decodes_everything(ids, stops, include,
                                                                                      min_tokens, step):
    def decode(token_ids):
        return TINY.decode(token_ids, skip_special_tokens=True)
    fast = ChoiceText(IncrementalDetokenizer(TINY), stops, include, min_tokens)
    slow = ChoiceText(decode, stops, include, min_tokens)
    sent = ""
    for end in [*range(step, len(ids), step), len(ids)]:
        finish = "length" if end == len(ids) else None
        fast.update(ids[:end], finish)
        slow.update(ids[:end], finish)
        assert fast.ready().startswith(sent)  # what was streamed stays
        sent = fast.ready()
        assert (fast.finished, fast.finish_reason, fast.stop_reason) == (slow.finished, slow.finish_reason,
                                                                         slow.stop_reason)
        if fast.finished:
            break
    assert fast.text == slow.text == sent and fast.num_tokens == slow.num_tokens
