"""The transformer layers, written for a flattened batch over a paged KV cache.

One forward pass takes the new tokens of every scheduled sequence, concatenated:
``input_ids`` and ``positions`` of shape ``(num_tokens,)``. Each attention layer writes the
new tokens' K/V into the paged cache through ``slot_mapping`` (stage 2's ``write``), then calls the attention backend
(stage 4's ``paged_attention_ref`` or stage 5's ``paged_attention_triton``), which reads
each sequence's context through its block table. Prefills and decodes share one batch.

Module and parameter names follow Hugging Face's, except that the projections which read
the same input are declared fused, as in vLLM: ``qkv_proj`` (q, k, v) and ``gate_up_proj``
(gate, up); the loader packs a checkpoint's separate weights into them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from minipaged.common.device import to_device
from minipaged.models.config import ModelConfig


@dataclass
class AttentionMetadata:
    """Where each new token's K/V goes, and what each sequence attends over: built once per step, on
    the host, then handed to every layer, as vLLM's attention metadata builders do.

    Its tensors are on the model's device; ``max_query_len`` and ``max_seq_len`` are host numbers, so
    that no layer reads a value back from the device (on a GPU, each read waits for every kernel
    queued before it). The values were checked when it was built (``from_host``'s caller does)."""

    slot_mapping: torch.Tensor  # int64 (num_tokens,); every entry a slot of the cache (no -1)
    block_tables: torch.Tensor  # int32 (num_seqs, max_blocks_per_seq)
    seq_lens: torch.Tensor  # int32 (num_seqs,)
    query_start_loc: torch.Tensor | None  # int32 (num_seqs + 1,); None: one decode token each
    backend: Callable  # paged_attention_ref or paged_attention_triton
    max_query_len: int = 1  # the most new tokens of any sequence
    max_seq_len: int = 0  # the longest context, the new tokens included

    @classmethod
    def from_host(cls, slot_mapping: np.ndarray, block_tables: np.ndarray, seq_lens: np.ndarray,
                  query_start_loc: np.ndarray | None, backend: Callable, device: torch.device) -> AttentionMetadata:
        """The step's metadata from its host arrays (checked already): one copy of each to ``device``."""
        def upload(array: np.ndarray, dtype: type) -> torch.Tensor:
            return to_device(array.astype(dtype), device)

        return cls(upload(slot_mapping, np.int64), upload(block_tables, np.int32), upload(seq_lens, np.int32),
                   None if query_start_loc is None else upload(query_start_loc, np.int32), backend,
                   max_query_len=int(np.diff(query_start_loc).max()) if query_start_loc is not None else 1,
                   max_seq_len=int(seq_lens.max()) if seq_lens.size else 0)


    def per_group(self, group_of_layer: list[int]) -> GroupedAttentionMetadata:
        """Metadata whose ``slot_mapping`` and ``block_tables`` hold a group's each along a first axis (as a
        tensor-parallel worker is sent them), split into one per KV cache group (views, nothing copied)."""
        groups = [dataclasses.replace(self, slot_mapping=slots, block_tables=tables)
                  for slots, tables in zip(self.slot_mapping, self.block_tables, strict=True)]
        return GroupedAttentionMetadata(groups, group_of_layer)


@dataclass
class GroupedAttentionMetadata:
    """A step's metadata where the layers keep several KV cache groups (stage 15), each with block tables
    of its own: one ``AttentionMetadata`` per group (the same lengths, its own slots and tables), and
    each layer's group. ``meta[layer]`` is the layer's."""

    groups: list[AttentionMetadata]
    group_of_layer: list[int]

    def __getitem__(self, layer: int) -> AttentionMetadata:
        return self.groups[self.group_of_layer[layer]]


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name == "silu":
        return F.silu
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    raise ValueError(f"activation {name!r} is not supported; supported: silu, gelu, gelu_new")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding, the "rotate half" convention (Llama, Qwen, Mistral)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def paged_attention(q, k, v, cache, layer: int, meta: AttentionMetadata | GroupedAttentionMetadata, scale: float,
                    sliding_window: int | None = None) -> torch.Tensor:
    """Write the new K/V into the paged cache (stage 2's ``write``), then attend over each context,
    or over its last ``sliding_window`` tokens in a layer that slides.

    ``cache`` is a ``PagedKVCache``: per layer, ``key_cache`` / ``value_cache`` of shape
    ``(num_blocks, block_size, num_kv_heads, head_dim)``. ``meta`` is every layer's, or each group's
    (layers of different KV cache groups keep different block tables: stage 15).
    """
    meta = meta[layer] if isinstance(meta, GroupedAttentionMetadata) else meta
    cache.write(layer, meta.slot_mapping, k, v, checked=True)  # checked once, on the host, when meta was built
    return meta.backend(q, cache.key_cache[layer], cache.value_cache[layer], meta.block_tables, meta.seq_lens,
                        scale=scale, query_start_loc=meta.query_start_loc, validate=False,
                        max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len,
                        sliding_window=sliding_window)


class LlamaAttention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        # q, k and v in one matmul (vLLM's qkv_proj); the loader packs Hugging Face's q/k/v_proj into it
        self.qkv_proj = nn.Linear(c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.o_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.norm_eps)

    def forward(self, x, cos, sin, cache, layer, meta):  # x: (num_tokens, hidden)
        c = self.c
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim], -1)
        q = q.reshape(-1, c.num_heads, c.head_dim)  # (num_tokens, num_heads, head_dim)
        k = k.reshape(-1, c.num_kv_heads, c.head_dim)
        v = v.reshape(-1, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = paged_attention(q, k, v, cache, layer, meta, c.head_dim**-0.5, c.window_of(layer))
        return self.o_proj(out.reshape(len(x), -1))


class LlamaMLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        # gate and up in one matmul (vLLM's gate_up_proj); the loader packs gate_proj and up_proj into it
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)
        self.act = activation(c.hidden_act)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.self_attn = LlamaAttention(c)
        self.mlp = LlamaMLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.norm_eps)

    def forward(self, x, cos, sin, cache, layer, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.norm_eps)


