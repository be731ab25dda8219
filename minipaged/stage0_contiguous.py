"""Stage 0 — the contiguous KV cache: one reserved slab per request.

To produce token t, a transformer attends over the keys and values (K/V) of every
token before it. An engine keeps those K/V in memory, the *KV cache*, so that each
decode step computes K/V for one new token only. Decode then reads the whole cache
for every token it writes: it is bound by memory, and how many requests fit in
memory decides how many can be batched together.

Before PagedAttention, serving systems stored each request's K/V in one contiguous
slab, reserved when the request is admitted. The output length is not known in
advance, so the slab is sized by a policy:

* ``max``    — the model's maximum length, whatever the request;
* ``pow2``   — what the request will need (prompt + output), rounded up to a power of two;
* ``oracle`` — exactly prompt + output (impossible in practice: a lower bound on waste).

This stage builds that cache so that later stages have something to beat and
something to be checked against. At any moment its arena of token slots splits into

* **token** slots, holding real K/V;
* **reserved** slots, kept for tokens the request has not generated yet;
* **internal** fragmentation, reserved but never to be used;
* **external** fragmentation, free holes too small for the next waiting request;
* **free** slots.

Slabs are placed first-fit, so holes between them appear as requests come and go:
external fragmentation is measured, not assumed.

``dense_attention`` is the plain attention every later attention is checked against.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

POLICIES = ("max", "pow2", "oracle")


class OutOfSlotsError(RuntimeError):
    """No free hole in the arena is large enough for a request, right now."""


class UnknownRequestError(LookupError):
    """The request id is not in the cache (never allocated, or already freed)."""


@dataclass
class Slab:
    """One request's contiguous reservation in the arena."""

    request_id: Hashable
    start: int  # first slot of the slab
    size: int  # slots reserved
    prompt_len: int
    output_len: int  # tokens the request will generate in the end
    num_tokens: int = 0  # slots that hold K/V so far

    @property
    def need(self) -> int:
        """Slots the request will ever fill: prompt + output."""
        return self.prompt_len + self.output_len


@dataclass(frozen=True)
class CacheUsage:
    """The arena split into five kinds of slot; the five add up to ``total``."""

    total: int
    token: int
    reserved: int
    internal: int
    external: int
    free: int

    def fractions(self) -> dict[str, float]:
        """Each kind as a share of the arena (0 to 1)."""
        kinds = ("token", "reserved", "internal", "external", "free")
        return {k: getattr(self, k) / self.total for k in kinds}


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


