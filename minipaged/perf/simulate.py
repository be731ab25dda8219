"""Synthetic request traces, and step-by-step simulations of the KV cache.

No model runs here: each step, every running request stores the K/V of one more token.
What is measured is where the memory goes, with the real caches doing the bookkeeping:
stage 0's contiguous slabs (``simulate_contiguous``), or the real serving loop — stage
7's engine and stage 6's scheduler over blocks — with a runner that has no model
(``simulate_paged``), so every figure of the paged cache comes from the real scheduler.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass

import torch

from minipaged.common.sequence import SequenceStatus
from minipaged.perf.kernel_report import GPUS
from minipaged.stage0_contiguous import ContiguousKVCache
from minipaged.stage1_block_allocator import BlockAllocator
from minipaged.stage2_block_table import BlockSpaceManager
from minipaged.stage3_copy_on_write import RefCountedBlockAllocator
from minipaged.stage6_scheduler import Scheduler, SchedulerOutputs
from minipaged.stage6_swapping import SwapBlockSpaceManager
from minipaged.stage7_engine import LLMEngine, SamplingParams
from minipaged.stage7_model_runner import Sampler

KINDS = ("token", "reserved", "internal", "external", "free")

# The vLLM paper's setting for its Figures 2 and 13 (its Table 1): OPT-13B in float16 on one A100-40GB.
OPT_13B_KV_BYTES_PER_TOKEN = 2 * 40 * 40 * 128 * 2  # K and V, 40 layers, 40 heads of 128, 2 bytes: 800 KiB
OPT_13B_WEIGHT_BYTES = 26 * 10**9  # 26 GB of parameters, read once by every forward pass
OPT_13B_KV_BUDGET = 12 * 2**30  # the 12 GB left to the KV cache
OPT_13B_SLOTS = OPT_13B_KV_BUDGET // OPT_13B_KV_BYTES_PER_TOKEN  # 15,728 token slots


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: when it arrives, and how long its prompt and output are."""

    request_id: int
    arrival: int  # the step at which it arrives
    prompt_len: int
    output_len: int


def synthetic_requests(
    num_requests: int,
    *,
    mean_prompt: float = 161.31,
    mean_output: float = 337.99,
    max_len: int = 2048,
    rate: float = 0.1,
    seed: int = 0,
) -> list[TraceRequest]:
    """A seeded trace: Poisson arrivals (``rate`` per step), log-normal lengths.

    Lengths are log-normal with sigma 1 and the given means (the defaults are the
    ShareGPT means the vLLM paper reports), clipped so that prompt + output fits
    ``max_len``.
    """
    rng = random.Random(seed)

    def draw(mean: float) -> int:
        return max(1, round(rng.lognormvariate(math.log(mean) - 0.5, 1.0)))

    requests, clock = [], 0.0
    for i in range(num_requests):
        clock += rng.expovariate(rate)
        prompt = min(draw(mean_prompt), max_len - 1)
        output = min(draw(mean_output), max_len - prompt)
        requests.append(TraceRequest(i, int(clock), prompt, output))
    return requests


@dataclass
class SimulationResult:
    """Averages over the *saturated* steps, those in which a request waits for memory (over
    the steps in which anything runs, if none was saturated). ``mean_batch``: requests
    running, on average over the steps while requests keep arriving (the steady state)."""

    policy: str
    fractions: dict[str, float]  # mean share of the arena per kind of slot
    mean_running: float  # requests holding memory, on average over the steps
    steps: int
    preemptions: int = 0
    mean_batch: float = 0.0  # requests running, on average while requests keep arriving


def _accumulate(totals: dict, fractions: dict[str, float], running: int, saturated: bool, arriving: bool) -> None:
    keys = [k for k, on in (("busy", running > 0), ("saturated", saturated), ("arriving", arriving)) if on]
    for key in keys:
        sums = totals.setdefault(key, dict.fromkeys((*KINDS, "running", "samples"), 0.0))
        for kind, share in fractions.items():
            sums[kind] += share
        sums["running"] += running
        sums["samples"] += 1


def _result(policy: str, totals: dict, steps: int, preemptions: int = 0) -> SimulationResult:
    empty = dict.fromkeys((*KINDS, "running", "samples"), 0.0)
    sums = totals.get("saturated", totals.get("busy", empty))
    samples = max(sums["samples"], 1)
    fractions = {kind: sums[kind] / samples for kind in KINDS}
    steady = totals.get("arriving", empty)
    return SimulationResult(policy, fractions, sums["running"] / samples, steps, preemptions,
                            steady["running"] / max(steady["samples"], 1))


