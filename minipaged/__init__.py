"""minipaged: vLLM's PagedAttention, built in small graded stages.

Each stage adds one idea, checked against the stage below it, in its module
``minipaged/stageN_<topic>.py`` (or more, where the idea has parts: stage 6's scheduler and its
swapping, stage 7's engine and its runner, stage 10's scheduler, its messages, its runner and its
async stepping). ``minipaged.LLM`` (``minipaged/llm.py``) builds an engine of them, its parts
chosen by its configuration.
"""

from collections.abc import Callable

import torch

from minipaged.common.config import EngineConfig
from minipaged.common.sampling_params import CompletionOutput, RequestOutput, RequestOutputKind, SamplingParams
from minipaged.common.sequence import Sequence, SequenceGroup, SequenceStatus
from minipaged.llm import LLM  # the engine, its parts chosen by its EngineConfig (every stage's)
from minipaged.stage0_contiguous import (
    POLICIES,
    CacheUsage,
    ContiguousKVCache,
    OutOfSlotsError,
    Slab,
    UnknownRequestError,
    dense_attention,
)
from minipaged.stage1_block_allocator import BlockAllocator, OutOfBlocksError
from minipaged.stage2_block_table import BlockSpaceManager, BlockTable, PagedKVCache
from minipaged.stage3_copy_on_write import (
    CowBlockSpaceManager,
    CowPagedKVCache,
    RefCountedBlockAllocator,
)
from minipaged.stage4_reference_attention import check_paged_attention_args, paged_attention_ref
from minipaged.stage6_scheduler import Scheduler, SchedulerOutputs
from minipaged.stage6_swapping import SwapBlockSpaceManager, SwapPagedKVCache
from minipaged.stage7_engine import LLMEngine
from minipaged.stage7_model_runner import ModelRunner, Sampler
from minipaged.stage8_sharing import (
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
    SharingEngine,
)
from minipaged.stage9_prefix_caching import PrefixCachingAllocator, PrefixCachingBlockSpaceManager

paged_attention_triton: Callable[..., torch.Tensor] | None
try:  # Triton installs on Linux x86_64; elsewhere stage 5 is absent and stage 4 serves
    from minipaged.stage5_triton_attention import paged_attention_triton
except ImportError:  # pragma: no cover
    paged_attention_triton = None

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "EngineConfig",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "RequestOutput",
    "SamplingParams",
    "LLMEngine",
    "ModelRunner",
    "PrefixCachingAllocator",
    "PrefixCachingBlockSpaceManager",
    "Sampler",
    "RequestOutputKind",
    "Scheduler",
    "SchedulerOutputs",
    "Sequence",
    "SequenceGroup",
    "SequenceStatus",
    "SharingEngine",
    "SwapBlockSpaceManager",
    "SwapPagedKVCache",
    "POLICIES",
    "BlockAllocator",
    "BlockSpaceManager",
    "BlockTable",
    "CacheUsage",
    "ContiguousKVCache",
    "CowBlockSpaceManager",
    "CowPagedKVCache",
    "OutOfBlocksError",
    "OutOfSlotsError",
    "PagedKVCache",
    "RefCountedBlockAllocator",
    "Slab",
    "UnknownRequestError",
    "check_paged_attention_args",
    "dense_attention",
    "paged_attention_ref",
    "paged_attention_triton",
]
