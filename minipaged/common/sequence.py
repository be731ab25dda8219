"""Sequences and sequence groups, as vLLM names them (``vllm/sequence.py``): what the
schedulers of stages 6 and 10 schedule and the engines of stages 7 to 10 extend.

A ``Sequence`` is one stream of tokens — its prompt and what it generated — and how many of
them have their K/V in the cache. A ``SequenceGroup`` holds the sequences of one request,
which the stage 6 scheduler runs, moves and preempts together.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One sequence of tokens: its prompt, what it generated, and how much of it the cache holds."""

    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def append_token(self, token_id: int) -> None:
        """Record a generated token: the K/V of every token before it are now in the cache (a scheduler
        that counts tokens computed when it schedules them may have counted more: they stay counted)."""
        self.num_computed_tokens = max(self.num_computed_tokens, len(self))
        self.output_token_ids.append(token_id)


SeqT = TypeVar("SeqT", bound=Sequence)  # the kind of sequence a group holds (an engine's, from stage 7 on)


@dataclass(eq=False)
class SequenceGroup(Generic[SeqT]):
    """The sequences of one request, scheduled together. ``width``: the most it runs at once."""

    request_id: Hashable
    seqs: list[SeqT]
    max_tokens: int  # tokens each sequence may generate
    width: int = 1
    arrival: int = -1  # set by Scheduler.add: the scheduler serves the smallest first

    def seqs_with(self, status: SequenceStatus) -> list[SeqT]:
        return [s for s in self.seqs if s.status is status]

    def is_finished(self) -> bool:
        for s in self.seqs:  # a loop, not all(): called for every request at every step
            if s.status is not SequenceStatus.FINISHED:
                return False
        return True

    def max_num_running_seqs(self) -> int:
        return max(self.width, len(self.seqs) - len(self.seqs_with(SequenceStatus.FINISHED)))
