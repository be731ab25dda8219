"""Stage 10 — what V1's scheduler tells its runner each step (vLLM's ``v1/core/sched/output.py``).

The scheduler and the runner share no state: each step the scheduler sends a ``SchedulerOutput``.
A request the runner has not seen comes whole (``NewRequestData``); those already in its
persistent batch come as what changed since their last step, all of them in one
``CachedRequestData`` of lists, one entry per request, as vLLM's: the token sampled last, the
blocks added, the tokens computed before the step. Block ids come one list per KV cache group, as
vLLM's ``tuple[list[int], ...]``: one group, unless layers of several kinds keep tables of their own
(stage 15). The rows of finished and preempted requests are named, to be
dropped. Read the fields here first: stage 10's scheduler fills them, its runner applies them.
Two fields stay empty until the scheduler holds a part that fills them, as in vLLM's
``SchedulerOutput``: ``scheduled_spec_decode_tokens`` and ``kv_connector_metadata``.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the engine's requests, named in annotations only
    from minipaged.stage7_engine import Request


@dataclass
class NewRequestData:
    """A request the runner has not seen (or must see afresh, after a preemption): all of it."""

    req_id: Hashable
    token_ids: list[int]
    block_ids: tuple[list[int], ...]  # one list per KV cache group
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    """The requests already in the persistent batch, entry ``i`` of each list for ``req_ids[i]``: only what
    changed since its last step. One object for all of them, as vLLM's (a request resumed after a
    preemption comes afresh, as ``NewRequestData``, where vLLM marks it ``resumed_from_preemption``)."""

    req_ids: list[Hashable] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)  # each: the token sampled last step, if known yet
    new_block_ids: list[tuple[list[int], ...]] = field(default_factory=list)  # each: per group; () when none
    num_computed_tokens: list[int] = field(default_factory=list)  # each: its tokens computed before this step

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def add(self, req_id: Hashable, new_token_ids: list[int], new_block_ids: tuple[list[int], ...],
            num_computed_tokens: int) -> None:
        """One more request's entry in each list."""
        self.req_ids.append(req_id)
        self.new_token_ids.append(new_token_ids)
        self.new_block_ids.append(new_block_ids)
        self.num_computed_tokens.append(num_computed_tokens)


@dataclass
class SchedulerOutput:
    """One step: how many tokens each request computes, and the differences for the runner."""

    num_scheduled_tokens: dict[Hashable, int] = field(default_factory=dict)  # in scheduling order
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    preempted_req_ids: list[Hashable] = field(default_factory=list)
    finished_req_ids: list[Hashable] = field(default_factory=list)  # since the last step
    scheduled: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Filled only by the optional parts the scheduler holds (vLLM's fields, empty without them):
    # tokens guessed past each request's last, to be checked in this forward (a proposer's), and
    # what a KV connector's worker side loads and saves this step.
    scheduled_spec_decode_tokens: dict[Hashable, list[int]] = field(default_factory=dict)
    kv_connector_metadata: Any = None

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())
