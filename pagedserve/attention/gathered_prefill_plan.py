"""The gathered long-prefill path's host-side plan (gathered_prefill.py runs the path; its docstring
says why): the thresholds and buckets; which of a step's prefill chunks take the path (takes,
long_chunks; the other sequences go to the Triton kernels in other_ranges' runs); where a chunk's
pages lie in one run of the pool, to be read in place (page_run_start, page_runs: the runner's
host check, AttentionMetadata.page_runs); and the query buckets a chunk is padded to (bucket,
query_rows: a square plan each). All from host values: nothing here touches the device.

gathered_prefill.py and gathered_prefill_switches.py read the thresholds and buckets as
gathered_prefill_plan.X at every use: a test that shrinks them here, or a benchmark that sets
MIN_PREFIX here, reaches the whole path.
"""
from __future__ import annotations

import torch

PREFIX_BUCKET = 8192
QUERY_BUCKET = 1024
TAIL_STEP = 1024  # core/chunk_cost.CHUNK_ALIGN: aligned chunks leave tails of whole steps
# A chunk after fewer earlier tokens stays on the Triton kernel (or, as a first chunk, takes the
# square alone). 16,384 until the 36th session: the H200's serving budget cuts a 32k prompt into
# 8,192-token chunks, and the second (8,192 earlier) then ran on our kernel (~400 TFLOPS against
# cuDNN's ~600, ~1.6 TFLOP a layer), about 3% of the prompt's prefill (docs/long-context.md).
MIN_PREFIX = 8192
MIN_CHUNK = 1024
MAX_PAGE = 1024  # config.CacheConfig's largest block_size


def page_run_start(table: list[int], num_pages: int) -> int | None:
    """The first block id of table[:num_pages] where those pages are one run of ascending ids
    (first, first + 1, ...), else None."""
    if num_pages <= 0 or len(table) < num_pages:
        return None
    first = table[0]
    if table[num_pages - 1] - first != num_pages - 1:
        return None
    return first if table[:num_pages] == list(range(first, first + num_pages)) else None


def page_runs(block_tables: list[list[int]], query_lens: list[int], seq_lens: list[int], num_decodes: int,
              block_size: int) -> dict[int, int] | None:
    """AttentionMetadata.page_runs from the step's host tables: for each prefill sequence with a
    chunk long enough for this path (MIN_CHUNK tokens), the first block of its pages through the
    chunk where they lie in one run; None where there is none (one list compare per long chunk)."""
    runs = {}
    for i in range(num_decodes, len(block_tables)):
        if query_lens[i] >= MIN_CHUNK:
            first = page_run_start(block_tables[i], -(-seq_lens[i] // block_size))
            if first is not None:
                runs[i] = first
    return runs or None


def takes(query_len: int, seq_len: int, first_chunk: int = 0) -> bool:
    """Whether a prefill chunk of query_len new tokens ending at seq_len takes this path: after at
    least MIN_PREFIX tokens; with first_chunk > 0 (FIRST_CHUNK_ENV) also a chunk of at least that
    many tokens after fewer than PREFIX_BUCKET (no prefix head, so no plan but the square's)."""
    prefix = seq_len - query_len
    if query_len >= MIN_CHUNK and prefix >= MIN_PREFIX:
        return True
    return 0 < first_chunk <= query_len and prefix < PREFIX_BUCKET


def long_chunks(meta, k_cache: torch.Tensor, first_chunk: int = 0) -> list[int]:
    """The step's prefill sequences (indices) that take this path: from the host lengths, never a
    sync; none from an fp8 pool (its scales are the Triton kernels')."""
    if meta.query_lens_cpu is None or meta.seq_lens_cpu is None or k_cache.element_size() == 1:
        return []
    return [i for i in range(meta.num_decodes, meta.num_seqs)
            if takes(meta.query_lens_cpu[i], meta.seq_lens_cpu[i], first_chunk)]


def other_ranges(first: int, end: int, skip: list[int]) -> list[tuple[int, int]]:
    """[first, end) less the sequences in skip, as (first, count) runs of consecutive sequences."""
    runs, start = [], first
    for i in sorted(skip) + [end]:
        if i > start:
            runs.append((start, i - start))
        start = i + 1
    return runs


def bucket(n: int, step: int) -> int:
    return -(-n // step) * step


def query_rows(max_tokens: int) -> range:
    """The query buckets a chunk of at most max_tokens tokens can meet (each a square plan)."""
    return range(QUERY_BUCKET, bucket(max_tokens, QUERY_BUCKET) + 1, QUERY_BUCKET)
