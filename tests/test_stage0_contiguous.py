"""Stage 0: the contiguous KV cache and dense attention.

The first test is the equivalence the whole ladder rests on: decoding token by token
through the cache gives what one causal forward pass over the whole sequence gives.
"""

import helpers_tolerances as tolerances
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from minipaged.stage0_contiguous import (
    CacheUsage,
    ContiguousKVCache,
    OutOfSlotsError,
    UnknownRequestError,
    dense_attention,
)

pytestmark = pytest.mark.stage0


class OneLayerAttention(torch.nn.Module):
    """A single attention layer, enough to prove the cache returns the right K/V."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.shape = (num_heads, num_kv_heads, head_dim)
        self.q = torch.nn.Linear(hidden, num_heads * head_dim)
        self.k = torch.nn.Linear(hidden, num_kv_heads * head_dim)
        self.v = torch.nn.Linear(hidden, num_kv_heads * head_dim)
        self.o = torch.nn.Linear(num_heads * head_dim, hidden)

    def qkv(self, x):  # x: (num_tokens, hidden)
        h, kvh, d = self.shape
        return (self.q(x).view(-1, h, d), self.k(x).view(-1, kvh, d), self.v(x).view(-1, kvh, d))

    def full_forward(self, x):
        """No cache: the textbook causal forward pass, with PyTorch's own attention."""
        q, k, v = self.qkv(x)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
            enable_gqa=True,
        )
        return self.o(out.transpose(0, 1).reshape(len(x), -1))

    def error(self, x):
        """The most one computation of the layer on ``x`` (causal, over all of ``x``) can be off the exact value.

        Each projection is a (fan-in + 1)-term dot product (the bias): off by gamma(fan-in + 1) times
        |x| |W| + |b|. Errors of q and k move the scores by at most scale (|dq| |k| + |q| |dk| + |dq| |dk|);
        attention passes them on (``attention_error``); the output projection multiplies the attention
        output's error by its largest absolute row sum, and adds its own rounding.
        """
        h, _, d = self.shape
        g = tolerances.gamma(x.shape[-1] + 1)
        terms = [(x.abs() @ p.weight.abs().T + p.bias.abs()).view(len(x), -1, d) for p in (self.q, self.k, self.v)]
        q, k, v = self.qkv(x)

        def norm(t):
            return t.norm(dim=-1).max().item()

        dq, dk, dv = g * norm(terms[0]), g * norm(terms[1]), g * terms[2].max().item()
        scale = d**-0.5
        score_error = scale * (dq * norm(k) + norm(q) * dk + dq * dk)
        attended = tolerances.attention_error(d, len(x), scale * norm(q) * norm(k), v.abs().max().item(),
                                              score_error=score_error, value_error=dv)
        rows = self.o.weight.abs().sum(1).max().item()
        out_terms = rows * (v.abs().max().item() + dv) + self.o.bias.abs().max().item()
        return tolerances.gamma(h * d + 1) * out_terms + rows * attended


@pytest.mark.parametrize("policy", ["max", "pow2", "oracle"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
def test_cached_decode_equals_full_forward_pass(policy, heads):
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, hidden = *heads, 16, 32
    layer = OneLayerAttention(hidden, num_heads, num_kv_heads, head_dim)
    lengths = {"a": (5, 9), "b": (1, 12), "c": (17, 4)}  # prompt, output
    inputs = {rid: torch.randn(p + o, hidden) for rid, (p, o) in lengths.items()}
    cache = ContiguousKVCache(256, 64, policy, num_kv_heads=num_kv_heads, head_dim=head_dim)
    outputs = {}
    with torch.no_grad():
        for rid, (p, o) in lengths.items():  # prefill every request
            cache.allocate(rid, p, o)
            q, k, v = layer.qkv(inputs[rid][:p])
            cache.write(0, cache.append(rid, p), k, v)
            keys, values = cache.read(0, rid)
            outputs[rid] = [layer.o(dense_attention(q, keys, values).reshape(p, -1))]
        for step in range(max(o for _, o in lengths.values())):  # decode, interleaved
            for rid, (p, o) in lengths.items():
                if step >= o:
                    continue
                q, k, v = layer.qkv(inputs[rid][p + step : p + step + 1])
                cache.write(0, cache.append(rid), k, v)
                keys, values = cache.read(0, rid)
                outputs[rid].append(layer.o(dense_attention(q, keys, values).reshape(1, -1)))
        for rid, x in inputs.items():
            expected = layer.full_forward(x)
            bound = tolerances.apart(layer.error(x))  # no row attends to more than all of x
            torch.testing.assert_close(torch.cat(outputs[rid]), expected, rtol=0, atol=bound)


@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (14, 2), (4, 1)])
@pytest.mark.parametrize("num_q,num_k", [(7, 7), (1, 9), (3, 11), (5, 5)])
def test_dense_attention_matches_torch_sdpa(heads, num_q, num_k):
    torch.manual_seed(1)
    num_heads, num_kv_heads = heads
    q = torch.randn(num_q, num_heads, 64)
    k, v = torch.randn(2, num_k, num_kv_heads, 64)
    # SDPA's is_causal aligns to the top-left; we align the queries to the end of the keys
    mask = torch.ones(num_q, num_k, dtype=torch.bool).tril(diagonal=num_k - num_q)
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, enable_gqa=True
    ).transpose(0, 1)
    torch.testing.assert_close(dense_attention(q, k, v), expected, **tolerances.attention(q, k, v, num_k))
    full = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), enable_gqa=True, scale=0.3
    ).transpose(0, 1)
    torch.testing.assert_close(dense_attention(q, k, v, scale=0.3, causal=False), full,
                               **tolerances.attention(q, k, v, num_k, scale=0.3))


