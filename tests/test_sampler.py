"""The batched sampler's own rules, which need no stage's code: the logits it processes are the
logits processors' (``process_row``), and its log-probabilities are those of the processed logits."""

from __future__ import annotations

import pytest
import torch
from test_stage7_sampler import EOS, random_batch

from minipaged.common.logits_processors import process_row
from minipaged.common.sampler import Sampler

pytestmark = pytest.mark.common


def test_the_processed_logits_are_those_of_the_logits_processors():
    """The rows the engine gets back (for beam search and forks) are ``process_row``'s, exactly."""
    logits, params, rows = random_batch(5)
    processed = logits.clone()
    Sampler([EOS])(processed, rows, params)
    for i, p in enumerate(params):
        want = process_row(logits[i], rows[i].prompt_token_ids, rows[i].output_token_ids, p, {EOS})
        assert torch.equal(processed[i], want), f"row {i}: {p}"


def test_log_probabilities_are_the_processed_logits_and_only_the_asked_rows_get_top_ones():
    logits, params, rows = random_batch(3)
    processed = logits.clone()
    out = Sampler([EOS])(processed, rows, params)
    for i, p in enumerate(params):
        row = torch.log_softmax(processed[i], dim=-1)
        assert out.logprobs[i] == float(row[out.token_ids[i]])
        if p.logprobs is None:
            assert out.top_logprobs[i] is None
            continue
        top = out.top_logprobs[i]
        want = torch.topk(row, p.logprobs).indices.tolist()
        assert set(top) == set(want) | {out.token_ids[i]}
        assert top[out.token_ids[i]] == out.logprobs[i]
        for token in want:
            if token != out.token_ids[i]:
                assert top[token] == float(row[token])
