"""The plain data object the scheduler hands to the runner each step.

The core decides and the runner executes: nothing in here is a tensor.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.core.table_log import TableChanges
from pagedserve.sequence import Sequence, SequenceGroup


@dataclass(slots=True)
class ScheduledSequence:
    """Run tokens [start, start + num_new_tokens) of `seq` this step.

    block_table covers at least start + num_new_tokens tokens; the runner writes the
    new K/V into those slots and attends over [0, start + num_new_tokens). It may be the KV
    manager's live list (no copy per step): read it during this step, never modify it.
    do_sample and is_decode are fixed when the step is planned, so they stay true to the
    plan after the engine appends the sampled token to seq. A decode's one token may be a
    placeholder (seq.num_inflight_tokens > 0): the runner takes it from the previous step's
    sampled tokens on the device. A prefill chunk never contains a placeholder.

    A speculative row (num_lookahead = k > 0) runs the sequence's last token and then
    seq.spec_token_ids[:k], so num_new_tokens = 1 + k; it returns logits at all 1 + k positions,
    and is not a decode row (it is listed after the decodes). The engine sets num_rejected once
    the runner has verified the proposals; update_after_step then counts only verified tokens
    computed and the KV manager gives back the rejected slots' blocks.
    """
    seq: Sequence
    group: SequenceGroup
    start: int
    num_new_tokens: int
    block_table: list[int]
    num_lookahead: int = 0
    num_rejected: int = 0
    do_sample: bool = field(init=False)
    is_decode: bool = field(init=False)

    def __post_init__(self) -> None:
        n = self.seq.num_tokens  # placeholders included: a decode may run a token not yet on the host
        # A token is sampled only when this step reaches the end of the sequence.
        self.do_sample = self.start + self.num_new_tokens - self.num_lookahead == n
        self.is_decode = self.num_new_tokens == 1 and self.start == n - 1 and self.seq.is_decode

    @classmethod
    def decode(cls, seq: Sequence, group: SequenceGroup, block_table: list[int]) -> "ScheduledSequence":
        """Run the last sampled token of a sequence in decode (what __post_init__ would find:
        do_sample and is_decode true), without re-deriving it; the scheduler's all-decode path."""
        ss = object.__new__(cls)
        ss.seq = seq
        ss.group = group
        ss.start = seq.num_computed_tokens
        ss.num_new_tokens = 1
        ss.block_table = block_table
        ss.num_lookahead = ss.num_rejected = 0
        ss.do_sample = True
        ss.is_decode = True
        return ss

    @property
    def context_len(self) -> int:
        return self.start + self.num_new_tokens


@dataclass
class SchedulerOutput:
    """One step. The runner applies, in this order: blocks_to_swap_out, blocks_to_swap_in,
    blocks_to_copy, then the forward pass (a block freed by a swap-out may be reused as a
    copy or swap-in destination within the same step)."""
    # Decodes first, then prefill chunks (kernels rely on that order).
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)   # (cpu block, device block)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)      # (src, dst) device blocks, copy-on-write
    preempted: list[SequenceGroup] = field(default_factory=list)
    ignored: list[SequenceGroup] = field(default_factory=list)  # rejected (can never fit); finished with an error
    # The device block tables changed since the previous executed step, when the scheduler keeps
    # a table log (Scheduler.enable_table_log); None otherwise (the runner then rebuilds every table).
    table_changes: TableChanges | None = None

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_lookahead_tokens(self) -> int:
        """Proposed tokens this step verifies (0 unless speculative decoding is on)."""
        return sum(s.num_lookahead for s in self.scheduled)

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
