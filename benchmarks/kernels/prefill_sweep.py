"""The long-chunk attention launches on the GPU: which PAGEDSERVE_PREFILL_LAUNCH (the paged prefill
kernel, plain or GQA-packed) and which PAGEDSERVE_UNIFIED_LAUNCH (the full-graph mode's unified
kernel) run a long prefill chunk fastest, beside torch SDPA (flash) on the same shapes.

Shapes: Llama-3.1-8B attention (32 q heads, 8 KV heads, head_dim 128), bf16 pools of block size 16
whose block tables are shuffled (no two neighbouring blocks adjacent in memory); one sequence with
a chunk of c new tokens at total context L (its K/V already in the pool, as the runner writes it
before attention), for (c, L) in SHAPES (--shapes to change them). Query i sits at position
L - c + i and sees the keys at positions <= its own.

For every candidate launch: first its output on each shape against a reference (torch SDPA on the
K/V gathered contiguous, KV heads repeated, with a lower-right causal mask), each (token, head)
row's relative L2 error within --rtol; then its time by CUDA events (--warmup, median of --reps;
these kernels take ms). TFLOPS count the FLOPs exactly: 4 x head_dim x q heads x visible (query,
key) pairs. A launch that does not compile or launch (shared memory) is recorded with its error; an
incorrect one is recorded and never picked. After the grid, the --lpt-top best prefill launches
run again with +lpt (query tiles longest first). The pick: per kernel, the correct launch with
every shape timed whose geometric mean of time over the shapes is lowest, printed as the switch
line. torch's flash backend is FlashAttention-2 (vLLM runs FA3 on Hopper), over the KV heads
repeated to 32.

Time on an H200: about 3 minutes for the full grid (108 launches): --jobs processes compile the
candidates first on a tiny problem of the same heads (Triton's disk cache then serves the timed
run; ~1-3 s a compile, ~30 s in all), ~10 s of set-up and references, then ~0.5-1 s per launch for
the four shapes. --budget-s stops starting launches (the rest are listed as not reached); --grid
quick halves the grid.

    timeout 280 python benchmarks/kernels/prefill_sweep.py --output $OUT/prefill_sweep.json
    python benchmarks/kernels/prefill_sweep.py --pick $OUT/prefill_sweep.json   # the switch lines (CPU)
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pagedserve.attention.metadata import AttentionMetadata  # noqa: E402
from pagedserve.attention.tile_launch import TileLaunch  # noqa: E402
from pagedserve.attention.triton_prefill import (PREFILL_DEFAULT_SM90, PREFILL_FLAGS, PREFILL_LAUNCH_ENV,  # noqa: E402
                                                 parse_prefill_launch)
from pagedserve.attention.triton_unified import UNIFIED_DEFAULT, UNIFIED_LAUNCH_ENV, parse_unified_launch  # noqa: E402

H, HKV, D, BLOCK_SIZE = 32, 8, 128, 16
SCALE = D ** -0.5
SHAPES = [(8192, 8192), (8192, 32768), (8192, 100000), (2048, 65536)]
# bf16 outputs, fp32 softmax on both sides: a row's error is a few bf16 ulps (~0.4% each) of its norm.
RTOL = 2e-2
# name: (switch, default launch, flags the switch takes, parser). The sweep's shapes are head_dim 128 on
# Hopper, where paged_prefill's default is PREFILL_DEFAULT_SM90 (this sweep's pick at 3368ebd); the
# small default of other GPUs (bm64+bn64+w4+s2) stays in the grid.
KERNELS = {
    "paged_prefill": (PREFILL_LAUNCH_ENV, PREFILL_DEFAULT_SM90, PREFILL_FLAGS, parse_prefill_launch),
    "unified": (UNIFIED_LAUNCH_ENV, UNIFIED_DEFAULT, (), parse_unified_launch),
}
# kernel: grid: (bm, bn, warps, stages, gqa), each axis in the order its values are tried: the likelier
# winners (bigger tiles, the packed kernel) first, so that a budget cut leaves out the least likely.
GRIDS = {
    "paged_prefill": {"full": ((128, 64), (64, 128, 32), (8, 4), (3, 2, 4), (True, False)),
                      "quick": ((128, 64), (64, 128), (8, 4), (3, 2), (True, False))},
    "unified": {"full": ((128, 256, 64), (64, 32, 128), (8, 4), (2, 3), (False,)),
                "quick": ((128, 256, 64), (64, 32), (8, 4), (2,), (False,))},
}
PRECOMPILE_SHAPE = (64, 200)  # (c, L): the same heads, dtypes and strides, so the same compiled variants
REFINE_S = 6.0  # seconds kept for each lpt launch after the grid (compiled then: not precompiled)


# --- what a shape costs, and the candidates --------------------------------------------------------
def visible_pairs(c: int, L: int) -> int:
    """(query, key) pairs a causal chunk of c tokens at context L computes: query i (position
    L - c + i) sees L - c + i + 1 keys."""
    if not 0 < c <= L:
        raise ValueError(f"a chunk needs 0 < c <= L, got c={c}, L={L}")
    return c * (L - c) + c * (c + 1) // 2


def attention_flops(c: int, L: int, num_heads: int = H, head_dim: int = D) -> int:
    """QK^T and PV: 2 x 2 x head_dim FLOPs per visible pair and query head."""
    return 4 * head_dim * num_heads * visible_pairs(c, L)


def candidates(kernel: str, grid: str = "full") -> list[str]:
    """The kernel's launches as its switch names them, today's default first."""
    _, default, flags, _ = KERNELS[kernel]
    names = [default.name(flags)]
    for bm, bn, w, s, gqa in itertools.product(*GRIDS[kernel][grid]):
        name = TileLaunch(bm, bn, w, s, gqa).name(flags)
        if name not in names:
            names.append(name)
    return names


def schedule(kernels: list[str], grid: str) -> list[tuple[str, str]]:
    """(kernel, launch) in run order: the kernels' lists interleaved, so that a budget cut leaves
    both kernels with as many launches as it can."""
    lists = [[(k, n) for n in candidates(k, grid)] for k in kernels]
    return [x for group in itertools.zip_longest(*lists) for x in group if x is not None]


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for part in filter(None, text.split(",")):
        c, _, L = part.partition("x")
        if not (c.isdigit() and L.isdigit()):
            raise ValueError(f"--shapes are CxL pairs (chunk x total context) joined by ',', got {part!r}")
        visible_pairs(int(c), int(L))
        shapes.append((int(c), int(L)))
    return shapes


# --- a shape: pools, a shuffled table, the chunk ---------------------------------------------------
@dataclass
class Shape:
    c: int
    L: int
    query: torch.Tensor        # [c, H, D]
    k_cache: torch.Tensor      # [blocks, BLOCK_SIZE, HKV, D]
    v_cache: torch.Tensor
    table: torch.Tensor        # [1, ceil(L / BLOCK_SIZE)] int32, a random permutation's prefix
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor

    @property
    def key(self) -> str:
        return f"{self.c}x{self.L}"

    def meta(self) -> AttentionMetadata:
        """A fresh step's metadata (the unified kernel keeps its work list in it)."""
        return AttentionMetadata(
            slot_mapping=torch.full((self.c,), -1, dtype=torch.long, device=self.query.device),
            query_start_loc=self.query_start_loc, seq_lens=self.seq_lens, block_tables=self.table, num_decodes=0,
            max_query_len=self.c, max_seq_len=self.L, block_size=self.k_cache.shape[1], query_lens_cpu=[self.c],
            seq_lens_cpu=[self.L])