def simulate_contiguous(
    requests: list[TraceRequest], policy: str, num_slots: int, max_model_len: int
) -> SimulationResult:
    """Serve ``requests`` first come, first served with stage 0's cache; average its usage.

    Each step: arrivals join the queue; waiting requests are admitted in order while a
    hole fits the head of the queue (its prompt K/V are stored at once); the usage is
    sampled if a request still waits (memory is the bottleneck then); every running
    request stores one more token; finished requests are freed.
    """
    cache = ContiguousKVCache(num_slots, max_model_len, policy, num_layers=0)
    for r in requests:
        if cache.reservation(r.prompt_len, r.output_len) > num_slots:
            raise ValueError(f"request {r.request_id} can never fit an arena of {num_slots} slots")
    pending = deque(sorted(requests, key=lambda r: r.arrival))
    waiting: deque[TraceRequest] = deque()
    running: list[TraceRequest] = []
    totals: dict = {}
    step = 0
    while pending or waiting or running:
        while pending and pending[0].arrival <= step:
            waiting.append(pending.popleft())
        while waiting and cache.can_allocate(waiting[0].prompt_len, waiting[0].output_len):
            r = waiting.popleft()
            cache.allocate(r.request_id, r.prompt_len, r.output_len)
            cache.append(r.request_id, r.prompt_len)
            running.append(r)
        head = waiting[0] if waiting else None
        usage = cache.usage(cache.reservation(head.prompt_len, head.output_len) if head else None)
        _accumulate(totals, usage.fractions(), len(running), saturated=bool(waiting), arriving=bool(pending))
        step += 1
        still_running = []
        for r in running:
            slab = cache.slabs[r.request_id]
            if slab.num_tokens < slab.need:
                cache.append(r.request_id)
            if slab.num_tokens < slab.need:
                still_running.append(r)
            else:
                cache.free(r.request_id)
        running = still_running
    return _result(policy, totals, step)


class SimulatedRunner:
    """A model runner without a model, for simulations: it moves no K/V and gives every
    sequence the same logits, so the lengths of the outputs are set by ``max_tokens``."""

    vocab_size = 2

    def execute(self, out: SchedulerOutputs) -> torch.Tensor:
        return torch.zeros(len(out.scheduled), self.vocab_size)


def simulated_engine(num_blocks: int, block_size: int, max_model_len: int, *, preemption_mode: str = "recompute",
                     num_cpu_blocks: int = 0, max_num_seqs: int = 1024,
                     max_num_batched_tokens: int | None = None) -> LLMEngine:
    """Stage 7's engine with stage 6's scheduler over ``num_blocks`` blocks, and a ``SimulatedRunner``."""
    cpu_allocator = RefCountedBlockAllocator(num_cpu_blocks) if num_cpu_blocks else None
    manager = SwapBlockSpaceManager(RefCountedBlockAllocator(num_blocks), block_size, cpu_allocator)
    scheduler = Scheduler(manager, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                          max_num_batched_tokens=max_num_batched_tokens, preemption_mode=preemption_mode)
    return LLMEngine(scheduler, SimulatedRunner(), Sampler(), vocab_size=SimulatedRunner.vocab_size)


def simulate_paged(requests: list[TraceRequest], num_blocks: int, block_size: int = 16, *,
                   preemption_mode: str = "recompute", num_cpu_blocks: int = 0) -> SimulationResult:
    """Serve ``requests`` with the real engine loop and scheduler (stages 6 and 7), no model.

    Each step: arrivals are added to the engine, and ``LLMEngine.step`` runs: stage 6's
    scheduler decodes the running requests (preempting the newest when a block is
    missing), admits waiting ones whose prompt blocks are free, and a model-free runner
    stands in for the model. The token budget is the whole cache, so that memory alone
    limits the batch. The usage of the blocks is sampled after every step, as the
    forward pass would hold them.
    """
    max_model_len = max(r.prompt_len + r.output_len for r in requests)
    engine = simulated_engine(num_blocks, block_size, max_model_len, preemption_mode=preemption_mode,
                              num_cpu_blocks=num_cpu_blocks, max_num_seqs=max(len(requests), 1),
                              max_num_batched_tokens=max(num_blocks * block_size, max_model_len))  # memory alone limits
    scheduler, manager = engine.scheduler, engine.scheduler.block_manager
    pending = deque(sorted(requests, key=lambda r: r.arrival))
    totals: dict = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].arrival <= step:
            r = pending.popleft()
            engine.add_request(r.request_id, {"prompt_token_ids": [0] * r.prompt_len},
                               SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True))
        if engine.has_unfinished_requests():
            engine.step()
        running = sum(len(g.seqs_with(SequenceStatus.RUNNING)) for g in scheduler.running)
        _accumulate(totals, manager.usage().fractions(), running, saturated=bool(scheduler.waiting),
                    arriving=bool(pending))
        step += 1
    return _result(f"paged/{block_size}", totals, step, scheduler.make_stats().num_preemptions)


