"""The start-up warm-up: every kernel variant serving can meet runs once before the core is Ready.

Lazy work otherwise lands on the first requests: Triton compiles a kernel the first time it sees
a new specialisation (a constexpr value such as the decode kernel's NUM_SPLITS, an integer's value
class), cuBLAS loads the GEMM kernel it picks for a new token count, a CUDA graph uploads on its
first replay, and torch loads each sampling kernel on first use. warm_up runs, on the runner's
own pools and with synthetic inputs identical on every tensor-parallel rank (so collectives
match):

- prefills without context over token counts 1, 2, 4, ... up to max_num_batched_tokens;
- for MoE models, the grouped GEMM at every token count that selects another block-size config;
- for FP8 linears on the Triton GEMM (PAGEDSERVE_FP8_GEMM triton / auto), every config bucket;
- prefill chunks with prior context (a prefix hit or a chunk continuation), sampling or not;
- decode-only steps of every graph bucket size (graph replays; eager steps under enforce_eager),
  one with its tokens fed from a previous step's sampled ids on the device (overlapped steps);
- mixed batches (decodes + a prefill chunk), one for every decode split count the attention
  backend can choose; and the same variants once more straight through the backend's
  paged_attention, for each sliding window and soft cap the layers have: with CUDA graphs those warm-up steps replay a graph (decode rows), while
  serving meets the variants eagerly too (decodes beside a longer chunk, between piecewise
  graphs, or beyond the buckets), so routing must not decide what gets compiled;
- every sampler path (greedy, temperature, top-k, top-p, both, min-p, seeds, logprobs,
  penalties, suppressed tokens) at one row and at max_num_seqs rows, on logits of the model's
  dtype (the fused plain-path kernels compile per dtype), and the host copy;
- where the gathered long-prefill path is on (Hopper by default; PAGEDSERVE_LONG_PREFILL), every
  bucketed shape a long chunk's cuDNN call can meet (attention/gathered_prefill.py: a plan per shape);
- a swap out, a swap in and a block copy;
- the incremental path's input preparation (request_state.py) on a throwaway device state, a
  prefill step and a decode-only one: the steps above take the host-built path, and torch loads
  each of its index and integer kernels on first use (the slots' floor division and remainder
  took 21 and 30 ms on an H100: the first request after start-up paid them, 61st session).

FP8 KV scales: every forward and _attention_variants pass the layers' own k_scale / v_scale,
whose shape ([1] or [num_kv_heads]) loading and calculate_kv_scales settle before the warm-up,
so it compiles the per-tensor or the per-head kernels (KV_SCALE_PER_HEAD), whichever serving runs.
An fp8 pool's decode launch (decode_plan.decode_launch_for: its BLOCK_N, warps, stages, the f16 cast)
is chosen inside paged_attention from the pool's dtype, once per process, so the same steps compile
the launch serving runs, whichever DECODE_FP8_LAUNCH or its switch selects.

Invariant: afterwards the engine is as if nothing had run. The runner holds no scheduler, KV
manager, prefix cache or stats, so those are untouched by construction; the device pool is
zeroed again (it is allocated zeroed), the sampler draws from generators of its own, and the
global RNG states are restored.
"""
from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch

from pagedserve.attention.backend import Attention, get_backend
from pagedserve.attention.gathered_prefill import active as active_gathered, warm_up_plans
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.layers.fused_moe.warmup import warm_up_moe
from pagedserve.layers.quant.fp8_gemm_warmup import warm_up_fp8_gemm
from pagedserve.layers.sampler import Sampler, SampleRow
from pagedserve.runner.async_output import AsyncHostCopy
from pagedserve.runner.batch import HostBatch, ModelInput
from pagedserve.runner.cuda_graph import batch_buckets
from pagedserve.runner.request_state import DeviceRequestState
from pagedserve.runner.row_tracker import RowInputs
from pagedserve.runner.runner_view import RunnerView
from pagedserve.runner.step_input import StepInput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
# "auto" (default): warm up on CUDA only; "1": on CPU too (tests); "0": never (A/B of start-up).
WARMUP_ENV = "PAGEDSERVE_WARMUP"
# A fixed seed for the warm-up's own random logits and generators.
_SEED = 1234


