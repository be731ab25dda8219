"""Stage 13 — an FP8 KV cache: one byte per value, twice the tokens in the same memory.

The seed's argument is a chain: less KV memory wasted, more requests resident, bigger decode
batches, each read of the weights shared by more tokens, more throughput. Paging removed the
waste; the next link is to make every token's K/V smaller. vLLM's ``kv_cache_dtype="fp8"``
stores each value in e4m3 (``torch.float8_e4m3fn``: 1 sign bit, 4 exponent bits, 3 mantissa
bits, largest finite value 448) with one scale per layer for K and one for V:

* **write** — ``quantize_fp8``: ``x / scale``, saturated to ±448, rounded to the nearest e4m3
  value. The saturation is explicit: what a cast does with a value past 448 (NaN, or the
  largest value) has differed between releases and devices.
* **read** — ``dequantize_fp8``: ``e4m3 * scale``. A value keeps 3 bits of mantissa: its error
  is at most ``2**-4`` of itself, or ``2**-10 * scale`` near zero (``fp8_rounding_bound``).
* **attend** — the scales are per tensor, so they leave the dot products: ``q · (k_scale K) =
  k_scale (q · K)`` and ``Σ p (v_scale V) = v_scale Σ p V``. K's scale joins the softmax scale and
  V's multiplies the output, as FlashAttention-3's FP8 path does with its descale factors; the
  kernel only widens the e4m3 values it loads, in registers (stage 5's kernels convert each tile
  to the query's dtype). The reference gathers the step's blocks, dequantises them, and runs
  stage 4 on them: it is the definition the kernels are checked against.

The scales are 1.0 unless the cache calibrates them (``calculate_kv_scales``, vLLM's): on its
first write, each layer's ``k_scale`` is ``max|K| / 200`` and ``v_scale`` ``max|V| / 100``
(vLLM's ``K_SCALE_CONSTANT`` and ``V_SCALE_CONSTANT``), so that the first batch's largest value
lands well inside ±448 with room for larger ones later. That reads one number back per layer,
once. Every other path moves the blocks' bytes as they are: copy-on-write copies, swapping and
prefix-cache hits need no scale, since a layer has one scale for all its blocks.

How far attention over the FP8 cache may drift from attention over the unquantised one follows
from the rounding bound (``attention_error_bound``): V's error passes through the softmax
average unchanged, and K's moves every score by at most ``ε = scale · Σ|q| · max|δK|``, which
changes each weight by a factor within ``e^{±2ε}``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from minipaged.models.parallel import get_tensor_model_parallel_world_size
from minipaged.stage4_reference_attention import check_paged_attention_args, paged_attention_ref
from minipaged.stage6_swapping import SwapPagedKVCache

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value: 1.75 * 2**8
MANTISSA_BITS = 3
MIN_NORMAL_EXPONENT = -6  # e4m3's smallest normal is 2**-6; below it the spacing is 2**-9
K_SCALE_CONSTANT, V_SCALE_CONSTANT = 200.0, 100.0  # vLLM's: calibration maps max|K| and max|V| to these


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x / scale`` in e4m3: saturated to ±``FP8_MAX``, then rounded to the nearest e4m3 value."""
    # BEGIN SOLUTION divide by the scale, saturate, round by the cast
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    # END SOLUTION


