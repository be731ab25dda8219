"""The batched sampler equals stage 7's one-row definitions, row by row.

``Sampler`` (``minipaged.common.sampler``) processes a whole ``(num_seqs, vocab)`` batch at once,
each row with its own parameters; ``process_row`` (the logits processors), ``process_logits`` and
``sample`` define what each row must get. Greedy rows must give exactly the definition's token;
a sampled row, drawing with a generator seeded alike, exactly the same token, draw after draw.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from minipaged.common.logits_processors import process_row
from minipaged.common.sampler import Sampler
from minipaged.common.sampling_params import SamplingParams
from minipaged.stage7_model_runner import process_logits, sample

pytestmark = pytest.mark.stage7

VOCAB, EOS = 512, 7


@dataclass
class Row:
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


def random_params(rng: random.Random) -> SamplingParams:
    """One row's parameters: greedy or sampled, every cut and processor on or off, edge values included."""
    greedy = rng.random() < 0.3
    return SamplingParams(
        temperature=0.0 if greedy else rng.choice([0.3, 0.7, 1.0, 1.7]),
        top_k=rng.choice([-1, -1, 1, 5, 50, VOCAB - 1, VOCAB, 5000]),  # 5000: more than the vocabulary
        top_p=rng.choice([1.0, 1.0, 0.9, 0.5, 1e-6]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.8]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.5, -0.5]),
        presence_penalty=rng.choice([0.0, 0.0, 1.0]),
        logit_bias=rng.choice([None, None, {3: 5.0, 11: -100.0}, {EOS: 2.5}]),
        min_tokens=rng.choice([0, 0, 3]), max_tokens=8, stop_token_ids=rng.choice([[], [9]]),
        logprobs=rng.choice([None, None, 0, 3]), seed=rng.randrange(1000),
    )


def random_batch(seed: int, num_seqs: int = 24, ties: bool = False):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_seqs, VOCAB, generator=gen) * rng.choice([1.0, 4.0])
    if ties:  # whole rows of equal values: the cuts must treat ties as the definitions do
        logits = (logits * 2).round() / 2
    params = [random_params(rng) for _ in range(num_seqs)]
    rows = [Row([rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))],
                [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 6))]) for _ in range(num_seqs)]
    return logits, params, rows


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("seed", range(12))
def test_the_batched_sampler_draws_what_the_one_row_definitions_draw(seed, ties):
    logits, params, rows = random_batch(seed, ties=ties)
    expected = [process_row(logits[i], r.prompt_token_ids, r.output_token_ids, p, {EOS})
                for i, (r, p) in enumerate(zip(rows, params, strict=True))]
    theirs = [torch.Generator().manual_seed(p.seed) for p in params]
    for r, p in zip(rows, params, strict=True):
        r.generator = torch.Generator().manual_seed(p.seed)
    sampler = Sampler([EOS])
    for _ in range(3):  # draw after draw: the generators stay in step
        out = sampler(logits.clone(), rows, params)
        for i, p in enumerate(params):
            assert out.token_ids[i] == sample(expected[i], p, theirs[i]), f"row {i}: {p}"


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_greedy_rows_take_the_argmax_of_the_processed_logits_exactly(ties):
    logits, params, rows = random_batch(99, ties=ties)
    params = [SamplingParams(temperature=0.0, logit_bias=p.logit_bias, repetition_penalty=p.repetition_penalty,
                             min_tokens=p.min_tokens, max_tokens=8) for p in params]
    out = Sampler([EOS])(logits.clone(), rows, params)
    for i, p in enumerate(params):
        assert out.token_ids[i] == sample(process_row(logits[i], rows[i].prompt_token_ids,
                                                      rows[i].output_token_ids, p, {EOS}), p, None)


def test_a_top_k_larger_than_the_vocabulary_cuts_nothing():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(top_k=5000, seed=1)
    assert torch.equal(process_logits(logits[0], params), logits[0])
    drawn = {Sampler()(logits.clone(), [Row([1], generator=torch.Generator().manual_seed(s))], [params]).token_ids[0]
             for s in range(200)}
    assert len(drawn) > 50  # draws spread over the whole vocabulary, not a cut of it