@pytest.mark.parametrize("window", [1, 3, 7, 11, 50])
@pytest.mark.parametrize("num_q,num_k", [(7, 7), (1, 9), (4, 11)])
def test_a_sliding_window_shows_each_query_its_last_keys_only(window, num_q, num_k):
    """Query i, at position p = num_k - num_q + i, sees keys max(0, p - window + 1) .. p: what it
    sees attending causally to those keys alone."""
    torch.manual_seed(window)
    q = torch.randn(num_q, 8, 16)
    k, v = torch.randn(2, num_k, 2, 16)
    out = dense_attention(q, k, v, sliding_window=window)
    for i in range(num_q):
        p = num_k - num_q + i
        first = max(0, p - window + 1)
        alone = dense_attention(q[i : i + 1], k[first : p + 1], v[first : p + 1])
        torch.testing.assert_close(out[i : i + 1], alone, **tolerances.attention(q, k, v, num_k))
    if window >= num_k:
        torch.testing.assert_close(out, dense_attention(q, k, v), rtol=0, atol=0)
    for bad in (dict(sliding_window=0), dict(sliding_window=2, causal=False)):
        with pytest.raises(ValueError):
            dense_attention(q, k, v, **bad)


def test_dense_attention_keeps_dtype_and_rejects_bad_shapes():
    q = torch.randn(2, 4, 8, dtype=torch.float16)
    k = torch.randn(3, 2, 8, dtype=torch.float16)
    assert dense_attention(q, k, k).dtype == torch.float16
    with pytest.raises(ValueError):
        dense_attention(torch.randn(2, 3, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8))
    with pytest.raises(ValueError):
        dense_attention(torch.randn(2, 4, 8), torch.randn(3, 2, 4), torch.randn(3, 2, 4))
    with pytest.raises(ValueError):
        dense_attention(torch.randn(4, 2, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8))
    with pytest.raises(ValueError):
        dense_attention(torch.randn(2, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8))


@pytest.mark.parametrize(
    "policy,prompt,output,expected",
    [("max", 10, 5, 100), ("max", 60, 40, 100), ("pow2", 10, 5, 16), ("pow2", 16, 16, 32),
     ("pow2", 1, 0, 1), ("pow2", 70, 10, 100), ("oracle", 10, 5, 15), ("oracle", 99, 1, 100)],
)
def test_reservation_policies(policy, prompt, output, expected):
    cache = ContiguousKVCache(1000, 100, policy, num_layers=0)
    assert cache.reservation(prompt, output) == expected
    slab = cache.allocate("r", prompt, output)
    assert (slab.start, slab.size) == (0, expected)


def test_first_fit_placement_reuses_the_first_hole_that_fits():
    cache = ContiguousKVCache(100, 100, "oracle", num_layers=0)
    for rid, n in [("a", 10), ("b", 20), ("c", 30)]:
        cache.allocate(rid, n, 0)
    cache.free("b")
    assert cache.holes() == [(10, 20), (60, 40)]
    assert cache.allocate("d", 15, 0).start == 10  # fits b's old hole
    assert cache.allocate("e", 30, 0).start == 60  # too big for the 5-slot hole left
    assert cache.holes() == [(25, 5), (90, 10)]


