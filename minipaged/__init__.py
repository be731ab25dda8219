"""minipaged: vLLM's PagedAttention, built in small graded stages.

Each stage is one module, ``minipaged/stageN_<topic>.py``, that adds one idea and is
checked against the stage below it.
"""

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

__version__ = "0.1.0"

__all__ = [
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
    "dense_attention",
]