class ContiguousKVCache:
    """An arena of ``num_slots`` token slots; each request holds one contiguous slab.

    Per layer, ``key_cache[layer]`` and ``value_cache[layer]`` have shape
    ``(num_slots, num_kv_heads, head_dim)``; a request's K/V live in slots
    ``slab.start .. slab.start + slab.num_tokens - 1``. ``num_layers=0`` keeps the
    bookkeeping only (no tensors), for simulations.
    """

    def __init__(
        self,
        num_slots: int,
        max_model_len: int,
        policy: str = "max",
        *,
        num_layers: int = 1,
        num_kv_heads: int = 1,
        head_dim: int = 1,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        # BEGIN SOLUTION check the arguments, then create the slab table and the K/V tensors
        _check_positive(
            num_slots=num_slots, max_model_len=max_model_len,
            num_kv_heads=num_kv_heads, head_dim=head_dim,
        )
        if not isinstance(num_layers, int) or num_layers < 0:
            raise ValueError(f"num_layers must be an integer >= 0, got {num_layers!r}")
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; allowed: {', '.join(POLICIES)}")
        self.num_slots, self.max_model_len, self.policy = num_slots, max_model_len, policy
        self.slabs: dict[Hashable, Slab] = {}
        shape = (num_slots, num_kv_heads, head_dim)
        self.key_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.value_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # END SOLUTION

    def reservation(self, prompt_len: int, output_len: int) -> int:
        """Slots the policy reserves for a request of ``prompt_len`` + ``output_len`` tokens.

        Raises ``ValueError`` if the request is malformed or longer than ``max_model_len``.
        """
        # BEGIN SOLUTION size a slab by the policy (max, pow2, oracle)
        _check_positive(prompt_len=prompt_len)
        if not isinstance(output_len, int) or output_len < 0:
            raise ValueError(f"output_len must be an integer >= 0, got {output_len!r}")
        need = prompt_len + output_len
        if need > self.max_model_len:
            raise ValueError(
                f"request needs {need} slots (prompt {prompt_len} + output {output_len}), "
                f"more than max_model_len={self.max_model_len}"
            )
        if self.policy == "max":
            return self.max_model_len
        if self.policy == "pow2":
            return min(1 << (need - 1).bit_length(), self.max_model_len)
        return need
        # END SOLUTION

    def holes(self) -> list[tuple[int, int]]:
        """The free holes of the arena as ``(start, length)``, in address order."""
        # BEGIN SOLUTION walk the slabs in address order and collect the gaps
        holes, cursor = [], 0
        for slab in sorted(self.slabs.values(), key=lambda s: s.start):
            if slab.start > cursor:
                holes.append((cursor, slab.start - cursor))
            cursor = slab.start + slab.size
        if cursor < self.num_slots:
            holes.append((cursor, self.num_slots - cursor))
        return holes
        # END SOLUTION

    def can_allocate(self, prompt_len: int, output_len: int) -> bool:
        """Whether a hole is large enough for the request's reservation now."""
        # BEGIN SOLUTION first-fit: is there a hole at least as long as the reservation?
        size = self.reservation(prompt_len, output_len)
        return any(length >= size for _, length in self.holes())
        # END SOLUTION

    def allocate(self, request_id: Hashable, prompt_len: int, output_len: int) -> Slab:
        """Reserve a slab for a new request, in the first hole that fits (first fit: the lowest
        address with room, not the smallest hole that fits nor the largest).

        Raises ``ValueError`` for a duplicate id or a request that can never fit the arena,
        and ``OutOfSlotsError`` when it could fit but no hole is large enough now. A refused
        call changes nothing.
        """
        # BEGIN SOLUTION validate, then place the slab first-fit
        if request_id in self.slabs:
            raise ValueError(f"request {request_id!r} already holds a slab")
        size = self.reservation(prompt_len, output_len)
        if size > self.num_slots:
            raise ValueError(
                f"request {request_id!r} needs a slab of {size} slots under policy "
                f"{self.policy!r}; the arena has only {self.num_slots}: it can never fit"
            )
        holes = self.holes()
        start = next((s for s, length in holes if length >= size), None)
        if start is None:
            free = sum(length for _, length in holes)
            largest = max((length for _, length in holes), default=0)
            raise OutOfSlotsError(
                f"request {request_id!r} needs {size} contiguous slots; the largest free "
                f"hole has {largest} ({free} slots free in all)"
            )
        slab = Slab(request_id, start, size, prompt_len, output_len)
        self.slabs[request_id] = slab
        return slab
        # END SOLUTION

    def _slab(self, request_id: Hashable) -> Slab:
        if request_id not in self.slabs:
            raise UnknownRequestError(
                f"request {request_id!r} is not in the cache (never allocated, or already freed)"
            )
        return self.slabs[request_id]

    def append(self, request_id: Hashable, num_tokens: int = 1) -> torch.Tensor:
        """Make room for ``num_tokens`` new tokens; return their slots, int64 ``(num_tokens,)``."""
        # BEGIN SOLUTION check the slab has room, advance num_tokens, return the new slots
        slab = self._slab(request_id)
        _check_positive(num_tokens=num_tokens)
        if slab.num_tokens + num_tokens > slab.size:
            raise ValueError(
                f"request {request_id!r} reserved {slab.size} slots and holds "
                f"{slab.num_tokens}; it cannot take {num_tokens} more"
            )
        first = slab.start + slab.num_tokens
        slab.num_tokens += num_tokens
        return torch.arange(first, first + num_tokens, dtype=torch.int64)
        # END SOLUTION

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store K/V of shape ``(num_tokens, num_kv_heads, head_dim)`` at ``slots``."""
        # BEGIN SOLUTION scatter key and value into this layer's arena at the given slots
        cache = self.key_cache[layer]
        expected = (slots.numel(), *cache.shape[1:])
        for name, t in (("key", key), ("value", value)):
            if tuple(t.shape) != expected:
                raise ValueError(f"{name} must have shape {expected}, got {tuple(t.shape)}")
        self.key_cache[layer][slots] = key.to(cache.dtype)
        self.value_cache[layer][slots] = value.to(cache.dtype)
        # END SOLUTION

    def read(self, layer: int, request_id: Hashable) -> tuple[torch.Tensor, torch.Tensor]:
        """A request's K/V so far, each ``(num_tokens, num_kv_heads, head_dim)``."""
        # BEGIN SOLUTION slice the request's slab out of this layer's arena
        slab = self._slab(request_id)
        end = slab.start + slab.num_tokens
        return self.key_cache[layer][slab.start : end], self.value_cache[layer][slab.start : end]
        # END SOLUTION

    def free(self, request_id: Hashable) -> None:
        """Return a request's slab to the arena."""
        # BEGIN SOLUTION drop the slab (an unknown id is an error)
        self._slab(request_id)
        del self.slabs[request_id]
        # END SOLUTION

    def usage(self, next_reservation: int | None = None) -> CacheUsage:
        """Split the arena into token / reserved / internal / external / free slots.

        ``next_reservation`` is the slab size the next waiting request would need: free
        holes smaller than it are external fragmentation. ``None``: nobody waits.
        """
        # BEGIN SOLUTION add up the five kinds of slot
        token = sum(s.num_tokens for s in self.slabs.values())
        reserved = sum(max(s.need - s.num_tokens, 0) for s in self.slabs.values())
        internal = sum(s.size - max(s.need, s.num_tokens) for s in self.slabs.values())
        holes = [length for _, length in self.holes()]
        external = 0 if next_reservation is None else sum(h for h in holes if h < next_reservation)
        free = sum(holes) - external
        return CacheUsage(self.num_slots, token, reserved, internal, external, free)
        # END SOLUTION


def dense_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Plain softmax attention over contiguous K/V, computed in float32.

    query: ``(num_queries, num_heads, head_dim)``; key, value: ``(num_keys, num_kv_heads,
    head_dim)``. ``num_heads`` must be a multiple of ``num_kv_heads`` (query head ``h``
    reads KV head ``h // (num_heads // num_kv_heads)``: MHA, GQA, MQA). With ``causal``,
    the queries are the *last* ``num_queries`` tokens: query ``i`` sees keys
    ``0 .. num_keys - num_queries + i``. Returns ``(num_queries, num_heads, head_dim)``
    in the query's dtype; ``scale`` defaults to ``1 / sqrt(head_dim)``. A ``sliding_window`` ``W``
    (causal only) narrows what each query sees to its last ``W`` keys, itself included: query ``i``
    at position ``p`` sees keys ``max(0, p - W + 1) .. p``, as a layer of Mistral or Gemma does.
    """
    if sliding_window is not None and (not causal or sliding_window < 1):
        raise ValueError(f"sliding_window: expected at least 1, with causal=True; got {sliding_window} "
                         f"with causal={causal}")
    # BEGIN SOLUTION check shapes, expand KV heads, mask, softmax, weighted sum
    if query.dim() != 3 or key.dim() != 3 or value.shape != key.shape:
        raise ValueError(
            "expected query (num_queries, num_heads, head_dim) and key, value of one shape "
            f"(num_keys, num_kv_heads, head_dim); got {tuple(query.shape)}, "
            f"{tuple(key.shape)}, {tuple(value.shape)}"
        )
    num_q, num_heads, head_dim = query.shape
    num_k, num_kv_heads, _ = key.shape
    if key.shape[2] != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"head_dim must match ({head_dim} vs {key.shape[2]}) and num_heads ({num_heads}) "
            f"must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if causal and num_q > num_k:
        raise ValueError(f"causal attention needs num_queries <= num_keys, got {num_q} > {num_k}")
    scale = head_dim**-0.5 if scale is None else scale
    group = num_heads // num_kv_heads
    k = key.float().repeat_interleave(group, dim=1)  # (num_keys, num_heads, head_dim)
    v = value.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), k) * scale  # (heads, num_q, num_k)
    if causal:
        q_pos = torch.arange(num_q, device=query.device)[:, None] + (num_k - num_q)
        k_pos = torch.arange(num_k, device=query.device)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        if sliding_window is not None:  # nor what lies sliding_window or more tokens back
            scores = scores.masked_fill(k_pos <= q_pos - sliding_window, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    # END SOLUTION