def dequantize_fp8(x: torch.Tensor, scale: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values ``x`` (e4m3) stands for: ``x * scale``, in ``dtype``."""
    # BEGIN SOLUTION widen to float32 first: e4m3 values are exact there
    return (x.to(torch.float32) * scale).to(dtype)
    # END SOLUTION


def fp8_rounding_bound(x: torch.Tensor, scale: float) -> torch.Tensor:
    """The most ``dequantize_fp8(quantize_fp8(x, scale), scale)`` can differ from ``x`` (float32, elementwise),
    for ``|x| <= FP8_MAX * scale``: half a step of 3 mantissa bits, ``2**-4 |x|``, where ``x / scale`` is a
    normal e4m3 value, and half the subnormal spacing, ``2**-10 * scale``, below ``2**-6 * scale``."""
    relative = 2.0 ** -(MANTISSA_BITS + 1)
    absolute = 2.0 ** (MIN_NORMAL_EXPONENT - MANTISSA_BITS - 1) * scale
    return torch.maximum(x.float().abs() * relative, torch.full_like(x, absolute, dtype=torch.float32))


def attention_error_bound(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, k_scale: float,
                          v_scale: float, scale: float | None = None) -> torch.Tensor:
    """How far one sequence's attention over its quantised K/V may be from attention over ``keys`` and
    ``values`` themselves: a bound on every output element, ``(num_queries, num_heads, head_dim)``.

    ``query`` ``(num_queries, num_heads, head_dim)``, ``keys``/``values`` ``(seq_len, num_kv_heads,
    head_dim)``, with ``δK``, ``δV`` their rounding bounds. Score ``i`` moves by at most ``ε_i = scale ·
    Σ_d |q_d| δK_id``; with ``ε`` the largest, each softmax weight changes by a factor within ``e^{±2ε}``, so
    the weights move by at most ``e^{2ε} - 1`` in all. The output ``Σ p' V' - Σ p V = Σ p' δV + Σ (p' - p) V``
    moves by at most ``max_i δV_i + (e^{2ε} - 1) max_i |V_i|``. Float32's own rounding is not included."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    group = query.shape[1] // keys.shape[1]  # query head h reads KV head h // group
    dk = fp8_rounding_bound(keys, k_scale).repeat_interleave(group, dim=1)  # (seq_len, num_heads, head_dim)
    dv = fp8_rounding_bound(values, v_scale).repeat_interleave(group, dim=1)
    v = values.float().abs().repeat_interleave(group, dim=1)
    eps = scale * torch.einsum("qhd,khd->qhk", query.float().abs(), dk).amax(-1)  # (num_queries, num_heads)
    return dv.amax(0) + torch.expm1(2 * eps)[..., None] * v.amax(0)


class FP8PagedKVCache(SwapPagedKVCache):
    """Stage 6's cache (copy-on-write copies, swapping) with every block in e4m3, and a ``k_scale`` and
    a ``v_scale`` per layer (1.0, or calibrated on the layer's first write: ``calculate_kv_scales``).

    ``write`` quantises; ``gather`` dequantises, to ``dtype`` (the model's). The blocks' bytes are
    copied and swapped as they are: a layer's scales hold for every one of its blocks."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", num_cpu_blocks: int = 0,
                 *, calculate_kv_scales: bool = False) -> None:
        super().__init__(num_layers, num_blocks, block_size, num_kv_heads, head_dim, FP8_DTYPE, device,
                         num_cpu_blocks)
        self.dtype = dtype
        self.k_scale = [1.0] * num_layers
        self.v_scale = [1.0] * num_layers
        self.needs_scales = [calculate_kv_scales] * num_layers  # a layer calibrates on its first write
        self.layers = {id(t): layer for layer, t in enumerate(self.key_cache)}

    def calibrate(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """vLLM's ``calculate_kv_scales``: ``k_scale = max|key| / 200``, ``v_scale = max|value| / 100``
        (a scale stays 1.0 where every value is 0). The two maxima are read back from the device at once;
        under tensor parallelism (stage 11) each rank holds some KV heads, and the ranks first agree on the
        largest, so that every rank, and the engine, have the scales one process would."""
        largest = torch.stack([key.abs().max(), value.abs().max()]).float()
        if get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        # BEGIN SOLUTION each scale from its own tensor's largest magnitude, over its own constant
        k_max, v_max = largest.tolist()
        self.k_scale[layer] = k_max / K_SCALE_CONSTANT if k_max > 0 else 1.0
        self.v_scale[layer] = v_max / V_SCALE_CONSTANT if v_max > 0 else 1.0
        self.needs_scales[layer] = False  # from now on the layer's scales stay: its blocks were written with them
        # END SOLUTION

    def write(self, layer: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
              checked: bool = False) -> None:
        """Stage 2's ``write`` of K/V quantised with the layer's scales (calibrated first if asked)."""
        if self.needs_scales[layer]:
            self.calibrate(layer, key, value)
        # BEGIN SOLUTION K with k_scale, V with v_scale, of this layer
        super().write(layer, slot_mapping, quantize_fp8(key, self.k_scale[layer]),
                      quantize_fp8(value, self.v_scale[layer]), checked=checked)
        # END SOLUTION

    def gather(self, layer: int, block_table, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's K/V, dequantised to ``dtype``: ``(seq_len, num_kv_heads, head_dim)`` each."""
        keys, values = super().gather(layer, block_table, seq_len)
        return (dequantize_fp8(keys, self.k_scale[layer], self.dtype),
                dequantize_fp8(values, self.v_scale[layer], self.dtype))

    def layer_of(self, key_cache: torch.Tensor) -> int:
        """The layer whose ``key_cache`` tensor this is (the attention backend is handed the tensor)."""
        return self.layers[id(key_cache)]