def warmup_enabled(device: torch.device) -> bool:
    mode = os.environ.get(WARMUP_ENV, "auto").strip().lower()
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"{WARMUP_ENV} must be auto, 0 or 1, got {mode!r}")
    return mode == "1" or (mode == "auto" and device.type == "cuda")


class _Steps:
    """Synthetic StepInputs on the runner's pool: block ids wrap around the pool (several tokens
    may write one slot; the pool is zeroed afterwards), token ids are a fixed pattern."""

    def __init__(self, runner: RunnerView, max_model_len: int):
        self.block_size = runner.block_size
        self.num_blocks = runner.cache_engine.num_gpu_blocks
        self.vocab = runner.vocab_size
        self.max_model_len = max_model_len

    def table(self, seq_len: int, offset: int) -> list[int]:
        n = -(-seq_len // self.block_size)
        return [(offset + i) % self.num_blocks for i in range(n)]

    def step(self, seqs: list[tuple[int, int, bool]], num_decodes: int,
             placeholders: bool = False) -> "StepInput":
        """seqs: (start, query_len, samples) per sequence, decodes first."""
        starts = np.array([s for s, _, _ in seqs], dtype=np.int64)
        query_lens = np.array([q for _, q, _ in seqs], dtype=np.int64)
        total = int(query_lens.sum())
        ids = (np.arange(total, dtype=np.int64) * 7919 + 11) % self.vocab
        tables = [self.table(s + q, 3 * i) for i, (s, q, _) in enumerate(seqs)]
        mask = np.array([smp for _, _, smp in seqs], dtype=bool)
        dst = src = None
        if placeholders:
            dst = src = np.arange(num_decodes, dtype=np.int64)
        batch = HostBatch(ids, starts, query_lens, tables, mask, num_decodes, dst, src)
        return StepInput([], [], [], batch)

    def meta(self, seqs: list[tuple[int, int]], num_decodes: int, device: torch.device) -> AttentionMetadata:
        """Attention metadata of (start, query_len) sequences, decodes first, writing no slot."""
        q_lens = [q for _, q in seqs]
        s_lens = [s + q for s, q in seqs]
        tables = [self.table(L, 3 * i) for i, L in enumerate(s_lens)]
        width = max(len(t) for t in tables)
        i32 = dict(dtype=torch.int32, device=device)
        return AttentionMetadata(
            slot_mapping=torch.full((sum(q_lens),), -1, dtype=torch.long, device=device),
            query_start_loc=torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), **i32),
            seq_lens=torch.tensor(s_lens, **i32),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], **i32),
            num_decodes=num_decodes, max_query_len=max(q_lens), max_seq_len=max(s_lens),
            block_size=self.block_size, query_lens_cpu=q_lens, seq_lens_cpu=s_lens)


def _token_counts(max_tokens: int) -> list[int]:
    counts, t = [], 1
    while t < max_tokens:
        counts.append(t)
        t *= 2
    return counts + [max_tokens]


