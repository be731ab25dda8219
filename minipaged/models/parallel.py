"""Tensor parallelism, Megatron-LM style, as vLLM runs it: every rank holds a slice of every layer.

A transformer layer splits into ranks with two all-reduces and nothing else (Shoeybi et al., 2019):

* Attention is split **by heads**. ``qkv_proj`` is column-parallel: rank ``r`` holds the rows of
  the weight that compute its query heads and its KV heads, so it computes q, k and v of its heads
  with no communication, writes its KV heads into its own paged cache, and attends over them.
  ``o_proj`` is row-parallel: rank ``r`` holds the columns that read its heads' outputs, so its
  product is a partial sum of the output; an **all-reduce** sums the partial sums on every rank.
* The MLP is split by its intermediate columns: ``gate_up_proj`` column-parallel (the activation
  and the product act column by column, so each rank applies them to its own columns),
  ``down_proj`` row-parallel, then the second **all-reduce**.
* The embedding is split by vocabulary rows: each rank looks up the ids in its slice and gives
  zeros for the others; an all-reduce puts every row together. The ``lm_head`` is split the same
  way: each rank computes the logits of its slice, and an **all-gather** joins them.

Everything else (norms, positions, residuals) is computed whole, the same on every rank.

KV heads follow vLLM's rule. With ``num_kv_heads >= tp`` they are split: rank ``r`` holds
``num_kv_heads // tp`` of them, from ``r * num_kv_heads // tp``. With fewer KV heads than ranks
each is replicated on ``tp // num_kv_heads`` consecutive ranks: rank ``r`` holds KV head
``r // (tp // num_kv_heads)``, the one its query heads read (query head ``h`` reads KV head
``h // (num_heads // num_kv_heads)``). Each rank's ``PagedKVCache`` is therefore
``(num_blocks, block_size, num_kv_heads_per_rank(config, tp), head_dim)`` per layer, under the same
block ids on every rank: one block table serves them all.

How a rank's shard is built (``build_model_shard``): the layers of ``transformer.py`` are built
from the rank's shape (``shard_config``: its query heads, its KV heads, its MLP columns, its
vocabulary rows), so their code, which knows nothing of ranks, runs unchanged on a shard; then
the modules whose weights are split are replaced by the parallel ones below, under the same
names. The alternative, layers that take their linear classes as arguments, would give every
layer of the single-process model a parameter that only tensor parallelism uses; this way
``build_model(config)`` and ``load_model`` stay exactly what they were, and tp = 1 is them.

``load_model_shard`` gives a rank its shard of a Hugging Face checkpoint. From safetensors it
reads only its rows or columns of a split weight (``safe_open(...).get_slice``), never the whole
tensor; a ``.bin`` checkpoint is mapped from the file and sliced. Each parallel layer's
``weight_loader`` says which part of a checkpoint tensor its rank takes, as in vLLM.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from minipaged.models import (
    IGNORED_SUFFIXES,
    PACKED,
    checkpoint_files,
    load_config,
    load_model,
    resolve_dtype,
    resolve_model_path,
)
from minipaged.models.config import ModelConfig
from minipaged.models.transformer import CausalLM, build_model

# ----------------------------------------------------------------------------------------------
# The tensor-parallel group


@dataclasses.dataclass(frozen=True)
class TensorParallelGroup:
    """Which shard this process holds (``rank``) of how many (``world_size``), and the
    ``torch.distributed`` group the shards talk over (``None``: the default process group).

    With ``world_size`` 1 nothing is ever communicated and no process group is needed. Otherwise,
    where ``torch.distributed`` is initialized, ``rank`` and ``world_size`` must be this process's
    in the group; where it is not, the group can still say which shard to build and load (a
    collective then fails, saying that no process group was initialized).
    """

    rank: int = 0
    world_size: int = 1
    process_group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {self.world_size!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in 0 .. {self.world_size - 1}, got {self.rank!r}")
        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            actual = dist.get_rank(self.process_group), dist.get_world_size(self.process_group)
            if actual != (self.rank, self.world_size):
                raise ValueError(f"rank {self.rank} of {self.world_size} does not match the process group, "
                                 f"where this process is rank {actual[0]} of {actual[1]}")

    @classmethod
    def from_process_group(cls, process_group: dist.ProcessGroup | None = None) -> TensorParallelGroup:
        """This process's place in ``process_group`` (the default one if None); rank 0 of 1 without one."""
        return cls(get_tensor_model_parallel_rank(process_group),
                   get_tensor_model_parallel_world_size(process_group), process_group)


