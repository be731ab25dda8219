"""The engine's composition root: one ``LLM``, its parts chosen by its configuration.

As vLLM's ``LLM`` builds its engine from one ``VllmConfig``, ``LLM(model, **config)`` turns its
arguments into an ``EngineConfig`` (checked, and every combination outside the table of
``minipaged.common.config`` refused, before any weight is read), then builds the parts it names:

| part | chosen by | from stage |
|---|---|---|
| block manager | ``enable_prefix_caching``: copy-on-write and swap, or prefix caching | 6 (on 3), 9 |
| scheduler | ``scheduler``: V0 (the paper's) or V1; ``async_scheduling``: V1's ``AsyncScheduler`` | 6, 10 |
| model and K/V cache | ``tensor_parallel_size``: in this process, or in workers behind an executor | 7, 11 |
| runner | ``scheduler``: V0's, or V1's, with the parts below that it holds | 7, 10 |
| engine (the loop) | ``scheduler``, ``stage``; V1's: a step at a time, or a batch queue (``async_scheduling``) | 7-10 |
| drafts (``SpecDecoder``) | ``speculative_config``: none, or n-gram; the engine, scheduler and runner hold it | 12 |
| K/V storage and attention | ``kv_cache_dtype``: the model's dtype, or e4m3 with per-layer scales | 6, 13 |
| KV connector | ``kv_transfer_config``: none, or one that loads and saves blocks (producer, consumer, both); | 14 |
| | its scheduler side is the scheduler's ``connector``, its worker side the runner's and the attention's | |
| | (with ``tensor_parallel_size > 1``: every worker's, over its shard, and a stand-in the runner's) | 11 |
| KV cache manager | a model with sliding-window layers, under V1: a hybrid cache, a block table per group | 15 |
| | (not with ``disable_hybrid_kv_cache_manager`` or a connector: every block kept) | |
| decode steps | ``enforce_eager``: eager, or replayed from CUDA graphs (on CUDA, Triton) | ``models.cuda_graphs`` |

``stage`` is the engine as of a stage of the ladder (by default the top): ``LLM("tiny", stage=7)``
runs stage 7's loop, without the sharing of stage 8 or the options of the stages above it.
Each stage's file holds its idea and provides its part; none of them names this module, and
a new stage is one more row here.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import os
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any, cast

import torch
from tqdm.auto import tqdm

from minipaged.common.config import (
    DEFAULT_KV_CACHE_MEMORY,
    EngineConfig,
    KVTransferConfig,
    ResolvedEngineConfig,
    SpeculativeConfig,
)
from minipaged.common.processor import Prompt
from minipaged.common.sampler import Sampler
from minipaged.common.sampling_params import RequestOutput, RequestOutputKind, SamplingParams
from minipaged.common.stats import PrefixCacheStats, Stats
from minipaged.models import (
    CausalLM,
    ModelConfig,
    load_config,
    load_eos_token_ids,
    load_model,
    load_tokenizer,
    resolve_model_path,
)
from minipaged.models.cuda_graphs import CUDAGraphModel
from minipaged.models.parallel import check_tensor_parallel
from minipaged.stage3_copy_on_write import RefCountedBlockAllocator
from minipaged.stage6_scheduler import Scheduler
from minipaged.stage6_swapping import SwapBlockSpaceManager, SwapPagedKVCache
from minipaged.stage7_engine import LLMEngine
from minipaged.stage7_model_runner import ModelRunner, backend_named, determine_available_kv_memory
from minipaged.stage8_sharing import BeamSearchOutput, BeamSearchParams, SharingEngine
from minipaged.stage9_prefix_caching import PrefixCachingAllocator, PrefixCachingBlockSpaceManager, PrefixCachingEngine
from minipaged.stage10_async_scheduling import AsyncScheduler
from minipaged.stage10_engine_core import V1Engine
from minipaged.stage10_front_end import beam_search_over
from minipaged.stage10_kv_cache_manager import KVCacheManager
from minipaged.stage10_model_runner import V1ModelRunner
from minipaged.stage10_v1_scheduler import V1Scheduler
from minipaged.stage11_tensor_parallel import Executor, follow_rank_0_of, start_tensor_parallel
from minipaged.stage12_rejection_sampler import NgramProposer, RejectionSampler
from minipaged.stage12_speculative import SpecDecoder, SpecInputBatch
from minipaged.stage13_fp8_kv_cache import FP8PagedKVCache, check_fp8_supported, fp8_attention
from minipaged.stage14_disaggregated_prefill import (
    ConnectorKVCacheManager,
    KVConnectorAttention,
    KVConnectorWorker,
    TensorParallelKVConnector,
    worker_kv_connector,
)
from minipaged.stage14_kv_connector import KVConnectorRole, create_connector, model_identity
from minipaged.stage15_hybrid_kv_cache import HybridKVCacheCoordinator, HybridKVCacheManager
from minipaged.stage15_kv_cache_groups import (
    KVCacheGroupSpec,
    group_of_layer,
    group_size,
    hybrid_kv_cache,
    kv_cache_groups,
)

FINAL_ONLY = RequestOutputKind.FINAL_ONLY


def engine_class(c: EngineConfig) -> type[LLMEngine]:
    """The loop that steps the parts: stage 7's, with the ideas of the stages above it that ``c`` asks for."""
    if c.scheduler == "v1":
        return V1Engine  # one loop: step, or step_with_batch_queue (async_scheduling)
    if c.stage >= 9 and c.enable_prefix_caching:
        return PrefixCachingEngine  # its requests that ask for prompt_logprobs read no cached block
    return SharingEngine if c.stage >= 8 else LLMEngine


