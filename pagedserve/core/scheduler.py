"""Continuous (iteration-level) batching over a paged or contiguous KV manager.

Each schedule() builds one step, in this order:
  1. running groups, oldest admission first: decodes get a slot (a new block or a copy-on-write);
     when blocks run out, the most recently admitted running group is preempted (swap or recompute,
     core/preemption.py);
  2. running groups still in prefill get the next chunk of their prompt;
  3. if nothing was preempted this step: swapped groups come back (FCFS by admission);
  4. if nothing was preempted and nothing is left swapped: waiting groups are admitted FCFS.
Steps 3 and 4 live in core/admission.py. Under scheduling_policy "priority" (vLLM's) every "oldest
admission" and "FCFS" above reads "lowest priority value, then oldest": running and swapped are
ordered by (priority, admission), waiting by (priority, arrival), so a preemption takes the least
urgent running group; a waiting group never preempts a running one (as vLLM's).
All within max_num_batched_tokens tokens and max_num_seqs sequences. Decodes are listed first.

Overlapped steps (async scheduling): the engine may call schedule() for step N+1 while step N
runs, before N's sampled tokens reach the host. A sequence sampled in N then holds a placeholder
(Sequence.num_inflight_tokens), counted in num_tokens, so it is planned as a decode of that
placeholder and gets its slot like any decode. Invariants that make this safe:
  - at schedule() time every placeholder belongs to the one step in flight (the engine processes
    step N before it schedules N+2), so a preempted sequence is never re-admitted or swapped in
    with a placeholder: neither happens in the step that preempts it;
  - a sequence is never planned past its max_tokens / max_model_len counting placeholders
    (_reached_limit), since those are known ahead;
  - a sequence found finished when N's tokens arrive is freed at once: its N+1 work still runs,
    but every later step that could reuse its blocks is queued behind N+1 on the same device
    stream, and N+1 writes only into the sequence's own last, not yet cached, block.

Speculative decoding: a running single-sequence decode whose seq.spec_token_ids the engine filled
gets lookahead slots for k of them (k trimmed to the token budget left after one token for every
running group still to schedule, and to max_tokens and max_model_len) and runs 1 + k tokens; its
lookahead counts in the token budget and is taken before any prefill.
Lookahead never preempts anyone: if its blocks do not fit with one block left for every decode
still to schedule, the sequence decodes plainly. After
the step, update_after_step counts only verified tokens computed and hands the rejected slots'
blocks back through the KV manager (free_rejected_slots).
"""
from __future__ import annotations

import bisect
import itertools
from collections import deque
from typing import Iterable

from pagedserve.core.admission import ADMISSION_ORDER, PRIORITY_ORDER, WAITING_ORDER, Admission
from pagedserve.core.chunk_cost import CHUNK_ALIGN, chunk_cost, longest_chunk
from pagedserve.core.config import CacheConfig, SchedulerConfig
from pagedserve.core.contiguous import ContiguousKVCacheManager
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.plan import ScheduledSequence, SchedulerOutput
from pagedserve.core.preemption import Preemption
from pagedserve.core.stats import KVCacheStats, MemoryBreakdown
from pagedserve.sequence import Sequence, SequenceGroup, SequenceStatus

RUNNING, WAITING = SequenceStatus.RUNNING, SequenceStatus.WAITING


def make_kv_cache_manager(cache_config: CacheConfig, max_model_len: int):
    """The KV manager named by cache_config.kv_allocator."""
    if cache_config.kv_allocator == "paged":
        return KVCacheManager(cache_config.block_size, cache_config.num_gpu_blocks, cache_config.num_cpu_blocks,
                              enable_prefix_caching=cache_config.enable_prefix_caching,
                              sliding_window=cache_config.sliding_window)
    mode = cache_config.kv_allocator.split("-", 1)[1]
    return ContiguousKVCacheManager(cache_config.block_size, cache_config.num_gpu_blocks, max_model_len, mode)