def get_tensor_model_parallel_world_size(process_group: dist.ProcessGroup | None = None) -> int:
    """The number of ranks in ``process_group`` (the default one if None); 1 without torch.distributed."""
    return dist.get_world_size(process_group) if dist.is_available() and dist.is_initialized() else 1


def get_tensor_model_parallel_rank(process_group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in ``process_group`` (the default one if None); 0 without torch.distributed."""
    return dist.get_rank(process_group) if dist.is_available() and dist.is_initialized() else 0


def tensor_model_parallel_all_reduce(x: torch.Tensor, tp: TensorParallelGroup | None = None) -> torch.Tensor:
    """The sum of ``x`` over the ranks of ``tp`` (the default process group if None), on every rank.

    In place where there are several ranks; ``x`` itself with one.
    """
    tp = TensorParallelGroup.from_process_group() if tp is None else tp
    if tp.world_size == 1:
        return x
    dist.all_reduce(x, group=tp.process_group)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, tp: TensorParallelGroup | None = None,
                                     dim: int = -1) -> torch.Tensor:
    """Every rank's ``x`` (all of one shape), concatenated along ``dim`` in rank order, on every rank."""
    tp = TensorParallelGroup.from_process_group() if tp is None else tp
    if tp.world_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp.world_size)]
    dist.all_gather(parts, x, group=tp.process_group)
    return torch.cat(parts, dim=dim)


# ----------------------------------------------------------------------------------------------
# How a model splits