def format_usage_table(results: list[SimulationResult]) -> str:
    """A text table: one row per policy, the share of memory per kind of slot."""
    header = f"{'policy':<10}" + "".join(f"{k:>10}" for k in KINDS) + f"{'running':>10}"
    lines = [header, "-" * len(header)]
    for r in results:
        cells = "".join(f"{100 * r.fractions[k]:>9.1f}%" for k in KINDS)
        lines.append(f"{r.policy:<10}{cells}{r.mean_running:>10.2f}")
    return "\n".join(lines)


@dataclass(frozen=True)
class DecodeBound:
    """The fastest a decode step could run: its bytes read once, at the GPU's peak bandwidth."""

    batch: int  # requests decoding together, one token each
    context: int  # tokens of K/V each request holds
    weight_bytes: int  # read once per step, whatever the batch
    kv_bytes: int  # every request's K/V, read once per step
    step_s: float  # (weight_bytes + kv_bytes) / bandwidth
    tokens_per_s: float  # batch / step_s


def decode_bound(batch: int, context: int, *, gpu: str = "A100-40GB", weight_bytes: int = OPT_13B_WEIGHT_BYTES,
                 kv_bytes_per_token: int = OPT_13B_KV_BYTES_PER_TOKEN) -> DecodeBound:
    """The decode step of ``batch`` requests of ``context`` tokens each, if it only moved its bytes.

    Each step reads all the weights once, whatever the batch, and the K/V of every running
    request; it does a few floating-point operations per byte, so reading is what takes the
    time. The step lasts at least ``(weights + batch × context × KV per token) / bandwidth``
    and produces ``batch`` tokens. The defaults are OPT-13B in float16; ``gpu`` names a peak
    bandwidth of ``minipaged.perf.kernel_report.GPUS``. A bound, not a measurement.
    """
    if batch < 1 or context < 1:
        raise ValueError(f"batch and context must be at least 1, got {batch} and {context}")
    kv_bytes = batch * context * kv_bytes_per_token
    step_s = (weight_bytes + kv_bytes) / (GPUS[gpu][0] * 1e9)
    return DecodeBound(batch, context, weight_bytes, kv_bytes, step_s, batch / step_s)


def decode_bend(context: int, *, weight_bytes: int = OPT_13B_WEIGHT_BYTES,
                kv_bytes_per_token: int = OPT_13B_KV_BYTES_PER_TOKEN) -> float:
    """The batch at which a step reads as many bytes of K/V as of weights: where the bound bends.

    Below it, the weights' read dominates and is shared by the batch, so throughput grows
    almost as fast as the batch; above it, the K/V read dominates and throughput levels off
    toward ``bandwidth / (context × KV per token)``. At the bend it is half that ceiling.
    """
    return weight_bytes / (context * kv_bytes_per_token)


def requests_that_fit(context: int, layout: str, *, num_slots: int = OPT_13B_SLOTS, max_model_len: int = 2048,
                      block_size: int = 16) -> int:
    """How many requests of ``context`` tokens each one KV budget holds at once, counted by the real caches.

    ``layout`` is a policy of stage 0's contiguous cache (``max``, ``pow2``, ``oracle``: one slab
    per request, reserved at admission) or ``paged`` (stage 2's block manager, blocks of
    ``block_size``). The defaults are the vLLM paper's OPT-13B budget on an A100-40GB.
    """
    admitted = 0
    if layout == "paged":
        manager = BlockSpaceManager(BlockAllocator(num_slots // block_size), block_size)
        while manager.can_allocate(context):
            manager.allocate(admitted, [0] * context)
            admitted += 1
        return admitted
    cache = ContiguousKVCache(num_slots, max_model_len, layout, num_layers=0)
    while cache.can_allocate(context, 0):
        cache.allocate(admitted, context, 0)
        admitted += 1
    return admitted