def _reached_limit(seq: Sequence, group: SequenceGroup, max_model_len: int) -> bool:
    """A sequence whose placeholders already take it to max_tokens or max_model_len: its last
    token is in flight and the step that samples it ends it, so there is nothing left to plan."""
    n = seq.num_inflight_tokens
    if not n:
        return False
    max_tokens = group.sampling_params.max_tokens
    return (max_tokens is not None and len(seq.output_token_ids) + n >= max_tokens) or seq.num_tokens >= max_model_len


class Scheduler(Admission, Preemption):
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.kv_cache_manager = make_kv_cache_manager(cache_config, scheduler_config.max_model_len)
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []   # ascending order_key
        self.swapped: list[SequenceGroup] = []   # ascending order_key
        # fcfs: admission order; priority: (priority, admission) (vLLM's scheduling_policy).
        by_priority = scheduler_config.scheduling_policy == "priority"
        self.order_key = PRIORITY_ORDER if by_priority else ADMISSION_ORDER
        self._arrivals = itertools.count()
        # Finished groups that schedule() found still running (the engine processed a step in flight
        # just before it): freed there, handed back by the next free_finished_seq_groups().
        self._dropped_finished: list[SequenceGroup] = []
        self._admissions = itertools.count()
        # request id -> steps a fresh long prompt has waited while requests near their end drain
        # (core/admission.py; an entry leaves when its group is admitted or aborted).
        self._drain_waits: dict[str, int] = {}
        self.num_preemptions = 0
        self.num_swap_outs = 0   # groups swapped out to CPU (a subset of the preemptions)
        self.num_swap_ins = 0    # groups swapped back in

    # ---- queues --------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def get_num_unfinished_seq_groups(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def add_seq_group(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            seq.status = WAITING
        group.arrived_at = next(self._arrivals)
        if self.scheduler_config.scheduling_policy == "priority":
            self._insert_waiting(group)
        else:
            self.waiting.append(group)

    def _insert_waiting(self, group: SequenceGroup) -> None:
        """Priority policy: waiting in (priority, arrival) order, a preempted group among them too."""
        self.waiting.insert(bisect.bisect_right(self.waiting, WAITING_ORDER(group), key=WAITING_ORDER), group)

    def abort_seq_group(self, request_id: str | Iterable[str]) -> None:
        ids = {request_id} if isinstance(request_id, str) else set(request_id)
        for rid in ids:
            self._drain_waits.pop(rid, None)
        for queue in (self.waiting, self.running, self.swapped):
            for group in [g for g in queue if g.request_id in ids]:
                queue.remove(group)
                for seq in group.seqs:
                    if not seq.status.finished:
                        seq.status = SequenceStatus.FINISHED_ABORTED
                    self.kv_cache_manager.free(seq)

    def enable_table_log(self) -> None:
        """From now on every non-empty SchedulerOutput carries table_changes: the device block tables
        changed since the previous one (core/table_log.py), for a runner that keeps them on the device."""
        self.kv_cache_manager.enable_table_log()

    def fork_seq(self, parent: Sequence, child: Sequence) -> None:
        self.kv_cache_manager.fork(parent, child)

    def free_seq(self, seq: Sequence) -> None:
        self.kv_cache_manager.free(seq)

    def token_arrived(self, seq: Sequence) -> None:
        """A placeholder of seq was replaced by its token (overlapped steps): a block whose last
        token it was, and which is already computed, can now be cached under its content hash."""
        n = seq.num_known_tokens
        if n % self.block_size == 0 and seq.num_computed_tokens >= n:
            self.kv_cache_manager.cache_blocks(seq)

    def drop_finished_waiting(self, group: SequenceGroup) -> None:
        """Take a finished group out of waiting: preempted for recompute while its last token was
        in flight, that token ended it."""
        if group in self.waiting:
            self.waiting.remove(group)

    def free_finished_seq_groups(self) -> list[SequenceGroup]:
        done, self._dropped_finished = self._dropped_finished, []
        # Waiting groups finish only by abort or rejection, which already take them out.
        for queue in (self.running, self.swapped):
            finished = [g for g in queue if g.finished]
            for g in finished:
                queue.remove(g)
                for seq in g.seqs:
                    self.kv_cache_manager.free(seq)
            done.extend(finished)
        return done

    def _drop_finished(self, group: SequenceGroup) -> None:
        """A finished group schedule() takes out of running: freed now, never lost (see above)."""
        for seq in group.seqs:
            self.kv_cache_manager.free(seq)
        self._dropped_finished.append(group)

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._budget = self.scheduler_config.max_num_batched_tokens
        scheduled = self._schedule_all_decodes(out)
        preempted = False
        if scheduled is None:
            scheduled = []
            preempted = self._schedule_running(scheduled, out)

        # 3. swapped groups come back first, 4. then new ones
        if not preempted:
            self._schedule_swapped(scheduled, out)
        if not preempted and not self.swapped:
            self._schedule_waiting(scheduled, out)

        decodes = [s for s in scheduled if s.is_decode]
        out.scheduled = decodes if len(decodes) == len(scheduled) else \
            decodes + [s for s in scheduled if not s.is_decode]
        mgr = self.kv_cache_manager
        # An empty output is never executed: its changes wait in the log for the next step that is.
        if mgr.table_log is not None and not out.is_empty:
            out.table_changes = mgr.table_log.drain(mgr.table_ids)
        return out

    def _schedule_all_decodes(self, out: SchedulerOutput) -> list[ScheduledSequence] | None:
        """Steps 1-2 in one pass when every running group is one sequence in decode and all
        their next slots fit at once: nothing is preempted and nothing is left to prefill, so
        the per-group path would schedule exactly these decodes in this order. None otherwise
        (nothing changed)."""
        kept: list[SequenceGroup] = []
        groups: list[SequenceGroup] = []
        finished: list[SequenceGroup] = []
        seqs: list[Sequence] = []
        max_len = self.scheduler_config.max_model_len
        for group in self.running:
            gs = group.seqs
            if len(gs) != 1:
                return None
            s = gs[0]
            status = s.status
            if status.finished:
                finished.append(group)  # leaves running, as in the per-group path
                continue
            if status is not RUNNING or not s.is_decode or s.spec_token_ids:
                return None
            kept.append(group)
            if s.num_inflight_tokens and _reached_limit(s, group, max_len):
                continue
            groups.append(group)
            seqs.append(s)
        if len(seqs) > self._budget:
            return None
        mgr = self.kv_cache_manager
        copies = mgr.append_decode_slots(seqs)
        if copies is None:
            return None
        out.blocks_to_copy.extend(copies)
        self._budget -= len(seqs)
        self.running = kept
        for group in finished:
            self._drop_finished(group)
        view = mgr.block_table_view
        make = ScheduledSequence.decode
        return [make(s, g, view(s)) for s, g in zip(seqs, groups)]

    def _schedule_running(self, scheduled: list[ScheduledSequence], out: SchedulerOutput) -> bool:
        """Steps 1-2, group by group; returns whether anything was preempted."""
        mgr = self.kv_cache_manager
        max_len = self.scheduler_config.max_model_len
        preempted = False
        remaining: deque[SequenceGroup] = deque()
        for g in self.running:
            if g.finished:
                self._drop_finished(g)
            else:
                remaining.append(g)
        self.running = []
        pending: list[tuple[SequenceGroup, bool]] = []  # (group, already scheduled this step)

        def pick_victim() -> SequenceGroup | None:
            cands = []
            if remaining:
                cands.append(("r", remaining[-1]))
            for i in range(len(pending) - 1, -1, -1):
                if not pending[i][1]:
                    cands.append(("p", i))
                    break
            if not cands:
                return None
            best = max(cands, key=lambda c: self.order_key(remaining[-1] if c[0] == "r" else pending[c[1]][0]))
            if best[0] == "r":
                return remaining.pop()
            return pending.pop(best[1])[0]

        # 1. decodes of running groups
        while remaining:
            group = remaining.popleft()
            seqs = group.seqs
            if len(seqs) == 1:  # the common case, without the list-building below
                s = seqs[0]
                decodes = [s] if s.status is RUNNING and self._budget > 0 and s.is_decode \
                    and not _reached_limit(s, group, max_len) else []
            else:
                decodes = [s for s in seqs if s.status is RUNNING and s.is_decode
                           and not _reached_limit(s, group, max_len)][:self._budget]
            if not decodes:
                pending.append((group, False))
                continue
            if len(seqs) == 1 and decodes[0].spec_token_ids:
                s = decodes[0]
                k = self._lookahead(s, group, len(remaining))
                wants = [(s, 1 + k)]
                # A block spare for each decode still to schedule: lookahead must not preempt them.
                if k and not mgr.exceeds_capacity(group, wants) and mgr.can_append_slots(wants, len(remaining)):
                    scheduled.append(self._run(group, s, 1, out, k))
                    pending.append((group, True))
                    continue
            wants = [(s, 1) for s in decodes]
            if mgr.exceeds_capacity(group, wants):
                self._finish_full(group)
                pending.append((group, True))
                continue
            victim_is_self = False
            while not mgr.can_append_slots(wants):
                victim = pick_victim() or group
                self._preempt(victim, out)
                preempted = True
                if victim is group:
                    victim_is_self = True
                    break
            if victim_is_self:
                continue
            for s in decodes:
                scheduled.append(self._run(group, s, 1, out))
            pending.append((group, True))

        # 2. prefill chunks of running groups
        for group, decoded in pending:
            self.running.append(group)
            if decoded and len(group.seqs) == 1:
                continue  # its one sequence decoded (or finished): no prefill left
            for s in group.seqs:
                if s.status is RUNNING and not s.is_decode:
                    self._schedule_prefill(group, s, scheduled, out)
        return preempted

    def _run(self, group: SequenceGroup, seq: Sequence, n: int, out: SchedulerOutput,
             lookahead: int = 0) -> ScheduledSequence:
        mgr = self.kv_cache_manager
        # The contiguous baselines take no lookahead (the engine refuses speculation with them).
        out.blocks_to_copy.extend(mgr.append_slots(seq, n, lookahead) if lookahead else mgr.append_slots(seq, n))
        self._budget -= n + lookahead
        return ScheduledSequence(seq, group, seq.num_computed_tokens, n + lookahead,
                                 self.kv_cache_manager.block_table_view(seq), lookahead)

    def _lookahead(self, seq: Sequence, group: SequenceGroup, num_later: int) -> int:
        """How many of seq's proposed tokens fit this step: within the token budget, after its own
        token and one for each of the num_later running groups still to schedule (lookahead never
        takes a decode's token), and never past max_tokens or max_model_len once the verification's
        extra token is added (so every accepted token can be kept). 0 while a token is in flight."""
        if seq.num_inflight_tokens:
            return 0
        k = min(len(seq.spec_token_ids), self._budget - 1 - num_later,
                self.scheduler_config.max_model_len - seq.num_tokens - 1)
        max_tokens = group.sampling_params.max_tokens
        if max_tokens is not None:
            k = min(k, max_tokens - len(seq.output_token_ids) - 1)
        return max(k, 0)

    def _schedule_prefill(self, group: SequenceGroup, seq: Sequence, scheduled: list, out: SchedulerOutput) -> None:
        todo = seq.num_uncomputed_tokens
        n = min(todo, self._budget)
        cfg = self.scheduler_config
        cap = cfg.long_prefill_token_threshold
        if 0 < cap < n and cfg.enable_chunked_prefill:
            n = cap  # a long prompt's chunk is capped (vLLM's long_prefill_token_threshold)
        start, k, cost = seq.num_computed_tokens, cfg.attention_cost_context, 0
        # Costs count only beside a decode (they come first in `scheduled`): they bound how long it
        # waits for its token; a step of prefills alone keeps whole chunks, the fastest prefill.
        # Nor for short sequences (attention_cost_min_tokens), whose chunks never cost much.
        if k and (seq.num_tokens < cfg.attention_cost_min_tokens
                  or not any(x.is_decode or x.num_lookahead for x in scheduled)):
            k = 0
        if k and n > 0:  # the chunk's attention over its context counts too (core/chunk_cost.py)
            n = longest_chunk(start, n, self._budget, k)
        align = cfg.long_prefill_chunk_align
        if align and 0 < n < todo and (start + n) // align * align - start >= max(1, min(n // 2, CHUNK_ALIGN)):
            # Cut short by the budget: end on the grid, the rest in the next step. Decodes take a
            # few tokens of every step's budget, so unaligned chunks would drift off the long-prefill
            # path's grid (whole query steps; prefix buckets) and leave part of each prefix to a
            # slower kernel. Never to a sliver (at least half the chunk or CHUNK_ALIGN): at N = 8,192
            # a chunk of 8,191 (the budget less a decode, costs off) after 8,191 would be cut to 1 token.
            n = (start + n) // align * align - start
        if k and n > 0:
            cost = chunk_cost(start, n, k)
        if n <= 0 or (n < todo and not cfg.enable_chunked_prefill):
            return
        if not self.kv_cache_manager.can_append_slots([(seq, n)]):
            return
        scheduled.append(self._run(group, seq, n, out))
        self._budget -= max(0, cost - n)  # _run took n

    def _finish_full(self, group: SequenceGroup) -> None:
        """The group alone outgrew the whole device cache: end it as if it hit max_model_len
        (finish_reason "length") instead of preempting it forever. Engines that size
        max_model_len to the cache, as vLLM does, never get here."""
        for s in group.unfinished_seqs():
            s.status = SequenceStatus.FINISHED_LENGTH
            self.kv_cache_manager.free(s)

    # ---- after the runner ---------------------------------------------------------------------
    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance computed tokens of what ran; newly full blocks become reusable prefix cache. A
        speculative row counts only its verified tokens (ss.num_rejected, set by the engine)."""
        mgr = self.kv_cache_manager
        has_table, cache_blocks, bs = mgr.has_table, mgr.cache_blocks, self.block_size
        for ss in out.scheduled:
            seq = ss.seq
            if seq.status.finished or not has_table(seq):
                continue  # aborted while the step ran
            seq.num_computed_tokens = n = ss.start + ss.num_new_tokens - ss.num_rejected
            if ss.num_lookahead:
                mgr.free_rejected_slots(seq)
            # A decode fills a block only with its block's last slot; otherwise nothing to cache.
            if n % bs == 0 or not ss.is_decode:
                cache_blocks(seq)

    # ---- statistics ---------------------------------------------------------------------------
    def get_memory_breakdown(self) -> MemoryBreakdown:
        return self.kv_cache_manager.memory_breakdown(self.waiting[0] if self.waiting else None)

    def get_kv_cache_stats(self, token_counts: bool = True) -> KVCacheStats:
        """The device KV cache now. token_counts=False leaves num_live_tokens None and skips
        the walk over every block table it needs, so the rest costs O(1) (a per-step snapshot)."""
        mgr = self.kv_cache_manager
        free = mgr.get_num_free_blocks()
        return KVCacheStats(
            block_size=self.block_size,
            num_blocks_total=mgr.num_gpu_blocks,
            num_blocks_free=free,
            num_blocks_cached=mgr.num_cached_free_blocks(),
            num_blocks_used=mgr.num_gpu_blocks - free,
            peak_blocks_used=mgr.peak_blocks_used,
            num_live_tokens=mgr.memory_breakdown().token_states if token_counts else None,
            num_allocated_slots=mgr.num_allocated_slots(),
            num_swapped_blocks=mgr.num_swapped_blocks(),
            prefix_cache_queries=mgr.prefix_cache_queries,
            prefix_cache_hits=mgr.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            cache_dtype=self.cache_config.cache_dtype,
        )
