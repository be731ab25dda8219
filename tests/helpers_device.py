"""Proving the GPU path on a CPU: where the host waits for the device, and where host and device mix.

* ``count_host_syncs`` counts the calls that read a tensor's values back to the host
  (``item``, ``tolist``, ``bool``/``int``/``float``/``index``, ``cpu``, ``numpy``, ``.to("cpu")``)
  made from minipaged's own code. On a GPU each one waits until every kernel queued before it
  has run, so the host stops feeding the device. Counted on the CPU, the same calls are made.
  On the CPU every tensor is a host tensor, so one kind is told apart: a tensor over a numpy
  array's memory (``torch.from_numpy``) is host memory on any machine, and reading it outside
  the forward is not a sync (inside the forward, every read counts).
* ``fake_cuda`` runs code on ``device="cuda"`` tensors without a GPU: ``FakeTensorMode``
  gives tensors a device and a shape but no data, raises ``FakeTensorDeviceMismatchError``
  when a host tensor meets a device one, and ``DataDependentOutputException`` when the host
  reads a value (a host sync). A CPU build of torch cannot index such a tensor from Python
  (its device guard has no CUDA), so indexing and ``.to(device)`` are passed to the same ATen
  ops directly; ``torch.Generator(device="cuda")`` cannot be made either, so ``fake_cuda_generator``
  stands in for one, and a draw checks that its generator is on the tensor's device. The host's
  work on host tensors (no fake tensor among its arguments, no device asked for) runs for real.
"""

from __future__ import annotations

import contextlib
import os
import traceback
import weakref
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

import minipaged

PACKAGE = os.path.dirname(minipaged.__file__)
TORCH = os.path.dirname(torch.__file__)
READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")


@dataclass
class SyncCount:
    """Host syncs made from minipaged's code: all of them, and those made inside ``forward``."""

    calls: Counter = field(default_factory=Counter)  # "file:line method" -> count
    in_forward: Counter = field(default_factory=Counter)
    host_reads: Counter = field(default_factory=Counter)  # of numpy-backed tensors, outside the forward
    forward_depth: int = 0

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    @property
    def forward(self) -> int:
        return sum(self.in_forward.values())


def _caller() -> str | None:
    """``file:line`` of the first frame outside torch and this file, if it is minipaged's."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename.startswith(TORCH) or frame.filename == __file__:
            continue
        if frame.filename.startswith(PACKAGE):
            return f"{os.path.relpath(frame.filename, PACKAGE)}:{frame.lineno}"
        return None
    return None


@contextlib.contextmanager
def count_host_syncs(model: torch.nn.Module | None = None) -> Iterator[SyncCount]:
    """Count host syncs from minipaged's code while the block runs; with ``model``, also those made
    while its ``forward`` runs (every layer, the cache writes and the attention backend)."""
    count = SyncCount()
    originals = {name: getattr(torch.Tensor, name) for name in (*READS, "to")}
    from_numpy = torch.from_numpy
    numpy_backed: dict[int, weakref.ref] = {}  # id -> the tensor, while it lives (its memory is not reused)

    def record(tensor: torch.Tensor, name: str) -> None:
        where = _caller()
        if where is None:
            return
        if not count.forward_depth and any(t is not None and id(t) in numpy_backed and numpy_backed[id(t)]() is t
                                           for t in (tensor, tensor._base)):
            count.host_reads[f"{where} {name}"] += 1
            return
        count.calls[f"{where} {name}"] += 1
        if count.forward_depth:
            count.in_forward[f"{where} {name}"] += 1

    def wrap(name):
        original = originals[name]

        def counted(self, *args, **kwargs):
            if name != "to" or _to_host(self, args, kwargs):
                record(self, name)
            return original(self, *args, **kwargs)
        return counted

    def host_tensor(array):
        tensor = from_numpy(array)
        numpy_backed[id(tensor)] = weakref.ref(tensor)
        return tensor

    for name in originals:
        setattr(torch.Tensor, name, wrap(name))
    torch.from_numpy = host_tensor
    forward = model.forward if model is not None else None
    if model is not None:
        def counted_forward(*args, **kwargs):
            count.forward_depth += 1
            try:
                return forward(*args, **kwargs)
            finally:
                count.forward_depth -= 1
        model.forward = counted_forward
    try:
        yield count
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        torch.from_numpy = from_numpy
        if model is not None:
            del model.forward


def _to_host(tensor: torch.Tensor, args, kwargs) -> bool:
    """Whether ``tensor.to(*args, **kwargs)`` copies a device tensor's values to the host."""
    target = kwargs.get("device", args[0] if args else None)
    if isinstance(target, torch.Tensor):
        target = target.device
    if not isinstance(target, str | torch.device):
        return False
    return torch.device(target).type == "cpu" and tensor.device.type != "cpu"


# The generators that stand in for CUDA ones. Held weakly, by the object: an id would outlive its generator,
# and a plain CPU generator made later at the same address would pass for one on CUDA.
_ON_CUDA: weakref.WeakSet[torch.Generator] = weakref.WeakSet()


def fake_cuda_generator(seed: int = 0) -> torch.Generator:
    """A generator that ``fake_cuda``'s draws take for one on CUDA (a CPU build cannot make one)."""
    generator = torch.Generator().manual_seed(seed)
    _ON_CUDA.add(generator)
    return generator


def _generator_device(generator: torch.Generator) -> torch.device:
    return torch.device("cuda", 0) if generator in _ON_CUDA else torch.device(generator.device)