def kv_cache_parts(c: EngineConfig, groups: list[KVCacheGroupSpec] | None = None) -> dict[str, Any]:
    """The K/V cache's class (given stage 6's sizes) and the attention over it (given the backend's name and
    the cache; None: stage 4's or 5's by name), as ``kv_cache_dtype`` chooses them, here or in every worker;
    with KV cache groups (stage 15), that cache for a group's layers, shared by every layer."""
    kv_cache: Any = SwapPagedKVCache
    if c.fp8_kv_cache:
        kv_cache = functools.partial(FP8PagedKVCache, calculate_kv_scales=c.calculate_kv_scales)
    if groups is not None:
        kv_cache = functools.partial(hybrid_kv_cache, groups, kv_cache)
    return {"kv_cache": kv_cache, "attention": fp8_attention if c.fp8_kv_cache else None}


def worker_parts(c: EngineConfig, groups: list[KVCacheGroupSpec] | None = None) -> dict[str, Any]:
    """What every tensor-parallel worker is built with (stage 11's ``WorkerConfig``): the K/V cache and the
    attention (``kv_cache_parts``), and the KV connector's worker side over its shard, if one is configured."""
    kv_connector = None
    if isinstance(c.kv_transfer_config, KVTransferConfig):
        kv_connector = functools.partial(worker_kv_connector, c.kv_transfer_config, c.block_size)
    return {**kv_cache_parts(c, groups), "kv_connector": kv_connector}


def kv_cache_groups_for(c: ResolvedEngineConfig, mc: ModelConfig) -> list[KVCacheGroupSpec] | None:
    """Stage 15's groups of layers, each with a block table of its own, for a model with sliding-window
    layers under V1; None (one table; every block of every layer kept) otherwise, or where vLLM turns
    its hybrid manager off (``disable_hybrid_kv_cache_manager``, a KV connector)."""
    windows = [mc.window_of(layer) for layer in range(mc.num_layers)]
    served = (c.scheduler == "v1" and c.stage >= 15 and not c.disable_hybrid_kv_cache_manager
              and c.kv_transfer_config is None)
    return kv_cache_groups(windows, c.block_size) if served and any(windows) else None


