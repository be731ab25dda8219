"""The batched sampler's own rules, which need no stage's code: the logits it processes are the
logits processors' (``process_row``), and its log-probabilities are those its ``logprobs_mode`` names:
the model's raw logits by default, or the processed ones the token was drawn from."""

from __future__ import annotations

import pytest
import torch
from test_stage7_sampler import EOS, Row, random_batch

from minipaged.common.logits_processors import process_row
from minipaged.common.sampler import Sampler, top_k_top_p
from minipaged.common.sampling_params import SamplingParams

pytestmark = pytest.mark.common


def test_the_processed_logits_are_those_of_the_logits_processors():
    """The rows the engine gets back (for beam search and forks) are ``process_row``'s, exactly."""
    logits, params, rows = random_batch(5)
    processed = logits.clone()
    Sampler([EOS])(processed, rows, params)
    for i, p in enumerate(params):
        want = process_row(logits[i], rows[i].prompt_token_ids, rows[i].output_token_ids, p, {EOS})
        assert torch.equal(processed[i], want), f"row {i}: {p}"


def logprob_source(mode: str, original: torch.Tensor, processed: torch.Tensor, params) -> torch.Tensor:
    """What each row's log-probabilities are taken from under ``mode``, computed row by row."""
    rows = []
    for i, p in enumerate(params):
        row = original[i] if mode.startswith("raw") else processed[i]
        if mode.startswith("processed") and p.temperature > 0:  # the distribution the token was drawn from
            vocab = row.numel()
            row = top_k_top_p((row / p.temperature)[None], torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab]),
                              torch.tensor([p.top_p]))[0]
        rows.append(row if mode.endswith("logits") else torch.log_softmax(row, dim=-1))
    return torch.stack(rows)


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"])
def test_log_probabilities_follow_the_logprobs_mode_and_only_the_asked_rows_get_top_ones(mode):
    """``raw_logprobs`` (the default) are the model's, before any penalty, bias or temperature."""
    logits, params, rows = random_batch(3)
    assert any(p.has_logits_processors for p in params)  # raw and processed differ
    processed = logits.clone()
    out = Sampler([EOS], mode)(processed, rows, params)
    source = logprob_source(mode, logits, processed, params)
    for i, p in enumerate(params):
        row = source[i]
        assert out.logprobs[i] == pytest.approx(float(row[out.token_ids[i]]), rel=1e-6, abs=1e-6)
        if p.logprobs is None:
            assert out.top_logprobs[i] is None
            continue
        top = out.top_logprobs[i]
        want = torch.topk(row, p.logprobs).indices.tolist()
        assert set(top) == set(want) | {out.token_ids[i]}
        assert top[out.token_ids[i]] == out.logprobs[i]
        for token in want:
            if token != out.token_ids[i]:
                assert top[token] == pytest.approx(float(row[token]), rel=1e-6, abs=1e-6)


def test_the_default_log_probabilities_ignore_logit_bias():
    """A +100 bias makes a token certain to be drawn; its raw log-probability is still the model's."""
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0, logit_bias={7: 100.0}, logprobs=0)]
    raw = Sampler([EOS])(logits.clone(), [Row([1])], params)
    processed = Sampler([EOS], "processed_logprobs")(logits.clone(), [Row([1])], params)
    assert raw.token_ids == processed.token_ids == [7]
    assert raw.logprobs[0] == pytest.approx(float(torch.log_softmax(logits[0], -1)[7]), abs=1e-6)
    assert processed.logprobs[0] == pytest.approx(0.0, abs=1e-6)