def make_shape(c: int, L: int, device, seed: int = 0, dtype=torch.bfloat16, num_heads: int = H,
               num_kv_heads: int = HKV, head_dim: int = D, block_size: int = BLOCK_SIZE, spare_blocks: int = 8) -> Shape:
    visible_pairs(c, L)
    gen = torch.Generator(device=device).manual_seed(seed)
    nb = -(-L // block_size)
    blocks = nb + spare_blocks
    randn = lambda *s: torch.randn(*s, generator=gen, device=device, dtype=torch.float32).to(dtype)  # noqa: E731
    kc, vc = randn(blocks, block_size, num_kv_heads, head_dim), randn(blocks, block_size, num_kv_heads, head_dim)
    table = torch.randperm(blocks, generator=gen, device=device)[:nb].to(torch.int32)[None]
    i32 = dict(dtype=torch.int32, device=device)
    return Shape(c, L, randn(c, num_heads, head_dim), kc, vc, table, torch.tensor([0, c], **i32),
                 torch.tensor([L], **i32))


def gather_contiguous(shape: Shape) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequence's K/V in position order, [L, HKV, D], read through its block table."""
    blocks = shape.table[0].long()
    flat = lambda cache: cache[blocks].reshape(-1, *cache.shape[2:])[:shape.L]  # noqa: E731
    return flat(shape.k_cache), flat(shape.v_cache)


def sdpa_inputs(shape: Shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[1, H, c, D] queries and [1, H, L, D] keys/values (KV heads repeated over their group)."""
    k, v = gather_contiguous(shape)
    group = shape.query.shape[1] // k.shape[1]
    heads_first = lambda x: x.transpose(0, 1).unsqueeze(0).contiguous()  # noqa: E731
    return (heads_first(shape.query), heads_first(k.repeat_interleave(group, dim=1)),
            heads_first(v.repeat_interleave(group, dim=1)))


def sdpa_attention(q4, k4, v4, backends) -> torch.Tensor:
    """SDPA over the backends given (never the math one at long contexts: it would materialise
    c x L scores), query i aligned to the last key (lower-right causal); [c, H, D] back."""
    from torch.nn.attention import sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    mask = causal_lower_right(q4.shape[2], k4.shape[2])
    with sdpa_kernel(backends):
        out = torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=q4.shape[-1] ** -0.5)
    return out[0].transpose(0, 1)


def split_attention(q4, k4, v4, piece) -> torch.Tensor:
    """A chunk's lower-right causal attention as a library kernel sees it: the chunk's queries over
    the context before it (no mask: every earlier key is visible to every query), plus over its
    own keys (causal, a square, where top-left and lower-right agree), merged by log-sum-exp.
    `piece(q, k, v, causal)` -> (out [B, H, c, D], lse). [c, H, D] back."""
    from pagedserve.attention.gathered_prefill import merge
    prefix = k4.shape[2] - q4.shape[2]
    heads_c = q4.shape[1:3]
    parts = [piece(q4, k4[:, :, :prefix], v4[:, :, :prefix], False)] if prefix else []
    parts.append(piece(q4, k4[:, :, prefix:], v4[:, :, prefix:], True))
    return merge([(out[0], lse.reshape(heads_c)) for out, lse in parts]).transpose(0, 1)


def library_pieces(group: int = 1, pad_to: int = 8192, base=None) -> dict:
    """The CUDA SDPA kernels that return their log-sum-exp (torch's private ops, as SDPA calls
    them), for split_attention: the long-prefill path a gather into contiguous K/V would allow.
    `_fold`: the unmasked prefix with each KV group's query heads folded into the query length
    ([1, Hkv, group * c, D] against un-repeated K/V, as an engine would call it). `_padded`: that,
    with the prefix padded with zero K/V to a multiple of pad_to and the pad masked by a broadcast
    bias row, so that cuDNN's plan (one per shape) would serve a bucket of context lengths.
    base(q, k, v, causal, bias) -> (out, lse) stands in for cuDNN's op (a CPU test's)."""
    aten = torch.ops.aten
    cudnn = base or (lambda q, k, v, causal, bias=None: aten._scaled_dot_product_cudnn_attention(  # noqa: E731
        q, k, v, bias, True, 0.0, causal, False, scale=q.shape[-1] ** -0.5)[:2])

    def folded(q, k, v, bias=None):
        b, h, c, d = q.shape
        out, lse = cudnn(q.reshape(b, h // group, group * c, d), k[:, ::group], v[:, ::group], False,
                         None if bias is None else bias.expand(b, h // group, group * c, -1))
        return out.reshape(b, h, c, d), lse.reshape(b, h, c)

    def padded(q, k, v):
        n = k.shape[2]
        pad = -n % pad_to
        if pad == 0:
            return folded(q, k, v)
        z = k.new_zeros(k.shape[0], k.shape[1], pad, k.shape[3])
        bias = torch.zeros(1, 1, 1, n + pad, dtype=q.dtype, device=q.device)
        bias[..., n:] = float("-inf")
        return folded(q, torch.cat([k, z], 2), torch.cat([v, z], 2), bias)

    return {
        "sdpa_cudnn_split": cudnn,
        "sdpa_cudnn_fold_split": lambda q, k, v, causal: cudnn(q, k, v, True) if causal else folded(q, k, v),
        "sdpa_cudnn_padded_split": lambda q, k, v, causal: cudnn(q, k, v, True) if causal else padded(q, k, v),
        "sdpa_flash_split": lambda q, k, v, causal: aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=q.shape[-1] ** -0.5)[:2],
    }


def time_gathered(shape: Shape, ref: torch.Tensor, args, sync) -> dict:
    """attention/gathered_prefill.py over the shape's pages as the engine calls it (gather, fold,
    cuDNN's bucketed prefix head + flash's tail and square, merge); first_call_ms builds cuDNN's
    plan at this shape (the engine's warm-up builds them all). The merge as PAGEDSERVE_LONG_PREFILL_MERGE says."""
    from pagedserve.attention.gathered_prefill import GatheredPrefill
    from pagedserve.attention.gathered_prefill_switches import merge_kernel
    c, L = shape.c, shape.L
    try:
        g = GatheredPrefill(L, shape.k_cache.shape[2], shape.query.shape[2], shape.query.dtype, shape.query.device,
                            merge_into=merge_kernel())
        run = lambda: g.attend(shape.query, shape.k_cache, shape.v_cache, shape.table[0], L,  # noqa: E731
                               shape.query.shape[2] ** -0.5)
        sync()
        t = time.perf_counter()
        got = run()
        sync()
        cold_ms = (time.perf_counter() - t) * 1e3
        err, ok = check_output(got, ref, args.rtol)
        ms = time_ms(run, args.warmup, args.reps)
        return {"ms": ms, "tflops": attention_flops(c, L) / ms / 1e9, "first_call_ms": cold_ms,
                "max_rel_err": err, "within_rtol": ok}
    except Exception as e:  # noqa: BLE001  recorded, not fatal
        return {"error": repr(e)[:300]}


def check_output(out: torch.Tensor, ref: torch.Tensor, rtol: float = RTOL) -> tuple[float, bool]:
    """(the worst (token, head) row's ||out - ref|| / ||ref||, whether it is within rtol); NaN or
    inf anywhere is never within."""
    diff = (out.float() - ref.float()).norm(dim=-1)
    rel = diff / ref.float().norm(dim=-1).clamp_min(1e-6)
    worst = rel.max().item() if torch.isfinite(out).all() else math.inf
    return worst, worst <= rtol


# --- running a launch ----------------------------------------------------------------------------
def make_runner(kernel: str, shape: Shape, name: str, out: torch.Tensor):
    """A no-argument call of the kernel at launch `name` over `shape` into `out`."""
    from pagedserve.attention import triton_ops
    launch = KERNELS[kernel][3](name)
    kw = dict(block_m=launch.block_m, block_n=launch.block_n, num_warps=launch.num_warps,
              num_stages=launch.num_stages)
    s = shape
    if kernel == "paged_prefill":
        return lambda: triton_ops.paged_prefill(s.query, s.k_cache, s.v_cache, s.query_start_loc, s.seq_lens, s.table,
                                                0, 1, s.c, SCALE, out, gqa=launch.gqa, lpt=launch.lpt, tma=launch.tma,
                                                ws=launch.ws, **kw)
    meta = s.meta()  # the first call builds the work list, later ones reuse it (as a step's later layers)
    return lambda: triton_ops.unified_paged_attention(s.query, s.k_cache, s.v_cache, meta, SCALE, out, **kw)


def time_ms(fn, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():  # a CPU smoke run (--device cpu under TRITON_INTERPRET=1)
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def _precompile(items: list[tuple[str, str]], block_size: int = BLOCK_SIZE) -> dict:
    """In a worker process: run each launch once on a tiny problem of the same heads and pages, so
    Triton's disk cache holds it when the timed run asks."""
    shape = make_shape(*PRECOMPILE_SHAPE, device="cuda", block_size=block_size)
    out = torch.empty_like(shape.query)
    done = {}
    for kernel, name in items:
        try:
            make_runner(kernel, shape, name, out)()
            torch.cuda.synchronize()
            done[f"{kernel}:{name}"] = "ok"
        except Exception as e:  # the timed run meets it again and records it
            done[f"{kernel}:{name}"] = repr(e)[:200]
    return done


def precompile(items: list[tuple[str, str]], jobs: int, block_size: int = BLOCK_SIZE) -> dict:
    if jobs < 1 or not items:
        return {}
    import multiprocessing
    jobs = min(jobs, len(items))
    chunks = [items[i::jobs] for i in range(jobs)]
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        return {k: v for part in pool.map(_precompile, chunks, [block_size] * jobs) for k, v in part.items()}


# --- the pick ------------------------------------------------------------------------------------
def ranking(runs: dict, shape_keys: list[str], rtol: float = RTOL) -> list[tuple[str, float]]:
    """(launch, geometric mean of its ms over shape_keys), fastest first, of the launches timed on
    every shape with every row within rtol; runs: {launch: {shape key: {"ms", "max_rel_err"} or
    {"error"}}}."""
    means = {}
    for name, per_shape in runs.items():
        rows = [per_shape.get(k, {}) for k in shape_keys]
        if all("ms" in r and r.get("max_rel_err", math.inf) <= rtol for r in rows):
            means[name] = math.exp(statistics.fmean(math.log(r["ms"]) for r in rows))
    return sorted(means.items(), key=lambda kv: kv[1])


def pick(runs: dict, shape_keys: list[str], rtol: float = RTOL) -> dict | None:
    """The first of ranking(), or None when no launch is correct on every shape."""
    ranked = ranking(runs, shape_keys, rtol)
    if not ranked:
        return None
    return {"launch": ranked[0][0], "geomean_ms": ranked[0][1], "correct_launches": len(ranked)}


def picks(results: dict, shape_keys: list[str], rtol: float = RTOL) -> dict:
    """pick() per kernel, with its switch line and how it compares with today's default."""
    out = {}
    for kernel, (env, default, flags, _) in KERNELS.items():
        best = pick(results.get(kernel, {}), shape_keys, rtol)
        if best is None:
            continue
        today = pick({default.name(flags): results[kernel].get(default.name(flags), {})}, shape_keys, rtol)
        best["switch"] = f"{env}={best['launch']}"
        best["default"] = default.name(flags)
        best["over_default"] = best["geomean_ms"] / today["geomean_ms"] if today else None
        out[kernel] = best
    return out


def print_picks(found: dict) -> None:
    """The switch lines on stdout (for `export $(...)`), one per kernel; the figures on stderr."""
    for kernel, p in found.items():
        note = f" ({p['over_default']:.3f}x the default's time)" if p.get("over_default") else ""
        print(f"# {kernel}: geomean {p['geomean_ms']:.3f} ms over the shapes{note}", file=sys.stderr)
        print(p["switch"], flush=True)


# --- the run -------------------------------------------------------------------------------------
def run_launch(kernel: str, name: str, shapes: list[Shape], refs: dict, out: torch.Tensor, results: dict,
               sync, args) -> None:
    """Check, then time, launch `name` on every shape into results[kernel][name]."""
    runs = results[kernel][name] = {}
    for shape in shapes:
        o = out[:shape.c]
        try:
            fn = make_runner(kernel, shape, name, o)
            o.fill_(float("nan"))
            fn()
            sync()
            err, ok = check_output(o, refs[shape.key], args.rtol)
            ms = time_ms(fn, args.warmup, args.reps)  # timed even if wrong: --pick may loosen --rtol
            runs[shape.key] = {"max_rel_err": err, "within_rtol": ok, "ms": ms,
                               "tflops": attention_flops(shape.c, shape.L) / ms / 1e9}
        except Exception as e:  # does not compile or launch (shared memory): say so, go on
            runs[shape.key] = {"error": repr(e)[:300]}
            break
    cells = ["error" if "error" in r else f"{r['ms']:8.3f} ms {r['tflops']:4.0f} TF"
             + ("" if r["within_rtol"] else f" WRONG {r['max_rel_err']:.1e}") for r in runs.values()]
    print(f"  {kernel:13s} {name:28s} " + " | ".join(cells), flush=True)


def sweep(args) -> int:
    from torch.nn.attention import SDPBackend
    from pagedserve.benchmark.results import git_commit, write_result
    git_commit()  # refuse before measuring, not after
    t0 = time.monotonic()
    shape_list = parse_shapes(args.shapes) if args.shapes else SHAPES
    kernels = [k for k in args.kernels.split(",") if k]
    for k in kernels:
        if k not in KERNELS:
            raise ValueError(f"--kernels are {', '.join(KERNELS)}, got {k!r}")
    order = schedule(kernels, args.grid)
    if args.launches:  # an A/B of named launches instead of the grid, e.g. paged_prefill:bm128+bn128+w8+s4+lpt
        order = []
        for item in filter(None, args.launches.split(",")):
            kernel, _, name = item.partition(":")
            if kernel not in KERNELS or not name:
                raise ValueError(f"--launches are KERNEL:LAUNCH joined by ',', got {item!r}")
            if name == "default":  # the launch serving runs with unset switches (on Hopper)
                name = KERNELS[kernel][1].name(KERNELS[kernel][2])
            KERNELS[kernel][3](name)  # a bad name is a ValueError naming the switch, before any GPU work
            order.append((kernel, name))
        kernels = sorted({k for k, _ in order}, key=list(KERNELS).index)
    cuda = args.device == "cuda"
    dev = torch.cuda.get_device_name() if cuda else "cpu"
    dtype = getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    print(f"device {dev}; {len(order)} launches over {len(shape_list)} shapes", flush=True)
    try:
        pre = precompile(order, args.jobs if cuda and dtype == torch.bfloat16 else 0, args.block_size)
    except Exception as e:  # only a head start: the timed run compiles what is missing
        print(f"precompile failed ({e!r:.200}); compiling as the launches are timed", flush=True)
        pre = {}
    print(f"compiled {sum(v == 'ok' for v in pre.values())}/{len(pre)} in {args.jobs} processes, "
          f"{time.monotonic() - t0:.0f} s", flush=True)

    shapes, refs, sdpa = [], {}, {}
    split = {name: {} for name in library_pieces()} if args.split_baselines else {}
    for i, (c, L) in enumerate(shape_list):
        shape = make_shape(c, L, args.device, seed=i, dtype=dtype, block_size=args.block_size)
        q4, k4, v4 = sdpa_inputs(shape)
        refs[shape.key] = sdpa_attention(q4, k4, v4, [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
                                         if cuda else [SDPBackend.MATH])
        try:
            ms = time_ms(lambda: sdpa_attention(q4, k4, v4, [SDPBackend.FLASH_ATTENTION]), args.warmup, args.reps)
            sdpa[shape.key] = {"ms": ms, "tflops": attention_flops(c, L) / ms / 1e9}
        except RuntimeError as e:  # no flash kernel for this device / dtype
            sdpa[shape.key] = {"error": repr(e)[:300]}
        print(f"  {shape.key}: sdpa flash {sdpa[shape.key]}", flush=True)
        group = shape.query.shape[1] // shape.k_cache.shape[2]
        for name, piece in (library_pieces(group).items() if cuda and args.split_baselines else ()):
            try:
                sync()
                t = time.perf_counter()
                got = split_attention(q4, k4, v4, piece)
                sync()
                # The first call at a new shape builds the library's plan (cuDNN: one per shape);
                # a serving path meets a new context length every step, so this cost counts there.
                cold_ms = (time.perf_counter() - t) * 1e3
                err, ok = check_output(got, refs[shape.key], args.rtol)
                ms = time_ms(lambda: split_attention(q4, k4, v4, piece), args.warmup, args.reps)
                split[name][shape.key] = {"ms": ms, "tflops": attention_flops(c, L) / ms / 1e9,
                                          "first_call_ms": cold_ms, "max_rel_err": err, "within_rtol": ok}
            except Exception as e:  # noqa: BLE001  a baseline that cannot run here is recorded, not fatal
                split[name][shape.key] = {"error": repr(e)[:300]}
            print(f"  {shape.key}: {name} {split[name][shape.key]}", flush=True)
        if cuda and args.split_baselines:  # the engine's path itself (PAGEDSERVE_LONG_PREFILL=cudnn)
            split.setdefault("gathered_cudnn", {})[shape.key] = time_gathered(shape, refs[shape.key], args, sync)
            print(f"  {shape.key}: gathered_cudnn {split['gathered_cudnn'][shape.key]}", flush=True)
        del q4, k4, v4
        shapes.append(shape)
    if cuda:
        torch.cuda.empty_cache()

    results: dict = {k: {} for k in kernels}
    not_reached = []
    out = torch.empty_like(max((s.query for s in shapes), key=lambda q: q.shape[0]))
    run = lambda kernel, name: run_launch(kernel, name, shapes, refs, out, results, sync, args)  # noqa: E731
    refine = args.lpt_top if "paged_prefill" in kernels else 0
    deadline = t0 + args.budget_s - REFINE_S * refine  # kept for the lpt launches after the grid
    for kernel, name in order:
        if time.monotonic() > deadline:
            not_reached.append(f"{kernel}:{name}")
            continue
        run(kernel, name)
    keys = [s.key for s in shapes]
    # The best few prefill launches again with their tiles longest first (lpt).
    for name, _ in ranking(results.get("paged_prefill", {}), keys, args.rtol)[:refine]:
        run("paged_prefill", name + "+lpt")

    found = picks(results, keys, args.rtol)
    ratios = {}
    for kernel, p in found.items():
        if p.get("over_default"):
            ratios[f"{kernel}_best_over_default"] = p["over_default"]
        for key in keys:
            ms = results[kernel][p["launch"]][key]["ms"]
            if "ms" in sdpa.get(key, {}):
                ratios[f"{kernel}_best_over_sdpa_flash_{key}"] = ms / sdpa[key]["ms"]
    config = {"shapes": [list(s) for s in shape_list], "num_heads": H, "num_kv_heads": HKV, "head_dim": D,
              "block_size": args.block_size, "dtype": args.dtype, "block_tables": "shuffled (random permutation)",
              "grid": args.grid, "kernels": kernels, "launches": [f"{k}:{n}" for k, n in order], "rtol": args.rtol,
              "check": "per (token, head) row ||out - ref|| / ||ref|| against SDPA (flash or efficient), lower-right causal",
              "timing": f"CUDA events, {args.warmup} warm-up, median of {args.reps}", "budget_s": args.budget_s,
              "lpt_top": args.lpt_top,
              "flops": "4 * head_dim * num_q_heads * visible (query, key) pairs", "torch": torch.__version__,
              "triton": __import__("triton").__version__, "precompile_jobs": args.jobs}
    doc_results = {**results, "pick": found, "not_reached": not_reached,
                   "precompile_failures": {k: v for k, v in pre.items() if v != "ok"}}
    write_result(args.output, "prefill_sweep", None, config, doc_results, {"sdpa_flash": sdpa, **split}, ratios, markdown,
                 device=dev)
    print(f"\n{len(not_reached)} launches not reached; {time.monotonic() - t0:.0f} s; wrote {args.output}")
    print_picks(found)
    return 0


def markdown(rec: dict) -> str:
    keys = [f"{c}x{L}" for c, L in rec["config"]["shapes"]]
    sdpa = rec["baselines"]["sdpa_flash"]
    fmt = lambda r: f"{r['ms']:.2f} ({r['tflops']:.0f})" if "ms" in r else "–"  # noqa: E731
    lines = [f"# Long-chunk attention launches — {rec['device']}", "",
             f"commit `{rec['commit'][:10]}`, {rec['date']}; `{rec['command']}`; ms (TFLOPS) per c x L", "",
             "| kernel | launch | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys),
             "| torch SDPA | flash | " + " | ".join(fmt(sdpa.get(k, {})) for k in keys) + " |"]
    lines += [f"| torch SDPA, gathered K/V | {name.removeprefix('sdpa_')} | " + " | ".join(fmt(runs.get(k, {})) for k in keys)
              + " |" for name, runs in rec["baselines"].items() if name.endswith("_split") or name == "gathered_cudnn"]
    for kernel, (_, default, flags, _) in KERNELS.items():
        p = rec["results"]["pick"].get(kernel)
        shown = [default.name(flags)] + ([p["launch"]] if p and p["launch"] != default.name(flags) else [])
        for name in shown:
            runs = rec["results"].get(kernel, {}).get(name, {})
            tag = " (pick)" if p and name == p["launch"] else (" (default)" if name == shown[0] else "")
            lines.append(f"| {kernel} | {name}{tag} | " + " | ".join(fmt(runs.get(k, {})) for k in keys) + " |")
    lines += ["", "Picks: " + ", ".join(f"`{p['switch']}`" for p in rec["results"]["pick"].values())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", default=str(ROOT / "benchmarks/results/h200/prefill_sweep.json"))
    ap.add_argument("--pick", metavar="RESULT_JSON", default=None,
                    help="no GPU: print the switch lines picked from a saved result (with --rtol)")
    ap.add_argument("--shapes", default=None, help="CxL pairs, e.g. 8192x32768,2048x65536 (default: SHAPES)")
    ap.add_argument("--kernels", default="paged_prefill,unified")
    ap.add_argument("--grid", choices=("full", "quick"), default="full")
    ap.add_argument("--launches", default=None, help="KERNEL:LAUNCH,... to time instead of the grid (LAUNCH 'default': "
                    "the kernel's Hopper default; an A/B; "
                    "--lpt-top 0 to time only these)")
    ap.add_argument("--split-baselines", action="store_true",
                    help="also time cuDNN's and flash's SDPA over the gathered context, split into prefix + "
                         "causal square and merged by log-sum-exp (baselines.sdpa_cudnn_split, sdpa_flash_split)")
    ap.add_argument("--block-size", type=int, default=BLOCK_SIZE,
                    help="KV page size of the shapes (the tma launches need a multiple of their bn, e.g. 128)")
    ap.add_argument("--rtol", type=float, default=RTOL, help="largest row-relative L2 error of a correct launch")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--jobs", type=int, default=max(1, min(12, (os.cpu_count() or 2) - 2)),
                    help="processes compiling the launches first (0: compile as they are timed)")
    ap.add_argument("--budget-s", type=float, default=200.0, help="start no launch after this many seconds")
    ap.add_argument("--lpt-top", type=int, default=3,
                    help="after the grid, time the N best prefill launches again with +lpt (longest tiles first)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: a smoke run of the script itself under TRITON_INTERPRET=1 (tiny --shapes)")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    args = ap.parse_args(argv)
    if args.pick:
        doc = json.loads(Path(args.pick).read_text())
        found = picks(doc["results"], [f"{c}x{L}" for c, L in doc["config"]["shapes"]], args.rtol)
        print_picks(found)
        return 0 if found else 1
    if os.environ.get("TRITON_INTERPRET") == "1":  # --device cpu: Triton 3.6's interpreter needs the
        sys.path.insert(0, str(ROOT / "tests"))     # fixes the test suite applies (numpy >= 2.4)
        from interpreter_fixes import apply
        apply()
    return sweep(args)


if __name__ == "__main__":
    sys.exit(main())