class LLM:
    """A serving engine on a paged KV cache, over a local Hugging Face model (or ``"tiny"``).

    Its arguments are ``EngineConfig``'s, checked before anything is loaded: ``LLM("tiny")`` is
    the top of the ladder (V1's scheduler, prefix caching on); ``LLM("tiny", stage=N)`` the
    engine as of stage ``N``. ``generate`` runs prompts to the end; ``engine`` is the loop,
    for a server (``add_request``, ``step``). An exception or Ctrl-C inside a call aborts its
    requests, every block goes back, and the same ``LLM`` keeps working.
    """

    def __init__(self, model: str | os.PathLike = "tiny", **kwargs: Any) -> None:
        config = EngineConfig(model=model, **kwargs)
        if config.fp8_kv_cache:
            check_fp8_supported(config.device, config.attention_backend)
        path = resolve_model_path(str(model))
        self.model_config = load_config(path)
        self.dtype, self.device = config.torch_dtype, torch.device(config.device)
        profiled = None
        if config.profiles_kv_cache:  # the weights first: the cache takes what they and a step leave
            profiled = load_model(path, self.dtype, self.device)[0]
            config = dataclasses.replace(config, kv_cache_memory=self.profile_kv_cache_memory(profiled, config))
        self.config = config = config.resolve(self.model_config)
        self.kv_cache_groups = self.build_kv_cache_groups()
        self.group_of_layer = None if self.kv_cache_groups is None else group_of_layer(self.kv_cache_groups)
        if self.kv_cache_groups is not None and kwargs.get("num_gpu_blocks") is None:  # the bytes, in blocks
            config = self.config = dataclasses.replace(config, num_gpu_blocks=self.hybrid_num_blocks())
        if config.tensor_parallel_size > 1:
            check_tensor_parallel(self.model_config, config.tensor_parallel_size)  # before any worker starts
        self.max_model_len = config.max_model_len
        self.executor: Executor | None = None
        self.attention: Any = backend_named(config.attention_backend)  # stage 4's or 5's; wrapped over an FP8 cache
        eos_ids = load_eos_token_ids(path)
        self.spec_decoder = self.build_spec_decoder(eos_ids)
        self.scheduler = self.build_scheduler(None if self.kv_cache_groups is not None else self.build_block_manager())
        self.model, self.cache = self.build_model_and_cache(path, profiled)
        self.tokenizer = load_tokenizer(path)
        v1 = {"spec_decoder": self.spec_decoder, "async_scheduling": config.async_scheduling} if (
            config.scheduler == "v1") else {}
        self.engine = engine_class(config)(self.scheduler, self.build_runner(),  # type: ignore[arg-type]
                                           Sampler(eos_ids, config.logprobs_mode), tokenizer=self.tokenizer,
                                           eos_token_ids=eos_ids, vocab_size=self.model_config.vocab_size,
                                           seed=config.seed, device=self.device, **v1)
        self._request_ids = itertools.count()

    # ---- the parts, each chosen by the configuration ----

    def build_block_manager(self) -> SwapBlockSpaceManager:
        """The block manager the scheduler and the runner share, with a CPU pool for swapping."""
        c = self.config
        cpu = RefCountedBlockAllocator(c.num_cpu_blocks) if c.num_cpu_blocks else None
        if c.enable_prefix_caching:
            return PrefixCachingBlockSpaceManager(PrefixCachingAllocator(c.num_gpu_blocks), c.block_size, cpu)
        return SwapBlockSpaceManager(RefCountedBlockAllocator(c.num_gpu_blocks), c.block_size, cpu)

    def build_kv_cache_groups(self) -> list[KVCacheGroupSpec] | None:
        """Stage 15's groups of layers (``kv_cache_groups_for``), or None."""
        return kv_cache_groups_for(self.config, self.model_config)

    def hybrid_num_blocks(self) -> int:
        """The blocks the K/V memory holds when a block spans a group's layers, not every layer (vLLM's
        ``memory // (page size × group size)``); the null block is one of them."""
        c, mc = self.config, self.model_config
        assert self.kv_cache_groups is not None
        memory = DEFAULT_KV_CACHE_MEMORY if c.kv_cache_memory is None else c.kv_cache_memory
        per_layer = mc.kv_bytes_per_token(c.kv_cache_torch_dtype) // mc.num_layers  # a token's K/V in one layer
        return max(2, memory // (c.block_size * per_layer * group_size(self.kv_cache_groups)))

    def build_spec_decoder(self, eos_ids: Collection[int]) -> SpecDecoder | None:
        """Stage 12's drafts, one part that the engine, the scheduler and the runner hold; None without them."""
        spec = self.config.speculative_config
        if not isinstance(spec, SpeculativeConfig):
            return None
        return SpecDecoder(NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min),
                           RejectionSampler(eos_ids, self.config.logprobs_mode))

    def build_scheduler(self, block_manager: SwapBlockSpaceManager | None) -> Scheduler | V1Scheduler:
        """V0's (the paper's), or V1's, which holds the parts configured: the connector's scheduler side
        (its KV cache manager, which counts the connector's tokens), the drafts; async: ``AsyncScheduler``."""
        c = self.config
        if c.scheduler == "v0":
            assert block_manager is not None
            return Scheduler(block_manager, max_num_seqs=c.max_num_seqs, max_model_len=c.max_model_len,
                             max_num_batched_tokens=c.max_num_batched_tokens, preemption_mode=c.preemption_mode)
        assert c.max_num_batched_tokens is not None  # V1's default is set where the config is made
        kv_cache_manager: Any
        connector = None
        if self.kv_cache_groups is not None:  # a hybrid cache: a manager per group over one pool
            caching = bool(c.enable_prefix_caching)
            coordinator = HybridKVCacheCoordinator(self.kv_cache_groups, c.num_gpu_blocks, caching)
            kv_cache_manager = HybridKVCacheManager(coordinator, c.max_num_batched_tokens)
        else:
            assert block_manager is not None
            kv_cache_manager = KVCacheManager(block_manager)
        if isinstance(c.kv_transfer_config, KVTransferConfig):  # the connector's scheduler side, by the blocks
            assert block_manager is not None
            kv_cache_manager = connector = ConnectorKVCacheManager(
                block_manager, create_connector(c.kv_transfer_config, KVConnectorRole.SCHEDULER, c.block_size,
                                                world_size=c.tensor_parallel_size))
        scheduler_class = AsyncScheduler if c.async_scheduling else V1Scheduler
        return scheduler_class(kv_cache_manager, max_num_batched_tokens=c.max_num_batched_tokens,
                               max_num_seqs=c.max_num_seqs, max_model_len=c.max_model_len, connector=connector,
                               spec_decoder=self.spec_decoder)

    def build_model_and_cache(self, path: Path, loaded: CausalLM | None) -> tuple[Any, Any]:
        """The model the runner calls and the paged K/V of every layer: here, or (stage 11) in
        ``tensor_parallel_size`` workers, of which the runner sees stand-ins."""
        c, mc = self.config, self.model_config
        model: Any
        cache: Any
        groups = self.kv_cache_groups
        parts = kv_cache_parts(c, groups)
        if c.tensor_parallel_size > 1:
            self.executor, model, cache = start_tensor_parallel(c, mc, path, **worker_parts(c, groups))
            return model, cache
        model = loaded if loaded is not None else load_model(path, self.dtype, self.device)[0]
        scratch = 1 if c.uses_cuda_graphs else 0  # a block no sequence is given: the graphs' padded rows write there
        cache = parts["kv_cache"](mc.num_layers, c.num_gpu_blocks + scratch, c.block_size, mc.num_kv_heads,
                                  mc.head_dim, self.dtype, self.device, c.num_cpu_blocks)
        if parts["attention"] is not None:
            self.attention = parts["attention"](c.attention_backend, cache)
        if c.uses_cuda_graphs:  # each layer's table its group's, where the layers keep several
            model = CUDAGraphModel(model, cache, self.attention, c.max_num_seqs, c.max_model_len, self.group_of_layer)
        return model, cache

    def build_runner(self) -> ModelRunner | V1ModelRunner:
        """V0's, or V1's, which holds the parts configured: a batch that holds drafts and the drafts' rows,
        the connector's worker side (around the forward, and in every layer's attention; with tensor-parallel
        workers, in each of them, and the runner holds their stand-in)."""
        c, backend = self.config, self.attention
        if c.scheduler == "v0":
            return ModelRunner(self.model, self.cache, self.scheduler.block_manager, backend)
        input_batch = None
        kv_connector: KVConnectorWorker | TensorParallelKVConnector | None = None
        if self.spec_decoder is not None:
            input_batch = SpecInputBatch(c.max_num_seqs, c.max_model_len, -(-c.max_model_len // c.block_size),
                                         1 if self.kv_cache_groups is None else len(self.kv_cache_groups))
        if isinstance(c.kv_transfer_config, KVTransferConfig) and self.executor is not None:  # in the workers
            kv_connector = TensorParallelKVConnector(self.executor)
        elif isinstance(c.kv_transfer_config, KVTransferConfig):  # the connector's worker side, by the cache
            weights = self.model.model if isinstance(self.model, CUDAGraphModel) else self.model
            connector = create_connector(c.kv_transfer_config, KVConnectorRole.WORKER, c.block_size,
                                         model_identity(weights))
            kv_connector = KVConnectorWorker(connector, self.cache)
            backend = KVConnectorAttention(backend, self.cache, connector)
        return V1ModelRunner(self.model, self.cache, c.block_size, c.max_num_seqs, c.max_model_len, backend,
                             input_batch=input_batch, spec_decoder=self.spec_decoder, kv_connector=kv_connector,
                             group_of_layer=self.group_of_layer)

    def profile_kv_cache_memory(self, model: CausalLM, config: EngineConfig) -> int:
        """The bytes of K/V that ``gpu_memory_utilization`` leaves (``determine_available_kv_memory``),
        profiled with the largest step: ``max_num_batched_tokens`` tokens (8192 by default, or the
        model's positions), and the logits of ``max_num_seqs`` rows. ``ValueError`` if nothing is left."""
        mc = self.model_config
        num_tokens = config.max_num_batched_tokens or min(8192, mc.max_position_embeddings)
        available = determine_available_kv_memory(model, mc.num_layers, mc.num_kv_heads, mc.head_dim,
                                                  config.block_size, num_tokens, min(config.max_num_seqs, num_tokens),
                                                  config.gpu_memory_utilization,
                                                  backend_named(config.attention_backend))
        if available < config.block_size * mc.kv_bytes_per_token(config.kv_cache_torch_dtype):
            raise ValueError(f"gpu_memory_utilization={config.gpu_memory_utilization} leaves no memory for the "
                             f"KV cache after the weights and a step of {num_tokens} tokens")
        return available

    # ---- running prompts ----

    def next_request_id(self) -> int:
        return next(self._request_ids)

    def generate(self, prompts: Prompt | Iterable[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (strings or ``{"prompt_token_ids": [...]}``); outputs in prompt order."""
        prompts = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        params = (sampling_params if isinstance(sampling_params, list)
                  else [sampling_params or SamplingParams()] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        final = {id(p): dataclasses.replace(p, output_kind=FINAL_ONLY) if isinstance(p, SamplingParams) else p
                 for p in params}  # as vLLM's LLM asks: no output of a request before it is done
        params = [final[id(p)] for p in params]
        ids, done = [], {}
        try:
            for prompt, p in zip(prompts, params, strict=True):
                ids.append(self.next_request_id())
                self.engine.add_request(ids[-1], prompt, p)
            with tqdm(total=len(ids), disable=not use_tqdm, desc="generating") as bar:
                while self.engine.has_unfinished_requests() and any(i not in done for i in ids):
                    for output in self.engine.step():
                        if output.finished:
                            done[output.request_id] = output
                            bar.update(1)
        except BaseException:  # nothing of this call stays queued, every block goes back
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return [done[i] for i in ids]

    def beam_search(self, prompts: Prompt | Iterable[Prompt],
                    params: BeamSearchParams | None = None) -> list[BeamSearchOutput]:
        """Beam search for each prompt, served together; each output's beams best first. Under V0 (stage 8 and
        up), the engine's: beams forked on shared blocks. Under V1, in the front end as vLLM's ``LLM.beam_search``
        runs (``beam_search_over``): one-token requests whose common blocks the prefix cache shares."""
        params = params or BeamSearchParams()
        prompts = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        if isinstance(self.engine, SharingEngine):
            return self.engine.beam_search(prompts, params, [self.next_request_id() for _ in prompts])
        if self.config.stage < 8:
            raise ValueError("beam search needs stage >= 8")
        checked = [self.engine.processor.process_inputs(prompt, params) for prompt in prompts]
        return beam_search_over(lambda asked, one: self.generate(asked, one, use_tqdm=False), checked, params,
                                self.engine.eos_token_ids, self.engine.text)

    @property
    def stats(self) -> Stats:
        """What the engine, the scheduler, the prefix cache, the drafts and the KV connector counted since this
        ``LLM`` was made."""
        allocator = self.scheduler.block_manager.allocator
        engine, runner = self.engine, self.engine.runner
        kv_manager = getattr(self.scheduler, "kv_cache_manager", None)
        kv_transfer = None
        if isinstance(kv_manager, ConnectorKVCacheManager) and isinstance(runner, V1ModelRunner):
            assert isinstance(runner.kv_connector, KVConnectorWorker | TensorParallelKVConnector)
            kv_transfer = kv_manager.make_kv_transfer_stats() + runner.kv_connector.make_stats()
        return Stats(engine=dataclasses.replace(engine.stats), scheduler=self.scheduler.make_stats(),
                     prefix_cache=(allocator.make_stats() if isinstance(allocator, PrefixCachingAllocator)
                                   else PrefixCacheStats()),
                     spec_decoding=(dataclasses.replace(self.spec_decoder.spec_stats)
                                    if self.spec_decoder is not None else None),
                     kv_transfer=kv_transfer)

    # ---- workers ----

    def check_health(self) -> None:
        """``WorkerDiedError`` if a tensor-parallel worker is gone (vLLM's ``check_health``)."""
        if self.executor is not None:
            self.executor.check_health()

    def close(self) -> None:
        """Stop the workers, if any; an ``LLM`` with workers serves no more."""
        if self.executor is not None:
            self.executor.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def torchrun_main(argv: list[str] | None = None) -> None:
    """``torchrun --nproc-per-node N -m minipaged.llm --model M --prompt-token-ids '[[...]]'``:
    every process a worker, its rank and the rendezvous from torchrun's environment; rank 0 also
    runs the engine (``distributed_executor_backend="external_launcher"``, vLLM's name) and prints
    the greedy outputs as JSON, one line per prompt."""
    parser = argparse.ArgumentParser(prog="python -m minipaged.llm")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--prompt-token-ids", required=True, help="a JSON list of lists of token ids")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--num-gpu-blocks", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args(argv)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    kwargs = dict(tensor_parallel_size=world_size, distributed_executor_backend="external_launcher",
                  num_gpu_blocks=args.num_gpu_blocks, block_size=args.block_size)
    if rank != 0:
        path = resolve_model_path(args.model)
        model_config = load_config(path)
        config = EngineConfig(model=args.model, **kwargs).resolve(model_config)
        follow_rank_0_of(config, path, rank, **worker_parts(config, kv_cache_groups_for(config, model_config)))
        return
    with LLM(args.model, **kwargs) as llm:
        prompts = [{"prompt_token_ids": ids} for ids in json.loads(args.prompt_token_ids)]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        for out in llm.generate(cast("list[Prompt]", prompts), params, use_tqdm=False):
            print(json.dumps(out.outputs[0].token_ids), flush=True)


if __name__ == "__main__":
    torchrun_main()
