"""The plain data object the scheduler hands to the runner each step.

The core decides and the runner executes: nothing in here is a tensor.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.sequence import Sequence, SequenceGroup


@dataclass
class ScheduledSequence:
    """Run tokens [start, start + num_new_tokens) of `seq` this step.

    block_table covers at least start + num_new_tokens tokens; the runner writes the
    new K/V into those slots and attends over [0, start + num_new_tokens).
    """
    seq: Sequence
    group: SequenceGroup
    start: int
    num_new_tokens: int
    block_table: list[int]

    @property
    def context_len(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def do_sample(self) -> bool:
        """A token is sampled only when this step reaches the end of the sequence."""
        return self.context_len == self.seq.num_tokens

    @property
    def is_decode(self) -> bool:
        return self.num_new_tokens == 1 and self.start == self.seq.num_tokens - 1 and bool(self.seq.output_token_ids)


@dataclass
class SchedulerOutput:
    # Decodes first, then prefill chunks (kernels rely on that order).
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)   # (cpu block, device block)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)      # (src, dst) device blocks, copy-on-write
    preempted: list[SequenceGroup] = field(default_factory=list)
    ignored: list[SequenceGroup] = field(default_factory=list)  # rejected (can never fit); finished with an error

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_decodes(self) -> int:
        n = 0
        for s in self.scheduled:
            if not s.is_decode:
                break
            n += 1
        return n

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.blocks_to_swap_in or self.blocks_to_swap_out or self.blocks_to_copy)