def test_placement_is_first_fit_not_best_or_worst_fit():
    # holes in address order: 20 slots, then 10, then 50. A request of 8 fits all three:
    # first fit takes the lowest address (0), best fit the smallest hole (30), worst fit the largest (50)
    cache = ContiguousKVCache(100, 100, "oracle", num_layers=0)
    for rid, n in [("a", 20), ("b", 10), ("c", 10), ("d", 10), ("e", 50)]:
        cache.allocate(rid, n, 0)
    for rid in "ace":
        cache.free(rid)
    assert cache.holes() == [(0, 20), (30, 10), (50, 50)]
    assert cache.allocate("f", 8, 0).start == 0
    assert cache.allocate("g", 10, 0).start == 8  # still the first hole that fits: 12 slots left at 8
    assert cache.allocate("h", 10, 0).start == 30
    assert cache.holes() == [(18, 2), (50, 50)]


def test_external_fragmentation_is_measured_not_assumed():
    cache = ContiguousKVCache(100, 100, "oracle", num_layers=0)
    for i in range(5):
        cache.allocate(i, 20, 0)
    cache.free(1)
    cache.free(3)  # 40 slots free, in two holes of 20
    assert not cache.can_allocate(30, 0)
    with pytest.raises(OutOfSlotsError, match=r"\b20\b.*\b40\b"):
        cache.allocate("big", 30, 0)
    assert cache.usage(next_reservation=30).external == 40
    assert cache.usage(next_reservation=20).external == 0
    assert cache.usage().free == 40


def test_usage_splits_the_arena_exactly():
    cache = ContiguousKVCache(64, 32, "pow2", num_layers=0)
    cache.allocate("a", 5, 4)  # need 9 -> slab 16
    cache.append("a", 5)
    cache.allocate("b", 3, 2)  # need 5 -> slab 8
    cache.append("b", 4)
    usage = cache.usage(next_reservation=48)  # the one hole (40 slots) is too small
    assert usage == CacheUsage(total=64, token=9, reserved=5, internal=10, external=40, free=0)
    fractions = usage.fractions().values()  # each a division, then a sum: in float64
    assert sum(fractions) == pytest.approx(1.0, rel=tolerances.gamma(len(fractions) + 1, torch.float64))
    assert cache.usage() == CacheUsage(64, 9, 5, 10, 0, 40)


def test_write_and_read_by_request_on_every_layer():
    torch.manual_seed(2)
    cache = ContiguousKVCache(32, 16, "oracle", num_layers=3, num_kv_heads=2, head_dim=4)
    assert cache.key_cache[2].shape == (32, 2, 4)
    shadow = {}
    for rid, n in [("a", 5), ("b", 7)]:
        cache.allocate(rid, n, 3)
        slots = cache.append(rid, n)
        assert slots.dtype == torch.int64
        for layer in range(3):
            k, v = torch.randn(2, n, 2, 4)
            cache.write(layer, slots, k, v)
            shadow[rid, layer] = (k, v)
    for (rid, layer), (k, v) in shadow.items():
        got_k, got_v = cache.read(layer, rid)
        assert torch.equal(got_k, k) and torch.equal(got_v, v)
    with pytest.raises(ValueError):
        cache.write(0, torch.tensor([0, 1]), torch.randn(3, 2, 4), torch.randn(3, 2, 4))


@pytest.mark.parametrize(
    "kwargs,match",
    [({"num_slots": 0}, "num_slots"), ({"max_model_len": -1}, "max_model_len"),
     ({"num_kv_heads": 0}, "num_kv_heads"), ({"head_dim": 0}, "head_dim"),
     ({"num_layers": -1}, "num_layers"), ({"policy": "best"}, "best")],
)
def test_bad_construction_is_refused(kwargs, match):
    args = {"num_slots": 10, "max_model_len": 10, **kwargs}
    with pytest.raises(ValueError, match=match):
        ContiguousKVCache(**args)


def test_refused_calls_say_why_and_change_nothing():
    cache = ContiguousKVCache(50, 40, "max", num_kv_heads=1, head_dim=2)
    cache.allocate("a", 3, 2)
    slots = cache.append("a", 3)
    cache.write(0, slots, torch.ones(3, 1, 2), torch.ones(3, 1, 2))
    before = (cache.usage(), cache.holes(), cache.key_cache[0].clone())
    with pytest.raises(ValueError):
        ContiguousKVCache(30, 40, "max", num_layers=0).allocate("x", 1, 1)
    with pytest.raises(ValueError, match=r"\b40\b"):
        cache.allocate("b", 30, 20)
    with pytest.raises(ValueError):
        cache.allocate("a", 1, 1)
    with pytest.raises(ValueError, match="prompt_len"):
        cache.allocate("b", 0, 1)
    with pytest.raises(OutOfSlotsError):
        cache.allocate("b", 1, 1)  # needs 40 slots, 10 are free
    with pytest.raises(ValueError, match=r"\b40\b.*\b3\b"):
        cache.append("a", 38)
    with pytest.raises(UnknownRequestError, match="zz"):
        cache.read(0, "zz")
    assert (cache.usage(), cache.holes()) == before[:2]
    assert torch.equal(cache.key_cache[0], before[2])
    cache.free("a")
    with pytest.raises(UnknownRequestError):
        cache.free("a")


