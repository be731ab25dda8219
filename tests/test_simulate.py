"""The simulator that the demo, the notebooks and the benchmarks use."""

import pytest

from minipaged.perf.simulate import (
    KINDS,
    format_usage_table,
    simulate_contiguous,
    simulate_paged,
    synthetic_requests,
)

pytestmark = pytest.mark.tooling


def test_traces_are_seeded_and_respect_the_maximum_length():
    a = synthetic_requests(200, seed=3, max_len=512)
    assert a == synthetic_requests(200, seed=3, max_len=512) != synthetic_requests(200, seed=4, max_len=512)
    assert all(r.prompt_len >= 1 and r.output_len >= 1 and r.prompt_len + r.output_len <= 512 for r in a)
    assert [r.arrival for r in a] == sorted(r.arrival for r in a)


def test_paged_holds_more_requests_than_any_reservation_policy():
    trace = synthetic_requests(120, rate=0.5, seed=0, max_len=512)
    results = [simulate_contiguous(trace, p, 4096, 512) for p in ("max", "pow2", "oracle")]
    paged = simulate_paged(trace, num_blocks=256, block_size=16)
    for r in [*results, paged]:
        assert sum(r.fractions[k] for k in KINDS) == pytest.approx(1.0)
    assert results[0].mean_running == pytest.approx(4096 // 512)  # max: exactly 8 slabs fit
    assert paged.fractions["token"] > 0.9 > max(r.fractions["token"] for r in results)
    assert paged.mean_running > max(r.mean_running for r in results)
    assert paged.fractions["reserved"] == paged.fractions["external"] == 0
    assert "paged/16" in format_usage_table([*results, paged])


def test_a_request_that_can_never_fit_is_refused_before_simulating():
    trace = synthetic_requests(5, seed=0, max_len=2048)
    with pytest.raises(ValueError, match="can never fit"):
        simulate_contiguous(trace, "max", 1024, 2048)
    with pytest.raises(ValueError):
        simulate_paged(trace, num_blocks=2, block_size=16)