class LlamaForCausalLM(nn.Module):
    """Llama 2 and 3, Mistral, Qwen2 (bias on q/k/v) and Qwen3 (q/k norms)."""

    inv_freq: torch.Tensor  # the RoPE frequencies, a buffer (not in the state dict)

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.config = c
        self.model = LlamaModel(c)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", c.inv_freq(), persistent=False)

    def forward(self, input_ids, positions, cache, meta: AttentionMetadata):
        """Hidden states ``(num_tokens, hidden)`` of the new tokens; K/V written into ``cache`` on the way."""
        x = self.model.embed_tokens(input_ids)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # (num_tokens, head_dim / 2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # broadcast over heads
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, cache, i, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


class Conv1D(nn.Module):
    """GPT-2's linear layer: the weight is stored (in_features, out_features)."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return torch.addmm(self.bias, x, self.weight)


class GPT2Attention(nn.Module):
    """The projections of GPT-2's attention, under its checkpoint's names: ``c_attn`` (q, k, v) and ``c_proj``."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c_attn = Conv1D(c.hidden_size, 3 * c.num_heads * c.head_dim)  # num_heads * head_dim = hidden_size
        self.c_proj = Conv1D(c.num_heads * c.head_dim, c.hidden_size)


class GPT2MLP(nn.Module):
    """GPT-2's MLP weights, under its checkpoint's names: ``c_fc`` and ``c_proj``."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c_fc = Conv1D(c.hidden_size, c.intermediate_size)
        self.c_proj = Conv1D(c.intermediate_size, c.hidden_size)


class GPT2Block(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        self.ln_1 = nn.LayerNorm(c.hidden_size, eps=c.norm_eps)
        self.ln_2 = nn.LayerNorm(c.hidden_size, eps=c.norm_eps)
        self.attn = GPT2Attention(c)
        self.mlp = GPT2MLP(c)
        self.act = activation(c.hidden_act)

    def forward(self, x, cache, layer, meta):
        c = self.c
        q, k, v = self.attn.c_attn(self.ln_1(x)).view(-1, 3, c.num_heads, c.head_dim).unbind(1)
        out = paged_attention(q, k, v, cache, layer, meta, c.head_dim**-0.5)
        x = x + self.attn.c_proj(out.reshape(len(x), -1))
        return x + self.mlp.c_proj(self.act(self.mlp.c_fc(self.ln_2(x))))


class GPT2Model(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.wte = nn.Embedding(c.vocab_size, c.hidden_size)
        self.wpe = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.h = nn.ModuleList(GPT2Block(c) for _ in range(c.num_layers))
        self.ln_f = nn.LayerNorm(c.hidden_size, eps=c.norm_eps)


class GPT2LMHeadModel(nn.Module):
    """GPT-2: learned positions, LayerNorm, GELU, tied embeddings."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.config = c
        self.transformer = GPT2Model(c)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, input_ids, positions, cache, meta: AttentionMetadata):
        x = self.transformer.wte(input_ids) + self.transformer.wpe(positions)
        for i, block in enumerate(self.transformer.h):
            x = block(x, cache, i, meta)
        return self.transformer.ln_f(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


CausalLM = LlamaForCausalLM | GPT2LMHeadModel  # what build_model makes: forward, then compute_logits


def build_model(c: ModelConfig) -> CausalLM:
    return GPT2LMHeadModel(c) if c.model_type == "gpt2" else LlamaForCausalLM(c)
