"""Host data to the device without waiting for it.

A plain copy from ordinary (pageable) host memory to a GPU is made synchronous by CUDA: the host
waits until every kernel queued before it has run. A step that copies its inputs after its forward
has been queued would then stop feeding the device. Copied from pinned (page-locked) memory with
``non_blocking=True``, the copy is queued like a kernel and the host goes on, as vLLM's runner
copies its persistent CPU buffers. On a CPU this is an ordinary tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(data: np.ndarray | Sequence, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``data`` (a numpy array or a list, on the host) as a tensor on ``device``, queued, not waited for."""
    host = torch.as_tensor(np.ascontiguousarray(data) if isinstance(data, np.ndarray) else data, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


__all__ = ["to_device"]