def _split_index(t: torch.Tensor, key) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Apply the basic parts of a Python index (ints, slices, None, ...) as ATen ops; return the
    tensor parts by the dimension they index."""
    key = key if isinstance(key, tuple) else (key,)
    if any(k is Ellipsis for k in key):
        i = key.index(Ellipsis)
        rest = t.dim() - sum(1 for k in key if k is not None and k is not Ellipsis)
        key = key[:i] + (slice(None),) * rest + key[i + 1:]
    dim, advanced = 0, {}
    for k in key:
        if k is None:
            t = torch.ops.aten.unsqueeze(t, dim)
            dim += 1
        elif isinstance(k, int) and not isinstance(k, bool):
            t = torch.ops.aten.select(t, dim, k)
        elif isinstance(k, slice):
            t = torch.ops.aten.slice(t, dim, k.start, k.stop, k.step or 1)
            dim += 1
        else:
            advanced[dim] = k if isinstance(k, torch.Tensor) else torch.tensor(k, device=t.device)
            dim += 1
    return t, advanced


def _index_list(advanced: dict[int, torch.Tensor]) -> list[torch.Tensor | None]:
    return [advanced.get(d) for d in range(max(advanced) + 1)]


def _on_the_host(args, kwargs) -> bool:
    """No fake tensor among the arguments and no device asked for: host tensors, host work."""
    tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    device = kwargs.get("device")
    return (not any(isinstance(t, FakeTensor) for t in tensors)
            and (device is None or torch.device(device).type == "cpu"))


_SCALAR_READS = (torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
                 torch.Tensor.__index__)


class _AtenIndexing(TorchFunctionMode):
    """Python indexing, ``.to`` and seeded draws on fake CUDA tensors, through ATen (the module's docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.pin_memory:  # page-locked host memory, which a CPU build cannot give
            return args[0]
        if func is not torch.Tensor.to and _on_the_host(args, kwargs):  # the host's work on host tensors: real
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        if func is torch.Tensor.__getitem__:
            t, advanced = _split_index(*args)
            return torch.ops.aten.index.Tensor(t, _index_list(advanced)) if advanced else t
        if func is torch.Tensor.__setitem__:
            t, key, value = args
            view, advanced = _split_index(t, key)
            if not isinstance(value, torch.Tensor):
                value = torch.full((), value, dtype=t.dtype, device=t.device)
            if advanced:
                torch.ops.aten.index_put_(view, _index_list(advanced), value)
            else:
                torch.ops.aten.copy_(view, value.expand_as(view))
            return None
        if func is torch.Tensor.to:
            t, rest = args[0], args[1:]
            device = kwargs.pop("device", None)
            dtype = kwargs.pop("dtype", None)
            for a in rest:
                if isinstance(a, torch.dtype):
                    dtype = a
                elif isinstance(a, str | torch.device):
                    device = torch.device(a)
            if (device is None or torch.device(device) == t.device) and (dtype is None or dtype == t.dtype):
                return t
            return torch.ops.aten._to_copy(t, dtype=dtype, device=device, non_blocking=kwargs.get("non_blocking",
                                                                                                    False))
        if func in _SCALAR_READS and args[0].device.type == "cuda":  # a host sync: raises, as .tolist() does
            return torch.ops.aten._local_scalar_dense.default(args[0])
        if func is torch.tensor and torch.device(kwargs.get("device") or "cpu").type == "cuda":
            # data from the host, copied (a CPU build cannot make it on CUDA at once under inference mode)
            device = kwargs.pop("device")
            return torch.ops.aten._to_copy(func(*args, **kwargs), device=torch.device(device))
        if kwargs.get("generator") is not None:  # a draw: its generator must be on the tensor's device
            generator = kwargs.pop("generator")
            device = args[0].device if func is torch.Tensor.exponential_ else torch.device(kwargs.get("device", "cpu"))
            if _generator_device(generator) != device:  # what CUDA itself refuses
                raise RuntimeError(f"a generator on {_generator_device(generator)} for a tensor on {device}")
            if func is torch.Tensor.exponential_:
                return func(*args, **kwargs)
            kwargs.pop("device", None)  # a factory (torch.rand): drawn on the host, then copied, as above
            return torch.ops.aten._to_copy(func(*args, **kwargs), device=device)
        return func(*args, **kwargs)


@contextlib.contextmanager
def fake_cuda() -> Iterator[FakeTensorMode]:
    """``device="cuda"`` tensors on a CPU build, raising on a host/device mix and on a host sync."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    from_numpy = torch.from_numpy

    def host_from_numpy(array):  # a numpy array is host memory: its tensor stays real
        with unset_fake_temporarily():
            return from_numpy(array)

    torch.from_numpy = host_from_numpy
    try:
        with mode, _AtenIndexing():
            yield mode
    finally:
        torch.from_numpy = from_numpy


def fake_cuda_module(module: torch.nn.Module, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Fake CUDA stand-ins for ``module``'s parameters and buffers, for ``torch.func.functional_call``
    (call inside ``fake_cuda``)."""
    tensors = {**dict(module.named_parameters(remove_duplicate=False)), **dict(module.named_buffers())}
    return {name: torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device="cuda")
            for name, t in tensors.items()}


__all__ = ["fake_cuda_generator", "SyncCount", "count_host_syncs", "fake_cuda", "fake_cuda_module"]