def check_fp8_attention_args(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                             block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor | None,
                             k_scale: float, v_scale: float) -> None:
    """Stage 4's checks, with e4m3 caches in place of caches of the query's dtype, and positive finite scales."""
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dtype != FP8_DTYPE:
            raise ValueError(f"{name}.dtype: expected {FP8_DTYPE}, got {cache.dtype}")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if isinstance(s, bool) or not isinstance(s, int | float) or not 0 < s < math.inf:
            raise ValueError(f"{name}: expected a positive finite number, got {s!r}")
    like = query.new_empty(()).expand(key_cache.shape)  # the cache's shape and the query's dtype, no storage
    check_paged_attention_args(query, like, query.new_empty(()).expand(value_cache.shape), block_tables, seq_lens,
                               query_start_loc)
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.device != query.device:
            raise ValueError(f"{name}.device: expected the query's device {query.device}, got {cache.device}")


def dequantized_blocks(key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                       seq_lens: torch.Tensor, k_scale: float, v_scale: float,
                       max_seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The blocks a batch reads, dequantised to float32, and block tables that number them ``0, 1, ...``:
    ``(num_seqs * width, block_size, num_kv_heads, head_dim)`` twice, and int32 ``(num_seqs, width)``.
    ``width`` covers ``max_seq_len`` (else the tables' width); table entries past a sequence's blocks
    are never read (block 0 stands in for them)."""
    num_seqs, block_size = block_tables.shape[0], key_cache.shape[1]
    width = block_tables.shape[1] if max_seq_len is None else min(block_tables.shape[1], -(-max_seq_len // block_size))
    # BEGIN SOLUTION gather the blocks in use (bytes), then dequantise each with its own scale
    starts = torch.arange(width, device=block_tables.device) * block_size
    in_use = starts[None, :] < seq_lens[:, None]  # (num_seqs, width)
    ids = torch.where(in_use, block_tables[:, :width].long(), 0).flatten()
    keys = dequantize_fp8(key_cache.index_select(0, ids), k_scale)
    values = dequantize_fp8(value_cache.index_select(0, ids), v_scale)
    # END SOLUTION
    tables = torch.arange(num_seqs * width, dtype=torch.int32, device=block_tables.device).view(num_seqs, width)
    return keys, values, tables


def paged_attention_fp8_ref(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float | None = None, query_start_loc: torch.Tensor | None = None, *,
    k_scale: float = 1.0, v_scale: float = 1.0, validate: bool = True, max_query_len: int | None = None,
    max_seq_len: int | None = None, sliding_window: int | None = None,
) -> torch.Tensor:
    """Stage 4's ``paged_attention_ref`` over e4m3 caches: the step's blocks dequantised (``k_scale``,
    ``v_scale``), then attended in float32; the shape and dtype of ``query``. Other arguments as stage 4's."""
    if validate:
        check_fp8_attention_args(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                 k_scale, v_scale)
    keys, values, tables = dequantized_blocks(key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale,
                                              max_seq_len)
    out = paged_attention_ref(query.float(), keys, values, tables, seq_lens, scale, query_start_loc,
                              validate=False, max_query_len=max_query_len, max_seq_len=max_seq_len,
                              sliding_window=sliding_window)
    return out.to(query.dtype)


def paged_attention_fp8_triton(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float | None = None, query_start_loc: torch.Tensor | None = None, *,
    k_scale: float = 1.0, v_scale: float = 1.0, validate: bool = True, version: str = "auto",
    max_query_len: int | None = None, max_seq_len: int | None = None, sliding_window: int | None = None,
) -> torch.Tensor:
    """Stage 5's kernels on e4m3 caches: each tile is widened in registers, ``k_scale`` joins the softmax
    scale and ``v_scale`` multiplies the output. Equal to ``paged_attention_fp8_ref`` (within float32's
    order of summation, and the query's dtype)."""
    from minipaged.stage5_triton_attention import paged_attention_triton  # Triton, only when asked for

    if validate:
        check_fp8_attention_args(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                 k_scale, v_scale)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    lengths = dict(max_query_len=max_query_len, max_seq_len=max_seq_len,  # the engine's host numbers
                   sliding_window=sliding_window)
    # BEGIN SOLUTION fold the scales out of the kernel: k_scale into the softmax scale, v_scale onto the output
    out = paged_attention_triton(query, key_cache, value_cache, block_tables, seq_lens, scale * k_scale,
                                 query_start_loc, version=version, validate=False, **lengths)
    return out * v_scale
    # END SOLUTION


FP8_BACKENDS = {"ref": paged_attention_fp8_ref, "triton": paged_attention_fp8_triton}  # by attention_backend


class FP8Attention:
    """The engine's attention backend over an ``FP8PagedKVCache``: the model hands it a layer's cache
    tensors, as it hands any backend; this finds that layer's scales and calls ``backend``, one of
    ``FP8_BACKENDS``."""

    def __init__(self, backend: Callable[..., torch.Tensor], cache: FP8PagedKVCache) -> None:
        self.backend, self.cache = backend, cache

    def __call__(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float | None = None,
                 query_start_loc: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        layer = self.cache.layer_of(key_cache)
        return self.backend(query, key_cache, value_cache, block_tables, seq_lens, scale, query_start_loc,
                            k_scale=self.cache.k_scale[layer], v_scale=self.cache.v_scale[layer], **kwargs)


def fp8_attention(name: str, cache: FP8PagedKVCache) -> FP8Attention:
    """The backend named ``name`` (``"ref"`` or ``"triton"``) over ``cache``: what the engine's layers call,
    in this process or in a tensor-parallel worker."""
    return FP8Attention(FP8_BACKENDS[name], cache)


def check_fp8_supported(device: str | torch.device, attention_backend: str) -> None:
    """``ValueError`` where the Triton kernels cannot read e4m3: Triton's ``fp8e4nv`` needs a GPU of compute
    capability 8.9 or more (Ada, Hopper), as vLLM's FP8 kernels do; the reference runs anywhere."""
    device = torch.device(device)
    if device.type == "cuda" and attention_backend == "triton" and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ValueError(f"kv_cache_dtype='fp8' with the Triton kernels needs compute capability 8.9 or more "
                             f"(Triton's fp8e4nv); this GPU has {capability[0]}.{capability[1]}: use "
                             "attention_backend='ref' or kv_cache_dtype='auto'")


__all__ = ["FP8_BACKENDS", "FP8_DTYPE", "FP8_MAX", "FP8Attention", "FP8PagedKVCache", "K_SCALE_CONSTANT",
           "V_SCALE_CONSTANT", "attention_error_bound", "check_fp8_attention_args", "check_fp8_supported",
           "dequantize_fp8", "dequantized_blocks", "fp8_attention", "fp8_rounding_bound", "paged_attention_fp8_ref",
           "paged_attention_fp8_triton", "quantize_fp8"]
