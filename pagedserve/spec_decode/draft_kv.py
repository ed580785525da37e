"""The draft model's own paged KV bookkeeping: per sequence, its blocks and which tokens they hold.

Torch-free, like core/: the blocks come from a core BlockPool (prefix caching off: draft KV is
never shared) and the device pools live in the proposer's CacheEngine.

Per sequence the draft's cache holds the KV of `num_computed` tokens: the verified tokens it has
seen (`num_verified` of them, a prefix of the sequence's tokens) followed by `speculative`, the
proposals it wrote KV for in its last round (the target may have rejected some of them). On the
next round `match()` keeps the longest prefix that is still the sequence's: the verified part, plus
the proposals the target accepted. Everything after it is stale and is overwritten by the
catch-up forward: rollback lowers the count only; blocks stay with the sequence until `free()`.

Invariants:
- len(blocks) * block_size >= num_computed for every sequence;
- a block is owned by exactly one sequence (ref_cnt 1) or is in the pool's free queue;
- after free(seq_id) the sequence owns nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from pagedserve.core.block_pool import BlockPool
from pagedserve.core.free_queue import KVCacheBlock


@dataclass
class DraftSeqState:
    blocks: list[KVCacheBlock] = field(default_factory=list)
    num_verified: int = 0          # leading tokens known to be the sequence's verified tokens
    last_verified: int = -1        # token id at num_verified - 1 (a cheap check that the prefix is the same)
    speculative: list[int] = field(default_factory=list)  # tokens after num_verified with KV written

    @property
    def num_computed(self) -> int:
        return self.num_verified + len(self.speculative)


class DraftKVManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"draft KV cache: num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"draft KV cache: block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching=False)
        self.seqs: dict[int, DraftSeqState] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def num_free_blocks(self) -> int:
        return self.pool.get_num_free_blocks()

    def match(self, seq_id: int, token_ids: Sequence[int]) -> int:
        """How many leading tokens of token_ids the draft's KV still holds (rolling back any
        rejected proposals). A sequence that is new, or whose verified prefix changed (it cannot,
        unless the caller broke the interface's contract), starts from 0."""
        st = self.seqs.setdefault(seq_id, DraftSeqState())
        n = len(token_ids)
        if st.num_verified and (n < st.num_verified or token_ids[st.num_verified - 1] != st.last_verified):
            st.num_verified, st.last_verified, st.speculative = 0, -1, []
        keep = 0
        for tok in st.speculative:  # at most k - 1 tokens
            if st.num_verified + keep >= n or token_ids[st.num_verified + keep] != tok:
                break
            keep += 1
        del st.speculative[keep:]
        return st.num_computed

    def reserve(self, seq_id: int, num_tokens: int) -> bool:
        """Give the sequence blocks for num_tokens positions; False (nothing taken) if the pool is short."""
        st = self.seqs.setdefault(seq_id, DraftSeqState())
        need = -(-num_tokens // self.block_size) - len(st.blocks)
        if need <= 0:
            return True
        if need > self.pool.get_num_free_blocks():
            return False
        st.blocks.extend(self.pool.get_new_blocks(need))
        return True

    def commit(self, seq_id: int, token_ids: Sequence[int], speculative: Sequence[int]) -> None:
        """After a round: the KV now holds all of token_ids (verified) and then `speculative`."""
        st = self.seqs[seq_id]
        st.num_verified = len(token_ids)
        st.last_verified = int(token_ids[-1]) if len(token_ids) else -1
        st.speculative = list(speculative)
        if st.num_computed > len(st.blocks) * self.block_size:
            raise RuntimeError(f"draft sequence {seq_id}: {st.num_computed} tokens in "
                               f"{len(st.blocks)} blocks of {self.block_size}")

    def block_table(self, seq_id: int) -> list[int]:
        return [b.block_id for b in self.seqs[seq_id].blocks]

    def free(self, seq_id: int) -> None:
        """Return every block of the sequence to the pool (a sequence never seen: nothing to do)."""
        st = self.seqs.pop(seq_id, None)
        if st is not None and st.blocks:
            self.pool.free_blocks(reversed(st.blocks))
