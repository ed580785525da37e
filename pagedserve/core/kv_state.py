"""A plain-data snapshot of the KV cache for the dashboard: block states, block tables, counters.

The snapshot is built from the scheduler and its KV manager and holds only dicts, lists,
strings and numbers (JSON as is). It costs O(blocks), so callers take it a few times a
second at most, never per step. Invariants a snapshot satisfies (tests/core check them):
- states is a str with one letter per block (STATE_CODES; state_names() spells them out):
  len(states) == num_blocks, each one of BLOCK_STATES (contiguous allocators add "reserved").
  One letter rather than a list of names: the snapshot crosses to the API server and on to the
  page a few times a second, and 65,536 strings cost milliseconds at every hop;
- cpu_states maps the id (a string, as JSON keys are) of every swapped-out CPU block to used or
  shared; the other num_cpu_blocks CPU blocks are free;
- a block is "used" or "shared" iff some table of a running request lists it, and "shared"
  iff its reference count (table entries pointing at it) is above one;
- stats are the scheduler's KVCacheStats at the same instant.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from pagedserve.core import block_pool
from pagedserve.sequence import SequenceStatus

BLOCK_STATES = ("free", "used", "shared", "cached")
CONTIGUOUS_STATES = ("free", "used", "reserved")
STATE_CODES = {"free": chr(block_pool.FREE), "used": chr(block_pool.USED), "shared": chr(block_pool.SHARED),
               "cached": chr(block_pool.CACHED), "reserved": chr(block_pool.RESERVED)}
STATE_NAMES = {c: name for name, c in STATE_CODES.items()}


def state_names(states: str) -> list[str]:
    """A snapshot's states, one name per block (the public JSON's spelling)."""
    return [STATE_NAMES[c] for c in states]


def _seq_entry(mgr: Any, seq: Any) -> dict | None:
    if mgr.has_table(seq):
        table, where = mgr.get_block_table(seq), "gpu"
    else:
        table, where = mgr.cpu_block_table(seq), "cpu"
        if table is None:
            return None
    return {"seq_id": seq.seq_id, "num_tokens": seq.num_tokens,
            "num_computed_tokens": seq.num_computed_tokens, "where": where, "block_table": table}


def contiguous_would_need(groups: list, max_model_len: int) -> dict[str, int]:
    """Slots that per-sequence contiguous reservations would hold for these requests.

    max_model_len: every sequence reserves the model's context (vLLM-style / Orca-max);
    prompt_plus_max_tokens: every sequence reserves its prompt plus its max_tokens.
    """
    by_max = by_request = 0
    for g in groups:
        for s in g.unfinished_seqs():
            by_max += max_model_len
            by_request += min(max_model_len, s.num_prompt_tokens + (g.sampling_params.max_tokens or 0))
    return {"max_model_len": by_max, "prompt_plus_max_tokens": by_request}


def kv_cache_state(scheduler: Any) -> dict[str, Any]:
    """The KV cache right now, as plain data (see the module docstring); snapshot_s is what
    taking it cost, so callers can keep their rate within a budget."""
    started = time.perf_counter()
    mgr = scheduler.kv_cache_manager
    stats = scheduler.get_kv_cache_stats(token_counts=False)
    states = mgr.block_states()
    requests = []
    for status, groups in (("running", scheduler.running), ("swapped", scheduler.swapped)):
        for g in groups:
            seqs = [e for s in g.seqs if not s.status.finished and (e := _seq_entry(mgr, s)) is not None]
            if seqs:
                requests.append({"request_id": g.request_id, "status": status,
                                 "prompt_len": len(g.prompt_token_ids),
                                 "max_tokens": g.sampling_params.max_tokens, "seqs": seqs})
    if STATE_CODES["shared"] in states or getattr(mgr, "sliding_window", 0):
        # shared blocks count once; a sliding window's freed blocks not at all
        stats.num_live_tokens = mgr.memory_breakdown().token_states
    else:  # the same number without walking every table: no block is counted twice
        stats.num_live_tokens = sum(s["num_computed_tokens"] for r in requests for s in r["seqs"]
                                    if s["where"] == "gpu")
    max_model_len = scheduler.scheduler_config.max_model_len
    num_cpu_blocks, cpu_states = mgr.cpu_block_states()
    state = {
        "allocator": scheduler.cache_config.kv_allocator,
        "num_blocks": mgr.num_gpu_blocks,
        "block_size": mgr.block_size,
        "max_model_len": max_model_len,
        "states": states,
        "num_cpu_blocks": num_cpu_blocks,
        "cpu_states": {str(i): st for i, st in sorted(cpu_states.items())},
        "requests": requests,
        "num_running": scheduler.num_running,
        "num_waiting": scheduler.num_waiting,
        "num_swapped": scheduler.num_swapped,
        "num_running_seqs": sum(1 for g in scheduler.running for s in g.seqs
                                if s.status is SequenceStatus.RUNNING),
        "num_swap_outs": scheduler.num_swap_outs,
        "num_swap_ins": scheduler.num_swap_ins,
        "stats": dict(dataclasses.asdict(stats), prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
                      usage=stats.usage),
        "contiguous_would_need": contiguous_would_need(scheduler.running, max_model_len),
    }
    state["snapshot_s"] = time.perf_counter() - started
    return state


def block_owners(state: dict[str, Any], where: str = "gpu") -> dict[int, list[list]]:
    """block id -> [[request_id, seq_id, logical block index], ...] from a snapshot's tables."""
    owners: dict[int, list[list]] = {}
    for r in state["requests"]:
        for s in r["seqs"]:
            if s["where"] != where:
                continue
            for i, b in enumerate(s["block_table"]):
                owners.setdefault(b, []).append([r["request_id"], s["seq_id"], i])
    return owners