class ContiguousCacheMachine(RuleBasedStateMachine):
    """Random allocate / append / free against a shadow of every request's K/V."""

    requests = Bundle("requests")

    def __init__(self):
        super().__init__()
        self.cache = ContiguousKVCache(64, 32, "pow2", num_layers=1, num_kv_heads=1, head_dim=1)
        self.shadow: dict[int, list[float]] = {}
        self.counter = 0

    @rule(target=requests, prompt=st.integers(1, 20), output=st.integers(0, 12))
    def allocate(self, prompt, output):
        rid, self.counter = self.counter, self.counter + 1
        before = self.cache.usage()
        if self.cache.can_allocate(prompt, output):
            self.cache.allocate(rid, prompt, output)
            self.shadow[rid] = []
        else:
            with pytest.raises(OutOfSlotsError):
                self.cache.allocate(rid, prompt, output)
            assert self.cache.usage() == before
        return rid

    @rule(rid=requests, n=st.integers(1, 4))
    def append(self, rid, n):
        if rid not in self.shadow:
            return
        slab = self.cache.slabs[rid]
        if slab.num_tokens + n > slab.size:
            with pytest.raises(ValueError):
                self.cache.append(rid, n)
            return
        values = [float(self.counter * 100 + i) for i in range(n)]
        self.counter += 1
        kv = torch.tensor(values).view(n, 1, 1)
        self.cache.write(0, self.cache.append(rid, n), kv, -kv)
        self.shadow[rid].extend(values)

    @rule(rid=consumes(requests))
    def free(self, rid):
        if rid in self.shadow:
            self.cache.free(rid)
            del self.shadow[rid]
        else:
            with pytest.raises(UnknownRequestError):
                self.cache.free(rid)

    @invariant()
    def contents_equal_the_shadow(self):
        for rid, values in self.shadow.items():
            k, v = self.cache.read(0, rid)
            assert k.flatten().tolist() == values and v.flatten().tolist() == [-x for x in values]

    @invariant()
    def slabs_never_overlap_and_usage_adds_up(self):
        spans = sorted((s.start, s.start + s.size) for s in self.cache.slabs.values())
        assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
        assert all(0 <= a and b <= 64 for a, b in spans)
        for nxt in (None, 1, 8, 33):
            u = self.cache.usage(nxt)
            assert u.token + u.reserved + u.internal + u.external + u.free == u.total == 64


TestContiguousCacheMachine = ContiguousCacheMachine.TestCase
TestContiguousCacheMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.integers(0, 40), st.sampled_from(["max", "pow2", "oracle"]))
def test_every_policy_reserves_at_least_what_is_needed(prompt, output, policy):
    cache = ContiguousKVCache(128, 80, policy, num_layers=0)
    size = cache.reservation(prompt, output)
    assert prompt + output <= size <= 80
    if policy == "pow2" and size < 80:
        assert size & (size - 1) == 0 and size < 2 * (prompt + output)


@pytest.mark.parametrize("head_dim", [80, 96, 112, 128])
def test_the_default_scale_is_one_over_the_square_root_of_head_dim(head_dim):
    """Head dims of real models that are not perfect squares: the default is 1 / sqrt(head_dim), however it
    is computed (``* head_dim**-0.5``, ``/ sqrt(head_dim)``, SDPA's own default).

    One query, two keys: the first key is the query itself (q . k = 20), the second zero, with values
    one and zero, so every output is sigmoid(20 scale). The scale of a rounded square root (1-3% off
    for these dims) moves it by far more than rounding can."""
    q = torch.full((1, 2, head_dim), (20 / head_dim) ** 0.5)
    k = torch.cat([q, torch.zeros_like(q)])
    v = torch.cat([torch.ones_like(q), torch.zeros_like(q)])
    tol = tolerances.attention(q, k, v, 2)
    out = dense_attention(q, k, v)
    torch.testing.assert_close(out, torch.full_like(q, torch.sigmoid(torch.tensor(20 / head_dim**0.5)).item()), **tol)
    rounded = torch.sigmoid(torch.tensor(20 / round(head_dim**0.5))).item()
    assert (out - rounded).abs().min() > 10 * tol["atol"]
