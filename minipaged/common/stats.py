"""Statistics objects, with vLLM's names: what a component counts, it returns as one of these.

* ``PrefixCacheStats`` — a prefix cache's block lookups, hits and evictions (stage 9's
  allocator: ``make_stats()``).
* ``SchedulerStats`` — a scheduler's queues, preemptions, swapped blocks and blocks in use
  (stages 6 and 10: ``make_stats()``).
* ``EngineStats`` — what the engine's steps computed: steps, prefill and decode tokens,
  and the KV slots that held a token against the slots held (stage 7's engine: ``stats``).
* ``SpecDecodingStats`` — drafts proposed, draft tokens verified and the tokens kept (stage
  12's engine).
* ``KVTransferStats`` — what a KV connector moved: tokens it supplied, blocks and bytes loaded and
  saved, blocks that failed to load and the tokens computed again for them (stage 14).
* ``Stats`` — these together, as ``LLM.stats`` gives them after ``generate``; the server's
  metrics, the live page and the benchmarks read the same objects.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class PrefixCacheStats:
    """Block lookups in a prefix cache, the hits among them, and cached blocks evicted."""

    queries: int = 0
    hits: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class SchedulerStats:
    """A scheduler's state and counters since it started."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_swapped_reqs: int = 0
    num_preemptions: int = 0
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
    num_gpu_blocks: int = 0
    num_used_blocks: int = 0
    peak_blocks_used: int = 0

    @property
    def kv_cache_usage(self) -> float:
        """The share of GPU blocks in use now (vLLM's ``kv_cache_usage``)."""
        return self.num_used_blocks / self.num_gpu_blocks if self.num_gpu_blocks else 0.0


@dataclass
class EngineStats:
    """The engine's counters since it started."""

    steps: int = 0
    prefill_tokens: int = 0  # tokens computed for prompts (a recomputed sequence's too)
    decode_tokens: int = 0  # one per sequence per decode step
    token_slots: int = 0  # summed over steps: KV slots holding a token ...
    held_slots: int = 0  # ... and KV slots held (reserved in a sequence's blocks)

    def record_step(self, prefill_tokens: int, decode_tokens: int, token_slots: int, held_slots: int) -> None:
        self.steps += 1
        self.prefill_tokens += prefill_tokens
        self.decode_tokens += decode_tokens
        self.token_slots += token_slots
        self.held_slots += held_slots

    @property
    def kv_utilization(self) -> float:
        """The share of held KV slots that held a token, over every step."""
        return self.token_slots / self.held_slots if self.held_slots else 0.0


@dataclass
class SpecDecodingStats:
    """Drafts proposed, draft tokens verified, and how many the target kept (vLLM's names)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Of the draft tokens verified, the fraction kept."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verified draft gives on average: the drafts kept, and the target's own token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class KVTransferStats:
    """A KV connector's counts (vLLM: ``KVConnectorStats``); its scheduler side counts tokens, its worker
    side blocks and bytes, and ``+`` joins the two."""

    num_external_tokens: int = 0  # prompt tokens counted computed because the connector supplies them
    num_recomputed_tokens: int = 0  # of those, tokens computed after all, their blocks having failed to load
    num_loaded_blocks: int = 0
    num_loaded_bytes: int = 0
    num_failed_blocks: int = 0  # blocks whose file was missing, short or corrupt when loaded
    num_saved_blocks: int = 0
    num_saved_bytes: int = 0

    def __add__(self, other: KVTransferStats) -> KVTransferStats:
        return KVTransferStats(**{k: v + getattr(other, k) for k, v in asdict(self).items()})


@dataclass(frozen=True)
class Stats:
    """What an ``LLM`` counted, read after ``generate``: its engine's, its scheduler's, with
    prefix caching its cache's, and with speculative decoding its drafts' statistics (else None)."""

    engine: EngineStats
    scheduler: SchedulerStats
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    spec_decoding: SpecDecodingStats | None = None
    kv_transfer: KVTransferStats | None = None

    # the figures a learner reads most, by their short names
    steps = property(lambda self: self.engine.steps)
    prefill_tokens = property(lambda self: self.engine.prefill_tokens)
    decode_tokens = property(lambda self: self.engine.decode_tokens)
    kv_utilization = property(lambda self: self.engine.kv_utilization)
    num_preemptions = property(lambda self: self.scheduler.num_preemptions)
    num_swapped_out_blocks = property(lambda self: self.scheduler.num_swapped_out_blocks)
    num_swapped_in_blocks = property(lambda self: self.scheduler.num_swapped_in_blocks)
    peak_blocks_used = property(lambda self: self.scheduler.peak_blocks_used)
    num_gpu_blocks = property(lambda self: self.scheduler.num_gpu_blocks)
    prefix_cache_hits = property(lambda self: self.prefix_cache.hits)

    def as_dict(self) -> dict:
        """Every figure, flat: the engine's, the scheduler's and the prefix cache's (``prefix_cache_*``)."""
        return {**asdict(self.engine), "kv_utilization": self.kv_utilization, **asdict(self.scheduler),
                "kv_cache_usage": self.scheduler.kv_cache_usage,
                **{f"prefix_cache_{k}": v for k, v in asdict(self.prefix_cache).items()},
                "prefix_cache_hit_rate": self.prefix_cache.hit_rate,
                **({} if self.spec_decoding is None else
                   {f"spec_decode_{k}": v for k, v in asdict(self.spec_decoding).items()}),
                **({} if self.kv_transfer is None else
                   {f"kv_transfer_{k}": v for k, v in asdict(self.kv_transfer).items()})}