def _prefill(total: int, max_len: int, max_seqs: int) -> list[tuple[int, int, bool]]:
    """`total` new tokens as prompts of at most max_len tokens each (at most max_seqs of them)."""
    n = min(max_seqs, -(-total // max_len))
    lens = [total // n + (1 if i < total % n else 0) for i in range(n)]
    return [(0, q, True) for q in lens]


def _split_variants(runner: RunnerView, max_seqs: int, max_len: int) -> dict:
    """compile key -> (decodes, context length) giving it, for every variant the backend's decode
    kernels can be compiled for in a mixed batch (its decode plan's decode_compile_key; an empty
    dict: a backend without a decode plan has no such choice)."""
    plan = getattr(get_backend(runner.device), "decode_plan", None)
    if plan is None:
        return {}
    key_of = plan.decode_compile_key
    tokens = plan.decode_split_tokens()
    # The keys change where a length crosses a multiple of 256 (MIN_TOKENS_PER_SPLIT, at most
    # 64 splits) or, with length-aware splits of a fixed size, of that size.
    lens = {min(max_len, max(1, 256 * k)) for k in range(0, 65)} | {max_len}
    if tokens > 0:
        lens |= {min(max_len, tokens * k) for k in range(1, min(plan.MAX_SPLITS, -(-max_len // tokens)) + 2)}
    found: dict = {}
    for n in range(1, max_seqs + 1):
        for seq_len in sorted(lens):
            found.setdefault(key_of(n, runner.num_kv_heads, seq_len, runner.device), (n, seq_len))
    return found


def _attention_variants(runner: RunnerView, steps: _Steps, variants: dict, chunk: tuple[int, int]) -> None:
    """Each decode split variant (n decodes of seq_len, beside the chunk (start, query_len)) through
    the backend directly, on layer 0's pools (nothing is written: every slot is -1), once for each
    sliding window and score soft cap the layers have (each a compiled variant of its own: 0, none,
    included)."""
    by_window = {}
    for m in runner.model.modules():
        if isinstance(m, Attention):
            by_window.setdefault((m.sliding_window, m.logit_softcap), m)
    k_cache, v_cache = runner.cache_engine.kv_caches[0]
    ops = get_backend(runner.device)
    gen = torch.Generator(device=runner.device)
    gen.manual_seed(_SEED)
    for attn in by_window.values():
        for n, seq_len in variants.values():
            seq_len = min(seq_len, steps.max_model_len)
            meta = steps.meta([(seq_len - 1, 1)] * n + [chunk], n, runner.device)
            q = torch.randn(n + chunk[1], attn.num_heads, attn.head_dim, generator=gen, device=runner.device,
                            dtype=torch.float32).to(runner.dtype)
            ops.paged_attention(q, k_cache, v_cache, meta, attn.scale, k_scale=attn.k_scale, v_scale=attn.v_scale,
                                window=attn.sliding_window, softcap=attn.logit_softcap)


def _sampler_paths(device: torch.device, vocab: int, max_seqs: int, dtype: torch.dtype) -> None:
    """Logits in the runner's dtype, as steps hand them over (the fused kernels compile per dtype)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(_SEED)
    sampler = Sampler(gen)
    variants = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=0.8, top_k=20),
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9),
        SamplingParams(temperature=0.8, min_p=0.05),
        SamplingParams(temperature=0.8, seed=7),
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.8, logprobs=0),
        SamplingParams(temperature=0.8, repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.5),
    ]
    for rows in sorted({1, max_seqs}):
        logits = torch.randn(rows, vocab, generator=gen, device=device, dtype=torch.float32).to(dtype)
        for temps in ([0.0] * rows, [0.8] * rows, [0.5 + 0.5 * (i % 2) for i in range(rows)]):
            AsyncHostCopy(sampler.sample_plain_device(logits, temps)).result()
        for params in variants + [None]:
            sample_rows = []
            for i in range(rows):
                p = params or variants[i % len(variants)]  # None: every path in one batch
                seeded = None
                if p.seed is not None:
                    seeded = torch.Generator(device=device)
                    seeded.manual_seed(p.seed + i)
                sample_rows.append(SampleRow(i, p, [1, 2, 3], [4, 5], seeded, [6] if i % 3 == 0 else []))
            sampler.sample_device(logits, sample_rows).to_host()


def _device_state_inputs(steps: _Steps, device: torch.device) -> list[ModelInput]:
    """A prefill step (a row cleared, table entries written, one sequence not sampling) and then
    a decode-only step (a row's computed count set) through DeviceRequestState.prepare, on a state
    of its own: the runner's request_state is untouched. Returns their ModelInputs (for tests)."""
    bs = steps.block_size
    prefill = steps.step([(0, 3, True), (bs + 1, 2, False)], 0).batch
    decode = steps.step([(3, 1, True), (bs + 3, 1, True)], 2).batch
    # Both steps' tables (steps.table's blocks, as steps.step lays them), written before the first.
    tables = decode.block_tables
    i64 = dict(dtype=np.int64)
    e_rows = np.array([r for r, t in enumerate(tables) for _ in t], **i64)
    e_cols = np.array([c for t in tables for c in range(len(t))], **i64)
    e_vals = np.array([b for t in tables for b in t], dtype=np.int32)
    rows, none, cols = np.array([0, 1], **i64), np.zeros(0, **i64), max(len(t) for t in tables)
    state = DeviceRequestState(2, 1, device)
    first = state.prepare(RowInputs(2, cols, np.array([1], **i64), e_rows, e_cols, e_vals, rows,
                                    np.array([len(t) for t in prefill.block_tables], **i64), none, none), prefill, bs)
    second = state.prepare(RowInputs(2, cols, none, none, none, np.zeros(0, dtype=np.int32), rows,
                                     np.array([len(t) for t in tables], **i64), np.array([1], **i64),
                                     np.array([bs + 3], **i64)), decode, bs)
    return [first, second]


@torch.inference_mode()
def warm_up(runner: RunnerView) -> float:
    """Run every variant once (see the module docstring); returns the seconds it took."""
    t0 = time.perf_counter()
    cfg = runner.config
    sched = cfg.scheduler_config(runner.max_model_len)
    max_len, max_seqs = runner.max_model_len, sched.max_num_seqs
    max_tokens = sched.max_num_batched_tokens
    steps = _Steps(runner, max_len)
    dev = runner.device
    fork_devices = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=fork_devices):
        run = runner.execute_model
        # Prefills from position 0, over the token counts cuBLAS picks kernels by.
        for total in _token_counts(min(max_tokens, max_seqs * max_len)):
            run(steps.step(_prefill(total, max_len, max_seqs), 0))
        # The MoE grouped GEMM's block-size configs that the counts above skip (fused_moe/warmup.py).
        warm_up_moe(runner.model, min(max_tokens, max_seqs * max_len))
        # The Triton FP8 GEMM's configs that the counts above skip (layers/quant/fp8_gemm_warmup.py).
        warm_up_fp8_gemm(runner.model, min(max_tokens, max_seqs * max_len), runner.dtype)
        # A chunk after context (a prefix hit, a chunk continuation, mid-block): sampling and not.
        chunk = max(1, min(max_tokens, max_len // 2, 64))
        start = max(0, min(max_len - chunk, steps.block_size + 1))
        run(steps.step([(start, chunk, True)], 0))
        run(steps.step([(start, chunk, False)], 0))
        # Decode-only steps at every bucket size, each again with its tokens fed on the device.
        ctx = max(1, min(max_len - 1, 2 * steps.block_size + 3))
        for b in batch_buckets(max_seqs, runner.config.cuda_graph_sizes):
            if b > max_tokens:
                break
            logits = run(steps.step([(ctx - 1, 1, True)] * b, b))
            # A tensor-parallel rank other than 0 may get no logits: any ids serve as placeholders.
            sampled = torch.zeros(b, dtype=torch.long, device=dev) if logits is None else logits.argmax(dim=-1)
            run(steps.step([(ctx - 1, 1, True)] * b, b, placeholders=True), sampled)
        # Mixed batches: decodes beside a prefill chunk, for every split count the decodes can get.
        if max_seqs > 1 and max_tokens > 1:
            variants = _split_variants(runner, min(max_seqs - 1, max_tokens - 1), max_len) or {1: (1, ctx)}
            for n, seq_len in variants.values():
                seq_len = min(seq_len, max_len)
                run(steps.step([(seq_len - 1, 1, True)] * n + [(start, 1, True)], n))
            _attention_variants(runner, steps, variants, (start, chunk))
        # Long chunks over their gathered context (where gathered_prefill.configure turned it on):
        # every bucketed shape's cuDNN plan.
        gathered = active_gathered(runner.cache_engine.kv_caches[0][0].device)
        if gathered is not None:
            attn = next(m for m in runner.model.modules() if isinstance(m, Attention))
            # The models' queries are views of their fused qkv: rows (H + 2 Hkv) * D apart.
            q_row = (attn.num_heads + 2 * attn.num_kv_heads) * attn.head_dim
            n = warm_up_plans(gathered, max_tokens, attn.num_heads, attn.scale, q_row_stride=q_row)
            logger.info("long-prefill plans built: %d shapes", n)
        # Cache operations: copy-on-write and a swap round trip.
        ce = runner.cache_engine
        ce.copy([(0, min(1, ce.num_gpu_blocks - 1))])
        if ce.num_cpu_blocks:
            ce.swap_out([(0, 0)])
            ce.swap_in([(0, 0)])
        _sampler_paths(dev, runner.vocab_size, max_seqs, runner.dtype)
        _device_state_inputs(steps, dev)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        ce.gpu_pool.zero_()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - t0
    logger.info("warm-up took %.1f s", seconds)
    return seconds
