"""The paper's baseline (Orca-like): each sequence reserves one contiguous run of blocks at admission.

The run is found by first fit over the holes between live reservations, so external
fragmentation is real. Its size is the only thing the three variants change:
  contiguous-max     max_model_len tokens
  contiguous-pow2    next power of two of prompt + max_tokens
  contiguous-oracle  prompt + the true output length (SequenceGroup.oracle_output_len,
                     falling back to max_tokens)
The block table handed to the runner is simply the run's block ids, so the same kernels
serve both allocators. No prefix caching, no swap (preemption recomputes), no fork.
"""
from __future__ import annotations

import bisect
from typing import Iterable

from pagedserve.core.block_pool import FREE, RESERVED, USED
from pagedserve.core.kv_cache_manager import AllocStatus, cdiv
from pagedserve.core.stats import MemoryBreakdown, SeqKVLayout, breakdown_from_tables
from pagedserve.core.table_log import TableChangeLog
from pagedserve.sequence import Sequence, SequenceGroup, SequenceStatus

CONTIGUOUS_MODES = ("max", "pow2", "oracle")


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class ContiguousKVCacheManager:
    supports_swap = False
    supports_fork = False
    enable_prefix_caching = False

    def __init__(self, block_size: int, num_gpu_blocks: int, max_model_len: int, mode: str = "max") -> None:
        if mode not in CONTIGUOUS_MODES:
            raise ValueError(f"contiguous mode must be one of {CONTIGUOUS_MODES}, got {mode!r}")
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.max_model_len = max_model_len
        self.mode = mode
        self._holes: list[list[int]] = [[0, num_gpu_blocks]] if num_gpu_blocks else []  # [start, length], by start
        self._runs: dict[int, tuple[int, int]] = {}  # seq_id -> (start block, num blocks)
        self._views: dict[int, tuple[tuple[int, int], list[int]]] = {}
        self._seqs: dict[int, Sequence] = {}
        self._final_len: dict[int, int] = {}
        self.num_free_blocks = num_gpu_blocks
        self.peak_blocks_used = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.table_log: TableChangeLog | None = None  # see KVCacheManager.enable_table_log

    # ---- sizing --------------------------------------------------------------------------
    def _output_budget(self, group: SequenceGroup, seq: Sequence) -> int:
        mt = group.sampling_params.max_tokens
        return mt if mt is not None else self.max_model_len - seq.num_prompt_tokens

    def final_len(self, group: SequenceGroup, seq: Sequence) -> int:
        """The length the sequence will really reach (as far as the allocator can know)."""
        out = group.oracle_output_len if group.oracle_output_len is not None else self._output_budget(group, seq)
        return max(seq.num_tokens, min(self.max_model_len, seq.num_prompt_tokens + out))

    def reservation_tokens(self, group: SequenceGroup, seq: Sequence) -> int:
        if self.mode == "max":
            want = self.max_model_len
        elif self.mode == "pow2":
            want = next_pow2(seq.num_prompt_tokens + self._output_budget(group, seq))
        else:
            want = self.final_len(group, seq)
        # Always room for the known tokens plus the next one, never past the model's context.
        return max(seq.num_tokens, min(self.max_model_len, max(want, seq.num_tokens + 1)))

    def _reservation_blocks(self, group: SequenceGroup) -> list[int]:
        return [cdiv(self.reservation_tokens(group, s), self.block_size)
                for s in group.seqs_with_status(SequenceStatus.WAITING)]

    # ---- holes -------------------------------------------------------------------------
    def _first_fit(self, n: int) -> int | None:
        for i, (start, length) in enumerate(self._holes):
            if length >= n:
                return i
        return None

    def _take(self, n: int) -> int:
        i = self._first_fit(n)
        if i is None:
            raise ValueError(f"no contiguous run of {n} free blocks")
        start = self._holes[i][0]
        self._holes[i][0] += n
        self._holes[i][1] -= n
        if self._holes[i][1] == 0:
            del self._holes[i]
        self.num_free_blocks -= n
        self.peak_blocks_used = max(self.peak_blocks_used, self.num_gpu_blocks - self.num_free_blocks)
        return start

    def _give_back(self, start: int, n: int) -> None:
        i = bisect.bisect_left(self._holes, [start, 0])
        self._holes.insert(i, [start, n])
        if i + 1 < len(self._holes) and start + n == self._holes[i + 1][0]:
            self._holes[i][1] += self._holes.pop(i + 1)[1]
        if i > 0 and self._holes[i - 1][0] + self._holes[i - 1][1] == start:
            self._holes[i - 1][1] += self._holes.pop(i)[1]
        self.num_free_blocks += n

    # ---- manager interface ----------------------------------------------------------------
    def get_block_table(self, seq: Sequence) -> list[int]:
        start, n = self._runs[seq.seq_id]
        return list(range(start, start + n))

    def block_table_view(self, seq: Sequence) -> list[int]:
        """The table without a copy per step (a run never moves): callers must not modify it."""
        run = self._runs[seq.seq_id]
        cached = self._views.get(seq.seq_id)
        if cached is None or cached[0] != run:
            cached = self._views[seq.seq_id] = (run, list(range(run[0], run[0] + run[1])))
        return cached[1]

    def has_table(self, seq: Sequence) -> bool:
        return seq.seq_id in self._runs

    def enable_table_log(self) -> TableChangeLog:
        """Record every new and freed reservation from now on (a run never changes in between)."""
        self.table_log = TableChangeLog(self._runs)
        return self.table_log

    def table_ids(self, seq_id: int) -> list[int]:
        return self.block_table_view(self._seqs[seq_id])

    def get_num_free_blocks(self) -> int:
        return self.num_free_blocks

    def can_allocate(self, group: SequenceGroup) -> AllocStatus:
        sizes = self._reservation_blocks(group)
        if sum(sizes) > self.num_gpu_blocks:
            return AllocStatus.NEVER
        holes = [h[1] for h in self._holes]
        for n in sizes:  # first fit, trial run
            for i, length in enumerate(holes):
                if length >= n:
                    holes[i] -= n
                    break
            else:
                return AllocStatus.LATER
        return AllocStatus.OK

    def allocate(self, group: SequenceGroup) -> None:
        for seq in group.seqs_with_status(SequenceStatus.WAITING):
            if seq.seq_id in self._runs:
                raise ValueError(f"seq {seq.seq_id} already has a reservation")
            n = cdiv(self.reservation_tokens(group, seq), self.block_size)
            self._runs[seq.seq_id] = (self._take(n), n)
            self._seqs[seq.seq_id] = seq
            if self.table_log is not None:
                self.table_log.replaced(seq.seq_id)
            self._final_len[seq.seq_id] = self.final_len(group, seq)
            seq.num_computed_tokens = 0

    def can_append_slots(self, seqs: Iterable[tuple[Sequence, int]]) -> bool:
        return all(s.num_computed_tokens + n <= self._runs[s.seq_id][1] * self.block_size for s, n in seqs)

    def exceeds_capacity(self, group: SequenceGroup, seqs: Iterable[tuple[Sequence, int]]) -> bool:
        return any(s.num_computed_tokens + n > self.num_gpu_blocks * self.block_size for s, n in seqs)

    def append_decode_slots(self, seqs: list[Sequence]) -> list[tuple[int, int]] | None:
        """[] when every decode's next slot is inside its reservation, else None (nothing changed)."""
        runs, bs = self._runs, self.block_size
        return [] if all(s.num_computed_tokens < runs[s.seq_id][1] * bs for s in seqs) else None

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        if not self.can_append_slots([(seq, num_new_tokens)]):
            raise ValueError(f"seq {seq.seq_id} outgrew its contiguous reservation")
        return []

    def fork(self, parent: Sequence, child: Sequence) -> None:
        raise ValueError("the contiguous KV allocator does not support n > 1 / best_of > 1 "
                         "(no block sharing); use kv_allocator='paged'")

    def cache_blocks(self, seq: Sequence) -> None:
        return None

    def free(self, seq: Sequence) -> None:
        run = self._runs.pop(seq.seq_id, None)
        self._views.pop(seq.seq_id, None)
        if run is not None:
            self._give_back(*run)
            if self.table_log is not None:
                self.table_log.removed(seq.seq_id)
        self._seqs.pop(seq.seq_id, None)
        self._final_len.pop(seq.seq_id, None)

    def reset_prefix_cache(self) -> bool:
        return True

    def can_swap_out(self, group: SequenceGroup) -> bool:
        return False

    def can_swap_in(self, group: SequenceGroup) -> bool:
        return False

    def swap_out(self, group: SequenceGroup) -> list[tuple[int, int]]:
        raise ValueError("the contiguous KV allocator does not swap; preemption recomputes")

    swap_in = swap_out

    # ---- statistics -------------------------------------------------------------------
    def num_allocated_slots(self) -> int:
        return (self.num_gpu_blocks - self.num_free_blocks) * self.block_size

    def num_swapped_blocks(self) -> int:
        return 0

    def num_cached_free_blocks(self) -> int:
        return 0

    def free_holes(self) -> list[tuple[int, int]]:
        return [(s, n) for s, n in self._holes]

    def block_states(self) -> str:
        """Each block's state, by block id, one letter each (core/kv_state.py's STATE_CODES): free,
        used (a reservation's blocks up to its known tokens) or reserved (held by a reservation, no
        token in it yet)."""
        states = bytearray([FREE]) * self.num_gpu_blocks
        bs = self.block_size
        for sid, (start, n) in self._runs.items():
            used = min(n, cdiv(self._seqs[sid].num_tokens, bs))
            states[start:start + used] = bytes([USED]) * used
            states[start + used:start + n] = bytes([RESERVED]) * (n - used)
        return states.decode("ascii")

    def cpu_block_states(self) -> tuple[int, dict[int, str]]:
        return 0, {}

    def cpu_block_table(self, seq: Sequence) -> list[int] | None:
        return None

    def seq_layouts(self) -> list[SeqKVLayout]:
        """A snapshot of every reserved run, in admission order (for figures)."""
        return [SeqKVLayout(sid, self.get_block_table(s), s.num_computed_tokens, self._final_len[sid])
                for sid, s in self._seqs.items()]

    def memory_breakdown(self, waiting_head: SequenceGroup | None = None) -> MemoryBreakdown:
        """Reserved = slots up to the final length; internal = beyond it; external = free
        blocks in holes too small for the reservation the head of the waiting queue needs."""
        entries = [(range(self._runs[sid][0], sum(self._runs[sid])),
                    s.num_computed_tokens, self._final_len[sid], False)
                   for sid, s in self._seqs.items()]
        out = breakdown_from_tables(entries, self.block_size)
        if waiting_head is not None:
            sizes = self._reservation_blocks(waiting_head)
            if sizes:
                need = max(sizes)
                out.external_fragmentation = self.block_size * sum(n for _, n in self._holes if n < need)
        return out