def check_tensor_parallel(config: ModelConfig, tp: int) -> None:
    """``ValueError`` unless ``tp`` ranks can split the model: its query heads and its MLP columns
    evenly, and its KV heads evenly (``num_kv_heads % tp``) or, with fewer KV heads than ranks, each
    KV head over the same number of ranks (``tp % num_kv_heads``)."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
    if config.num_heads % tp:
        raise ValueError(f"num_heads ({config.num_heads}) must be divisible by tensor_parallel_size ({tp})")
    if config.intermediate_size % tp:
        raise ValueError(f"intermediate_size ({config.intermediate_size}) must be divisible by "
                         f"tensor_parallel_size ({tp})")
    if config.num_kv_heads < tp and tp % config.num_kv_heads:
        raise ValueError(f"tensor_parallel_size ({tp}) must be a multiple of num_kv_heads ({config.num_kv_heads}) "
                         "when it is larger, so that each KV head is replicated on as many ranks")
    if config.num_kv_heads >= tp and config.num_kv_heads % tp:
        raise ValueError(f"num_kv_heads ({config.num_kv_heads}) must be divisible by tensor_parallel_size ({tp})")


def num_kv_heads_per_rank(config: ModelConfig, tp: int) -> int:
    """The KV heads each rank holds, and its ``PagedKVCache``'s ``num_kv_heads``: split, or 1 if replicated."""
    check_tensor_parallel(config, tp)
    return max(1, config.num_kv_heads // tp)


def kv_heads_of_rank(config: ModelConfig, rank: int, tp: int) -> range:
    """The KV heads (of ``0 .. num_kv_heads - 1``) that rank ``rank`` holds, in its cache's order.

    Split: ``num_kv_heads // tp`` heads from ``rank * num_kv_heads // tp``. Replicated (fewer KV
    heads than ranks): the one head ``rank // (tp // num_kv_heads)``.
    """
    per_rank = num_kv_heads_per_rank(config, tp)
    if not 0 <= rank < tp:
        raise ValueError(f"rank must be in 0 .. {tp - 1}, got {rank!r}")
    replicas = max(1, tp // config.num_kv_heads)  # ranks that hold the same KV heads
    first = rank // replicas * per_rank
    return range(first, first + per_rank)


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of ``tp``, so that every rank gets as many rows."""
    return -(-vocab_size // tp) * tp


def shard_config(config: ModelConfig, tp: int) -> ModelConfig:
    """The shape one rank's layers see: ``num_heads // tp`` query heads, its KV heads, ``intermediate_size
    // tp`` MLP columns, ``padded_vocab_size // tp`` vocabulary rows; everything else unchanged.
    Its ``kv_bytes_per_token`` is what one token's K/V take on one rank."""
    check_tensor_parallel(config, tp)
    return dataclasses.replace(config, num_heads=config.num_heads // tp, num_kv_heads=num_kv_heads_per_rank(config, tp),
                               intermediate_size=config.intermediate_size // tp,
                               vocab_size=padded_vocab_size(config.vocab_size, tp) // tp)


# ----------------------------------------------------------------------------------------------
# The parallel layers. Weights are stored (out_features, in_features), as nn.Linear stores them; a layer
# built without a tp_group is the one rank of one, the plain layer, which never communicates.


class CheckpointTensor:
    """One tensor of a checkpoint, read in parts: a safetensors slice (only the bytes of the part are
    read) or a tensor (a ``.bin`` mapped from its file). ``transposed``: the file stores it
    (in_features, out_features), as GPT-2's Conv1D does; ``shape`` and ``narrow`` speak of the
    (out_features, in_features) tensor all the same."""

    def __init__(self, source: Any, transposed: bool = False) -> None:
        self.source, self.transposed = source, transposed

    @property
    def shape(self) -> tuple[int, ...]:
        stored = tuple(self.source.get_shape() if hasattr(self.source, "get_shape") else self.source.shape)
        return stored[::-1] if self.transposed else stored

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Indices ``start .. start + length - 1`` along ``dim``, every index along the others."""
        stored_dim = len(self.shape) - 1 - dim if self.transposed else dim
        part = self.source[(slice(None),) * stored_dim + (slice(start, start + length),)]
        return part.t() if self.transposed else part

    def read(self) -> torch.Tensor:
        """The whole tensor."""
        whole = self.source[:]
        return whole.t() if self.transposed else whole


def copy_weight(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[...] = src``, refusing a shape that differs (``copy_`` would broadcast it)."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"a checkpoint tensor of shape {tuple(src.shape)} does not fit {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)


def default_weight_loader(param: torch.Tensor, loaded_weight: CheckpointTensor) -> None:
    """A weight that is not split: every rank holds it whole."""
    copy_weight(param, loaded_weight.read())


def _single(tp_group: TensorParallelGroup | None) -> TensorParallelGroup:
    return TensorParallelGroup() if tp_group is None else tp_group


def _divide(total: int, tp: int, what: str) -> int:
    if total % tp:
        raise ValueError(f"{what} ({total}) must be divisible by tensor_parallel_size ({tp})")
    return total // tp


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` split by output rows: rank ``r`` holds rows ``r * n .. (r + 1) * n - 1``,
    ``n = output_size // tp``, and the same slice of the bias, and computes those outputs. No communication:
    the output stays split, which is what a row-parallel layer after it reads.

    weight: ``(output_size // tp, input_size)``; x: ``(num_tokens, input_size)`` -> ``(num_tokens, output_size // tp)``.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 tp_group: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.tp_group = _single(tp_group)
        self.tp_rank, self.tp_size = self.tp_group.rank, self.tp_group.world_size
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = _divide(output_size, self.tp_size, "output_size")
        self.weight = nn.Parameter(torch.zeros(self.output_size_per_partition, input_size))
        self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def weight_loader(self, param: torch.Tensor, loaded_weight: CheckpointTensor) -> None:
        """The weight's (and the bias's) rows of this rank."""
        n = self.output_size_per_partition
        copy_weight(param, loaded_weight.narrow(0, self.tp_rank * n, n))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one matmul (``gate_up_proj``: gate, then up).
    Each is split on its own, so that a rank holds the same columns of each: its slice of the gate
    rows, then its slice of the up rows.

    weight: ``(sum(output_sizes) // tp, input_size)``, the shards one after the other.
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = True,
                 tp_group: TensorParallelGroup | None = None) -> None:
        tp = _single(tp_group).world_size
        for size in output_sizes:
            _divide(size, tp, "each output size")
        super().__init__(input_size, sum(output_sizes), bias, tp_group)
        self.output_sizes = list(output_sizes)
        self.shard_ids = tuple(range(len(output_sizes)))

    def weight_loader(self, param: torch.Tensor, loaded_weight: CheckpointTensor,  # type: ignore[override]
                      loaded_shard_id: int) -> None:
        """Projection ``loaded_shard_id``'s rows of this rank (the checkpoint stores each apart: gate_proj, up_proj)."""
        n = self.output_sizes[loaded_shard_id] // self.tp_size
        offset = sum(self.output_sizes[:loaded_shard_id]) // self.tp_size  # where the shard starts in param
        copy_weight(param.narrow(0, offset, n), loaded_weight.narrow(0, self.tp_rank * n, n))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v of a rank's heads in one matmul (``qkv_proj``): its ``total_num_heads // tp`` query heads,
    then its KV heads' k, then their v (``kv_heads_of_rank``: split when there are at least as many KV
    heads as ranks, else one, replicated on ``tp // total_num_kv_heads`` ranks).

    weight: ``((num_heads + 2 * num_kv_heads) * head_size, hidden_size)`` with the rank's counts.
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = True, tp_group: TensorParallelGroup | None = None) -> None:
        tp = _single(tp_group).world_size
        num_heads = _divide(total_num_heads, tp, "num_heads")
        if total_num_kv_heads >= tp:
            num_kv_heads = _divide(total_num_kv_heads, tp, "num_kv_heads")
        elif tp % total_num_kv_heads:
            raise ValueError(f"tensor_parallel_size ({tp}) must be a multiple of num_kv_heads ({total_num_kv_heads})")
        else:
            num_kv_heads = 1  # each KV head replicated on tp // total_num_kv_heads ranks
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_size * tp, bias, tp_group)
        self.head_size, self.total_num_heads, self.total_num_kv_heads = head_size, total_num_heads, total_num_kv_heads
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.num_kv_head_replicas = max(1, tp // total_num_kv_heads)  # ranks that hold the same KV heads
        self.shard_ids = ("q", "k", "v")

    def shard_rows(self, shard_id: str) -> tuple[int, int, int]:
        """For q, k or v: where its rows start in this rank's weight, how many, and where they start in
        the checkpoint's q_proj, k_proj or v_proj."""
        d = self.head_size
        if shard_id == "q":
            return 0, self.num_heads * d, self.tp_rank * self.num_heads * d
        first_kv_head = self.tp_rank // self.num_kv_head_replicas * self.num_kv_heads
        offset = (self.num_heads if shard_id == "k" else self.num_heads + self.num_kv_heads) * d
        return offset, self.num_kv_heads * d, first_kv_head * d

    def weight_loader(self, param: torch.Tensor, loaded_weight: CheckpointTensor,  # type: ignore[override]
                      loaded_shard_id: str | None = None) -> None:
        """This rank's rows of q_proj, k_proj or v_proj (``loaded_shard_id`` "q", "k", "v"); or, with
        None, of a checkpoint tensor that holds all of q, then k, then v (GPT-2's ``c_attn``)."""
        if loaded_shard_id is None:
            d = self.head_size
            starts = {"q": 0, "k": self.total_num_heads * d, "v": (self.total_num_heads + self.total_num_kv_heads) * d}
            for shard_id, start in starts.items():
                offset, n, first = self.shard_rows(shard_id)
                copy_weight(param.narrow(0, offset, n), loaded_weight.narrow(0, start + first, n))
            return
        offset, n, first = self.shard_rows(loaded_shard_id)
        copy_weight(param.narrow(0, offset, n), loaded_weight.narrow(0, first, n))


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` split by input columns: rank ``r`` holds the columns that read its part of
    ``x`` (the split output of a column-parallel layer: its heads, its MLP columns). Its product is a partial
    sum of ``y``; an all-reduce sums the partial sums, and the bias, held whole by every rank, is added
    once, after the reduce.

    weight: ``(output_size, input_size // tp)``; x: ``(num_tokens, input_size // tp)`` -> ``(num_tokens, output_size)``.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 tp_group: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.tp_group = _single(tp_group)
        self.tp_rank, self.tp_size = self.tp_group.rank, self.tp_group.world_size
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = _divide(input_size, self.tp_size, "input_size")
        self.weight = nn.Parameter(torch.zeros(output_size, self.input_size_per_partition))
        self.bias = nn.Parameter(torch.zeros(output_size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)  # (num_tokens, output_size): this rank's terms of each sum
        out = tensor_model_parallel_all_reduce(partial, self.tp_group)
        return out if self.bias is None else out + self.bias

    def weight_loader(self, param: torch.Tensor, loaded_weight: CheckpointTensor) -> None:
        """The weight's columns of this rank; the bias whole."""
        if param is self.bias:
            copy_weight(param, loaded_weight.read())
            return
        n = self.input_size_per_partition
        copy_weight(param, loaded_weight.narrow(1, self.tp_rank * n, n))


class VocabParallelEmbedding(nn.Module):
    """An embedding split by vocabulary rows. The vocabulary is padded to a multiple of tp; rank ``r``
    holds rows ``vocab_start_index .. vocab_end_index - 1`` (and zero rows for the padding, which
    no id reaches). An id outside the rank's slice gives zeros; the all-reduce adds them up, so every
    token gets its one row, on every rank.

    weight: ``(padded_vocab_size // tp, embedding_dim)``; ids ``(num_tokens,)`` -> ``(num_tokens, embedding_dim)``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_group: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.tp_group = _single(tp_group)
        self.tp_rank, self.tp_size = self.tp_group.rank, self.tp_group.world_size
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.num_embeddings_padded = padded_vocab_size(num_embeddings, self.tp_size)
        self.num_embeddings_per_partition = self.num_embeddings_padded // self.tp_size
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = min(self.vocab_start_index + self.num_embeddings_per_partition, num_embeddings)
        self.weight = nn.Parameter(torch.zeros(self.num_embeddings_per_partition, embedding_dim))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
        rows = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return tensor_model_parallel_all_reduce(rows, self.tp_group)

    def weight_loader(self, param: torch.Tensor, loaded_weight: CheckpointTensor) -> None:
        """The vocabulary rows of this rank; zeros in the padding."""
        n = max(0, self.vocab_end_index - self.vocab_start_index)
        with torch.no_grad():
            param[n:].zero_()
        if n:
            copy_weight(param[:n], loaded_weight.narrow(0, self.vocab_start_index, n))


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, split by vocabulary rows as the embedding is (so that tied weights are the
    same shard). Each rank computes the logits of its slice; an all-gather joins them in rank order,
    and the padding is cut off: every rank gets the whole ``(num_tokens, vocab_size)``.

    Calling it computes logits (``compute_logits`` calls ``lm_head(hidden)``), not an embedding.
    """

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        local = F.linear(hidden, self.weight)  # (num_tokens, padded_vocab_size // tp)
        logits = tensor_model_parallel_all_gather(local, self.tp_group, dim=-1)  # (num_tokens, padded_vocab_size)
        return logits[..., : self.num_embeddings]


# ----------------------------------------------------------------------------------------------
# A rank's shard of a model, and of a checkpoint


def replace_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` where ``model`` has the submodule ``name`` (e.g. ``model.layers.0.self_attn.o_proj``)."""
    parent, _, child = name.rpartition(".")
    model.get_submodule(parent).register_module(child, module)


def build_model_shard(config: ModelConfig, tp_group: TensorParallelGroup | None = None) -> CausalLM:
    """Rank ``tp_group.rank``'s shard of the model: ``build_model(config)`` itself for one rank; else the
    layers built from ``shard_config`` (the rank's heads, MLP columns and vocabulary rows), with the split
    modules replaced by their parallel versions under the same names. Its ``config`` is the whole
    model's, as ``load_model`` gives; each layer's is the rank's."""
    tp = _single(tp_group)
    check_tensor_parallel(config, tp.world_size)
    if tp.world_size == 1:
        return build_model(config)
    model = build_model(shard_config(config, tp.world_size))
    c, h, d = config, config.hidden_size, config.head_dim
    embed = VocabParallelEmbedding(c.vocab_size, h, tp)
    if c.model_type == "gpt2":
        embed_name, layers = "transformer.wte", "transformer.h"
        split = {  # a layer's split modules, by their names in the checkpoint
            "attn.c_attn": lambda: QKVParallelLinear(h, d, c.num_heads, c.num_kv_heads, True, tp),
            "attn.c_proj": lambda: RowParallelLinear(c.num_heads * d, h, True, tp),
            "mlp.c_fc": lambda: ColumnParallelLinear(h, c.intermediate_size, True, tp),
            "mlp.c_proj": lambda: RowParallelLinear(c.intermediate_size, h, True, tp),
        }
    else:
        embed_name, layers = "model.embed_tokens", "model.layers"
        split = {
            "self_attn.qkv_proj": lambda: QKVParallelLinear(h, d, c.num_heads, c.num_kv_heads, c.qkv_bias, tp),
            "self_attn.o_proj": lambda: RowParallelLinear(c.num_heads * d, h, c.o_bias, tp),
            "mlp.gate_up_proj": lambda: MergedColumnParallelLinear(h, [c.intermediate_size] * 2, c.mlp_bias, tp),
            "mlp.down_proj": lambda: RowParallelLinear(c.intermediate_size, h, c.mlp_bias, tp),
        }
    replace_module(model, embed_name, embed)
    for i in range(c.num_layers):
        for name, make in split.items():
            replace_module(model, f"{layers}.{i}.{name}", make())
    replace_module(model, "lm_head", ParallelLMHead(c.vocab_size, h, tp))
    if c.model_type == "gpt2" or c.tie_word_embeddings:
        model.lm_head.weight = embed.weight
    model.config = config
    return model


CONV1D_WEIGHTS = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")  # GPT-2 stores them (in, out)


@contextmanager
def open_checkpoint(path: Path) -> Iterator[dict[str, Any]]:
    """Every tensor of a checkpoint folder by name, not yet read: safetensors slices, or, for ``.bin``
    files, tensors mapped from the file. They can be read while the context is open."""
    with ExitStack() as stack:
        tensors: dict[str, Any] = {}
        for file in checkpoint_files(path):
            if file.suffix == ".safetensors":
                f = stack.enter_context(safe_open(str(file), framework="pt"))
                tensors.update((name, f.get_slice(name)) for name in f.keys())
            else:
                tensors.update(torch.load(file, map_location="cpu", weights_only=True, mmap=True))
        yield tensors


def fused_name(name: str) -> tuple[str, str | int | None]:
    """A checkpoint name's module parameter, and which shard of a fused one it is:
    ``...q_proj.weight`` -> (``...qkv_proj.weight``, "q"), ``...up_proj.bias`` -> (``...gate_up_proj.bias``, 1)."""
    for fused, parts in PACKED.items():
        for i, part in enumerate(parts):
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused}."), ("q", "k", "v")[i] if fused == "qkv_proj" else i
    return name, None


def load_model_shard(model: str | Path, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
                     rank: int = 0, world_size: int = 1,
                     process_group: dist.ProcessGroup | None = None) -> tuple[CausalLM, ModelConfig]:
    """Rank ``rank``'s shard of a local Hugging Face model, in eval mode: ``(module, ModelConfig)``,
    the config being the whole model's. With ``world_size`` 1 this is ``load_model``.

    Divisibility is checked before anything is built or read; then each checkpoint tensor goes to its
    parameter's ``weight_loader``, which reads only this rank's part of it. ``process_group``: the
    group the ranks talk over in the forward pass (the default process group if None).
    """
    path = resolve_model_path(model)
    config = load_config(path)
    check_tensor_parallel(config, world_size)
    if world_size == 1:
        return load_model(path, dtype, device)
    tp = TensorParallelGroup(rank, world_size, process_group)
    module = build_model_shard(config, tp)
    params = dict(module.named_parameters())  # a tied lm_head.weight is named once, as the embedding
    prefix = "transformer." if config.model_type == "gpt2" else "model."
    tied = config.model_type == "gpt2" or config.tie_word_embeddings
    loaded: dict[str, set] = defaultdict(set)  # parameter -> the shards of it loaded
    unexpected = []
    with open_checkpoint(path) as tensors:
        names = [k for k in tensors if not k.endswith(IGNORED_SUFFIXES)]
        add_prefix = not any(k.startswith(prefix) for k in names)  # some checkpoints drop the outer prefix
        for name in names:
            full = prefix + name if add_prefix and not name.startswith("lm_head") else name
            if tied and full == "lm_head.weight":
                continue
            target, shard_id = fused_name(full)
            if target not in params:
                unexpected.append(name)
                continue
            owner = module.get_submodule(target.rpartition(".")[0])
            weight_loader: Callable[..., None] = getattr(owner, "weight_loader", default_weight_loader)
            tensor = CheckpointTensor(tensors[name], transposed=config.model_type == "gpt2"
                                      and full.endswith(CONV1D_WEIGHTS))
            try:
                if shard_id is None:
                    weight_loader(params[target], tensor)
                else:
                    weight_loader(params[target], tensor, shard_id)
            except ValueError as e:
                raise ValueError(f"{path}: {name}: {e}") from None
            loaded[target].add(shard_id)

    def complete(name: str) -> bool:  # whole, or every shard of a fused parameter
        owner = module.get_submodule(name.rpartition(".")[0])
        return loaded[name] in ({None}, set(getattr(owner, "shard_ids", ())))

    missing = [k for k in params if not complete(k)]
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match {config.model_type}: missing "
                         f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    module = module.to(device=device, dtype=resolve_dtype(dtype)).eval()
    if hasattr(module, "inv_freq"):  # RoPE frequencies stay float32, as in transformers
        module.inv_freq = config.inv_freq().to(device)
    return module, config


__all__ = [
    "CheckpointTensor", "ColumnParallelLinear", "MergedColumnParallelLinear", "ParallelLMHead", "QKVParallelLinear",
    "RowParallelLinear", "TensorParallelGroup", "VocabParallelEmbedding", "build_model_shard",
    "check_tensor_parallel", "default_weight_loader", "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size", "kv_heads_of_rank", "load_model_shard", "num_kv_heads_per_rank",
    "open_checkpoint", "padded_vocab_size", "shard_config", "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
]
