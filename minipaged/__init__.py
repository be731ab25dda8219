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

__version__ = "0.1.0"

__all__ = [
    "POLICIES",
    "CacheUsage",
    "ContiguousKVCache",
    "OutOfSlotsError",
    "Slab",
    "UnknownRequestError",
    "dense_attention",
]
