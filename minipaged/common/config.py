"""One engine configuration, checked once where it is made, as vLLM's ``VllmConfig`` and
nano-vllm's ``Config`` are (with the checks every component shares, ``minipaged.common.checks``).

``LLM(...)`` turns its arguments into an ``EngineConfig``: a wrong type or value is a
``ValueError`` before any weight is read. ``resolve(model_config)`` then fills in what
depends on the model (how many blocks fit ``kv_cache_memory``, the longest sequence, the
swap space) and refuses what the model cannot serve. The components are given the numbers
they need from it; none of them reads an argument of ``LLM`` itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TypeVar

import torch

from minipaged.common.checks import check_choice, check_float, check_int
from minipaged.models import ModelConfig, resolve_dtype

PREEMPTION_MODES = ("recompute", "swap")
SCHEDULERS = ("v0", "v1")  # the paper's (stage 6), or vLLM V1's (stage 10)
FIRST_STAGE, LAST_STAGE = 7, 15  # the ladder's engines: stage 7 serves text, stage 15 is the top
V1_MAX_NUM_BATCHED_TOKENS = 2048  # V1's token budget per step when none is given
ATTENTION_BACKENDS = ("ref", "triton")
EXECUTOR_BACKENDS = ("mp", "external_launcher")  # vLLM's: spawned workers, or torchrun's processes
DEFAULT_KV_CACHE_MEMORY = 256 * 2**20  # bytes of K/V on a CPU, or when the device's memory is not profiled
# vLLM's kv_cache_dtype: "auto" stores the model's dtype; "fp8" (or "fp8_e4m3") e4m3, one byte a value (stage 13)
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
KV_CONNECTORS = ("SharedStorageConnector",)  # vLLM's names of the KV connectors built here (stage 14)
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")  # saves blocks, loads them, or both
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")  # vLLM's


ConfigT = TypeVar("ConfigT")


def config_from_dict(cls: type[ConfigT], name: str, value: object) -> ConfigT:
    """A nested configuration given as a dict, as vLLM takes it (or already made): ``cls(**value)``;
    ``ValueError`` for anything but a dict, or for a key ``cls`` does not have."""
    if isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict, got {value!r}")
    unknown = set(value) - {f.name for f in fields(cls)}  # type: ignore[arg-type]
    if unknown:
        raise ValueError(f"{name}: unknown keys {sorted(unknown)}")
    return cls(**value)


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config``: how drafts are proposed and how many (stage 12). Only the
    n-gram method ("prompt lookup"): the longest suffix of ``prompt_lookup_max`` down to
    ``prompt_lookup_min`` tokens seen before proposes up to ``num_speculative_tokens``."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2

    def __post_init__(self) -> None:
        check_choice("speculative_config.method", self.method, ("ngram",))
        check_int("speculative_config.num_speculative_tokens", self.num_speculative_tokens, 1)
        check_int("speculative_config.prompt_lookup_min", self.prompt_lookup_min, 1)
        check_int("speculative_config.prompt_lookup_max", self.prompt_lookup_max, self.prompt_lookup_min)

    @classmethod
    def from_dict(cls, value: object) -> SpeculativeConfig:
        return config_from_dict(cls, "speculative_config", value)


@dataclass(frozen=True)
class KVTransferConfig:
    """vLLM's ``kv_transfer_config``: which KV connector moves blocks between engines, and this engine's
    role (stage 14). ``kv_connector_extra_config`` takes ``shared_storage_path``, the folder of the
    blocks (``"/tmp"`` by default, as vLLM's ``SharedStorageConnector`` reads it). vLLM defaults
    ``kv_connector`` and ``kv_role`` to None, and asks for a role with a connector; minipaged, which
    builds one connector, defaults to it, and to the role that both loads and saves."""

    kv_connector: str = "SharedStorageConnector"
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_choice("kv_transfer_config.kv_connector", self.kv_connector, KV_CONNECTORS)
        check_choice("kv_transfer_config.kv_role", self.kv_role, KV_ROLES)
        extra = self.kv_connector_extra_config
        if not isinstance(extra, dict) or set(extra) - {"shared_storage_path"}:
            raise ValueError(f"kv_connector_extra_config takes only shared_storage_path, got {extra!r}")
        if not isinstance(extra.get("shared_storage_path", ""), str | os.PathLike):
            raise ValueError(f"shared_storage_path must be a folder, got {extra['shared_storage_path']!r}")

    @property
    def shared_storage_path(self) -> str:
        return os.fspath(self.kv_connector_extra_config.get("shared_storage_path", "/tmp"))

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_dict(cls, value: object) -> KVTransferConfig:
        return config_from_dict(cls, "kv_transfer_config", value)


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built from, with vLLM's names and meanings.

    ``None`` means "derive it" (``resolve``): ``num_gpu_blocks`` as many blocks as
    ``kv_cache_memory`` bytes hold; ``kv_cache_memory``, on CUDA in one process, what
    ``gpu_memory_utilization`` of the device leaves after the weights and a profiling forward
    (``LLM`` measures it: vLLM's ``determine_num_available_blocks``), else 256 MiB; ``max_model_len``
    the model's positions or what the cache holds, whichever is smaller; ``num_cpu_blocks`` as many
    as the GPU blocks when ``preemption_mode="swap"``, else none; ``max_num_batched_tokens`` the scheduler's default.
    """

    model: str | os.PathLike = "tiny"
    block_size: int = 16
    num_gpu_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes of K/V when num_gpu_blocks is None
    gpu_memory_utilization: float = 0.9  # on CUDA: the share of the device's memory this engine may take
    num_cpu_blocks: int | None = None  # swap space, in blocks
    max_model_len: int | None = None
    preemption_mode: str = "recompute"
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool | None = None  # None: on under V1 (as in vLLM V1), off under V0
    scheduler: str | None = None  # "v0" or "v1"; None: V1 from stage 10 on, else V0
    async_scheduling: bool = False  # schedule step N + 1 while step N runs (V1)
    attention_backend: str = "ref"
    enforce_eager: bool = False  # vLLM's: no CUDA graphs (on a CPU, or with the ref backend, always eager)
    logprobs_mode: str = "raw_logprobs"  # what a sampled token's logprobs are: see Sampler
    tensor_parallel_size: int = 1  # workers that each hold a shard of the model (stage 11)
    distributed_executor_backend: str | None = None  # how they start: "mp" (the default) or "external_launcher"
    speculative_config: SpeculativeConfig | dict | None = None  # drafts and their verification (stage 12)
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) or "fp8" (e4m3, stage 13)
    calculate_kv_scales: bool = False  # fp8: each layer's k_scale and v_scale from its first batch, else 1.0
    kv_transfer_config: KVTransferConfig | dict | None = None  # a KV connector and this engine's role (stage 14)
    disable_hybrid_kv_cache_manager: bool = False  # vLLM's: keep every block of a sliding-window layer (stage 15)
    dtype: str | torch.dtype = "float32"
    device: str | torch.device = "cpu"
    seed: int = 0
    stage: int = LAST_STAGE  # the engine as of this stage of the ladder: its parts, and what it offers

    def __post_init__(self) -> None:
        check_int("block_size", self.block_size, 1)
        check_int("num_gpu_blocks", self.num_gpu_blocks, 1, allow_none=True)
        check_int("num_cpu_blocks", self.num_cpu_blocks, 0, allow_none=True)
        check_int("max_model_len", self.max_model_len, 1, allow_none=True)
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1, allow_none=True)
        check_int("kv_cache_memory", self.kv_cache_memory, 1, allow_none=True)
        check_float("gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, open_low=True)
        check_int("seed", self.seed, -(2**63))
        check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        check_choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        check_choice("logprobs_mode", self.logprobs_mode, LOGPROBS_MODES)
        if self.kv_cache_dtype == "fp8_e5m2":
            raise ValueError("kv_cache_dtype='fp8_e5m2' is vLLM's other FP8 cache (5 exponent bits, 2 of mantissa: "
                             "a wider range, less precision, no scales); minipaged stores e4m3 only: "
                             "'fp8' or 'fp8_e4m3'")
        check_choice("kv_cache_dtype", self.kv_cache_dtype, tuple(KV_CACHE_DTYPES))
        check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        if self.speculative_config is not None:  # a dict, as vLLM takes it, checked into its dataclass
            object.__setattr__(self, "speculative_config", SpeculativeConfig.from_dict(self.speculative_config))
        if self.kv_transfer_config is not None:
            object.__setattr__(self, "kv_transfer_config", KVTransferConfig.from_dict(self.kv_transfer_config))
        if self.distributed_executor_backend is not None:
            check_choice("distributed_executor_backend", self.distributed_executor_backend, EXECUTOR_BACKENDS)
        check_int("stage", self.stage, FIRST_STAGE)
        if self.stage > LAST_STAGE:
            raise ValueError(f"stage must be {FIRST_STAGE}..{LAST_STAGE}, got {self.stage}")
        if self.scheduler is None:
            object.__setattr__(self, "scheduler", "v1" if self.stage >= 10 else "v0")
        check_choice("scheduler", self.scheduler, SCHEDULERS)
        if self.enable_prefix_caching is None:
            object.__setattr__(self, "enable_prefix_caching", self.scheduler == "v1")
        for flag in ("enable_prefix_caching", "async_scheduling", "enforce_eager", "calculate_kv_scales",
                     "disable_hybrid_kv_cache_manager"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        if not isinstance(self.model, str | os.PathLike):
            raise ValueError(f"model must be a folder or 'tiny', got {self.model!r}")
        resolve_dtype(self.dtype)
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device: {e}") from None
        if self.scheduler == "v1" and self.max_num_batched_tokens is None:
            object.__setattr__(self, "max_num_batched_tokens", V1_MAX_NUM_BATCHED_TOKENS)
        refused = [reason for rule, reason in COMBINATIONS_REFUSED if rule(self)]
        if refused:
            raise ValueError("; ".join(refused))

    def resolve(self, model_config: ModelConfig) -> ResolvedEngineConfig:
        """The same configuration with every ``None`` derived from ``model_config``; ``ValueError``
        for a length the model cannot serve."""
        positions = model_config.max_position_embeddings
        if self.max_model_len is not None and self.max_model_len > positions:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's {positions} positions")
        kv_cache_memory = DEFAULT_KV_CACHE_MEMORY if self.kv_cache_memory is None else self.kv_cache_memory
        num_gpu_blocks = self.num_gpu_blocks or max(
            1, kv_cache_memory // (self.block_size * model_config.kv_bytes_per_token(self.kv_cache_torch_dtype)))
        max_model_len = self.max_model_len or min(positions, num_gpu_blocks * self.block_size)
        num_cpu_blocks = self.num_cpu_blocks
        if num_cpu_blocks is None:
            num_cpu_blocks = num_gpu_blocks if self.preemption_mode == "swap" else 0
        return ResolvedEngineConfig(**{**vars(self), "num_gpu_blocks": num_gpu_blocks, "max_model_len": max_model_len,
                                       "num_cpu_blocks": num_cpu_blocks})

    @property
    def profiles_kv_cache(self) -> bool:
        """Whether the cache is sized by what ``gpu_memory_utilization`` leaves: on CUDA, in one process,
        with neither ``num_gpu_blocks`` nor ``kv_cache_memory`` given."""
        return (torch.device(self.device).type == "cuda" and self.num_gpu_blocks is None
                and self.kv_cache_memory is None and self.tensor_parallel_size == 1)

    @property
    def uses_cuda_graphs(self) -> bool:
        """Whether decode steps replay CUDA graphs (``minipaged.models.cuda_graphs``): on CUDA, with the
        Triton kernels, in one process, unless ``enforce_eager``."""
        return (torch.device(self.device).type == "cuda" and not self.enforce_eager
                and self.attention_backend == "triton" and self.tensor_parallel_size == 1)

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype)

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        """What the K/V cache stores: the model's dtype (``"auto"``), or e4m3 (``"fp8"``)."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or self.torch_dtype

    @property
    def fp8_kv_cache(self) -> bool:
        return KV_CACHE_DTYPES[self.kv_cache_dtype] is not None


@dataclass(frozen=True)
class ResolvedEngineConfig(EngineConfig):
    """An ``EngineConfig`` after ``resolve``: the sizes it derives are numbers (``max_num_batched_tokens``
    stays None for the scheduler's default)."""

    num_gpu_blocks: int = field(kw_only=True)
    num_cpu_blocks: int = field(kw_only=True)
    max_model_len: int = field(kw_only=True)


# What an engine can be built of, in one table: every configuration these rules leave works (the
# combinations tests/test_engine_combinations.py runs, row by row), and each one here is refused
# where the configuration is made, with its reason, before any weight is read. A stage's option
# needs the stage (``stage``, the engine as of a stage of the ladder).
COMBINATIONS_REFUSED: list[tuple[Callable[[EngineConfig], bool], str]] = [
    (lambda c: bool(c.enable_prefix_caching) and c.stage < 9, "enable_prefix_caching needs stage >= 9"),
    (lambda c: c.scheduler == "v1" and c.stage < 10, "scheduler='v1' needs stage >= 10"),
    (lambda c: c.async_scheduling and c.stage < 10, "async_scheduling needs stage >= 10"),
    (lambda c: c.tensor_parallel_size > 1 and c.stage < 11, "tensor_parallel_size > 1 needs stage >= 11"),
    (lambda c: c.speculative_config is not None and c.stage < 12, "speculative_config needs stage >= 12"),
    (lambda c: c.fp8_kv_cache and c.stage < 13, "an FP8 kv_cache_dtype ('fp8' or 'fp8_e4m3') needs stage >= 13"),
    (lambda c: c.calculate_kv_scales and not c.fp8_kv_cache, "calculate_kv_scales needs kv_cache_dtype='fp8'"),
    (lambda c: c.kv_transfer_config is not None and c.stage < 14, "kv_transfer_config needs stage >= 14"),
    (lambda c: c.kv_transfer_config is not None and c.scheduler == "v0",
     "a KV connector's tokens are counted computed by V1's scheduler: kv_transfer_config needs scheduler='v1'"),
    (lambda c: c.kv_transfer_config is not None and c.calculate_kv_scales,
     "each engine would calibrate its own scales and read the other's bytes with them: "
     "kv_transfer_config with calculate_kv_scales"),
    (lambda c: c.scheduler == "v1" and c.preemption_mode == "swap",
     "V1 preempts by recompute only, as vLLM V1 does: preemption_mode='swap' needs scheduler='v0'"),
    (lambda c: c.scheduler == "v0" and c.async_scheduling,
     "async_scheduling overlaps V1's steps: it needs scheduler='v1'"),
    (lambda c: c.scheduler == "v0" and c.speculative_config is not None,
     "drafts are scheduled and verified by V1's scheduler and runner: speculative_config needs scheduler='v1'"),
    (lambda c: c.async_scheduling and c.speculative_config is not None,
     "vLLM serves async scheduling with EAGLE and MTP drafts only, not n-gram ones (vllm/config/vllm.py): "
     "async_scheduling with speculative_config"),
    (lambda c: torch.device(c.device).type == "cpu" and c.attention_backend == "triton"
     and c.torch_dtype == torch.bfloat16,
     "on a CPU the Triton kernels run in Triton's interpreter, whose tl.dot multiplies bfloat16 bit patterns "
     "as integers (triton-lang/triton#11584): attention_backend='triton' with dtype='bfloat16' needs CUDA"),
    (lambda c: c.calculate_kv_scales and c.uses_cuda_graphs,
     "the graphs are captured before the first batch sets the scales: calculate_kv_scales needs enforce_eager=True"),
]
