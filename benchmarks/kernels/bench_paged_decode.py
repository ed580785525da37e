"""Paged decode attention on the GPU vs the same work on contiguous KV (SDPA, FlexAttention).

Llama-3.1-8B attention (32 q heads, 8 KV heads, head_dim 128), bf16, batch 64 x context
4096 by default. One run measures, side by side: device copy bandwidth (the ceiling),
our paged decode (default launch and a small config sweep), SDPA on contiguous KV,
FlexAttention over the physical paged pool with a block mask and over contiguous KV,
a block-size sweep, and a paged prefill vs causal SDPA. Every section logs its own
error and the run goes on; a number that was not measured is absent from the JSON.

    python benchmarks/kernels/bench_paged_decode.py [--output benchmarks/results/h200/paged_decode.json]
    python benchmarks/kernels/bench_paged_decode.py --batch 1 --context 100000 --splits 32 48 64 96 128 \
        --shares 3 4 --skip sweep,flex,blocks,prefill --output /tmp/decode_long.json    # long_h200.sh decode_long

Timing (--timing): 'graph' (the default since the 36th session) replays the launch from a CUDA
graph, as serving's decode steps do; 'flush' (before) times each launch alone after an L2 flush,
and so also the host's launch overhead wherever that outlasts the flush (kernels under ~0.1 ms:
at 2 x 33k tokens the same launch read 87 and 140 us in one run). --launches times the decode at
other launch settings (PAGEDSERVE_DECODE_LAUNCH's grammar), each with the split and plan sweeps.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pagedserve.attention import decode_plan, triton_ops  # noqa: E402
from pagedserve.benchmark.results import git_commit, write_result  # noqa: E402

ERRORS: dict[str, str] = {}
TIMING = {"mode": "graph"}  # --timing


def section(name):
    """Run fn; on failure record the traceback under `name` and return None."""
    def wrap(fn):
        def run(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception:
                ERRORS[name] = traceback.format_exc(limit=6)
                print(f"[{name}] FAILED\n{ERRORS[name]}", file=sys.stderr, flush=True)
                try:
                    torch.cuda.synchronize()
                except Exception:
                    pass
                return None
        return run
    return wrap


def bench_ms(fn, reps: int = 7) -> float:
    """Median of `reps` medians: of CUDA graph replays of fn (TIMING 'graph'), or of triton
    do_bench (each flushes L2 and warms up first; TIMING 'flush')."""
    import triton.testing
    if TIMING["mode"] == "graph":  # each call: the median of 10 replays of ~20 ms of launches, steady
        times = [triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")
                 for _ in range(1 if reps <= 3 else 3)]
    else:
        times = [triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") for _ in range(reps)]
    times.sort()
    return times[len(times) // 2]


@section("copy_bandwidth")
def copy_bandwidth(gib: float = 2.0) -> dict:
    n = int(gib * 2 ** 30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return {"bytes_moved": 2 * src.numel() * 2, "ms": ms, "GBps": 2 * src.numel() * 2 / ms / 1e6}


def make_paged(B, L, H, Hkv, D, block_size, dtype, seed=0):
    """A pool holding exactly B sequences of L tokens in shuffled physical blocks."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_seq = math.ceil(L / block_size)
    num_blocks = B * blocks_per_seq
    perm = torch.randperm(num_blocks, device="cuda", generator=g).to(torch.int32)
    tables = perm.view(B, blocks_per_seq).contiguous()
    kc = torch.randn(num_blocks, block_size, Hkv, D, device="cuda", dtype=dtype, generator=g)
    vc = torch.randn(num_blocks, block_size, Hkv, D, device="cuda", dtype=dtype, generator=g)
    q = torch.randn(B, H, D, device="cuda", dtype=dtype, generator=g)
    seq_lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    return q, kc, vc, tables, seq_lens


def contiguous_kv(cache, tables, L):
    """[B, Hkv, L, D] copy of every sequence's K or V, read through its block table."""
    return cache[tables.long()].flatten(1, 2)[:, :L].transpose(1, 2).contiguous()


def decode_bytes(B, L, H, Hkv, D, block_size, elt):
    kv = 2 * B * L * Hkv * D * elt
    return kv + 2 * B * H * D * elt + B * math.ceil(L / block_size) * 4


def time_paged(q, kc, vc, tables, seq_lens, L, scale, reps=7, **kw):
    out = torch.empty_like(q)
    fn = lambda: triton_ops.paged_decode(q, kc, vc, seq_lens, tables, L, scale, out, **kw)  # noqa: E731
    fn()
    return bench_ms(fn, reps), out


@section("sdpa_contiguous")
def time_sdpa(q, k, v, scale):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q4 = q.unsqueeze(2)  # [B, H, 1, D]
    result = {}
    for name, backends in (("flash", [SDPBackend.FLASH_ATTENTION]), ("auto", None)):
        try:
            def fn():
                if backends is None:
                    return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)
                with sdpa_kernel(backends):
                    return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)
            out = fn()
            result[name] = {"ms": bench_ms(fn), "out": out.squeeze(2)}
        except Exception as e:
            result[name] = {"error": repr(e)[:300]}
    try:  # flash without enable_gqa: KV expanded to all heads beforehand (reads 4x the bytes)
        group = q.shape[1] // k.shape[1]
        ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            fn = lambda: F.scaled_dot_product_attention(q4, ke, ve, scale=scale)  # noqa: E731
            fn()
            result["flash_expanded_kv"] = {"ms": bench_ms(fn)}
        del ke, ve
    except Exception as e:
        result["flash_expanded_kv"] = {"error": repr(e)[:300]}
    return result


@section("flex_paged")
def time_flex_paged(q, kc, vc, tables, L, block_size, scale):
    """FlexAttention straight over the physical pool: the B decode queries are the query axis of
    one batch, the pool's slots the KV axis, and a block mask built from the block tables lets
    query b see exactly the pages it owns (each KV block is read once; compute is padded)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    B, H, D = q.shape
    num_blocks, bs, Hkv, _ = kc.shape
    owner = torch.empty(num_blocks, dtype=torch.int32, device="cuda")
    owner[tables.flatten().long()] = torch.arange(B, device="cuda", dtype=torch.int32).repeat_interleave(
        tables.shape[1])
    logical = torch.empty(num_blocks, dtype=torch.int32, device="cuda")
    logical[tables.flatten().long()] = torch.arange(tables.shape[1], device="cuda", dtype=torch.int32).repeat(B)

    def mask_mod(b, h, q_idx, kv_idx):
        page = kv_idx // bs
        return (owner[page] == q_idx) & (logical[page] * bs + kv_idx % bs < L)

    kv_block = max(bs, 128)
    mask = create_block_mask(mask_mod, 1, None, B, num_blocks * bs, device="cuda", BLOCK_SIZE=(128, kv_block))
    k = kc.view(1, num_blocks * bs, Hkv, D).transpose(1, 2)
    v = vc.view(1, num_blocks * bs, Hkv, D).transpose(1, 2)
    qf = q.transpose(0, 1).unsqueeze(0)  # [1, H, B, D]
    flex = torch.compile(flex_attention, dynamic=False)
    fn = lambda: flex(qf, k, v, block_mask=mask, scale=scale, enable_gqa=True)  # noqa: E731
    out = fn()
    return {"ms": bench_ms(fn, reps=3), "out": out[0].transpose(0, 1),
            "kv_block_size": kv_block, "note": "queries packed on the q axis; KV = physical pool"}


@section("flex_contiguous")
def time_flex_contiguous(q, k, v, scale):
    from torch.nn.attention.flex_attention import flex_attention
    flex = torch.compile(flex_attention, dynamic=False)
    q4 = q.unsqueeze(2)
    fn = lambda: flex(q4, k, v, scale=scale, enable_gqa=True)  # noqa: E731
    out = fn()
    return {"ms": bench_ms(fn, reps=3), "out": out.squeeze(2)}


@section("config_sweep")
def config_sweep(q, kc, vc, tables, seq_lens, L, scale):
    rows = []
    for splits in (1, 2, 4, 8):
        for block_n in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3):
                    try:
                        ms, _ = time_paged(q, kc, vc, tables, seq_lens, L, scale, reps=3, num_splits=splits,
                                           block_n=block_n, num_warps=warps, num_stages=stages)
                        rows.append({"num_splits": splits, "block_n": block_n, "num_warps": warps,
                                     "num_stages": stages, "ms": ms})
                    except Exception as e:
                        rows.append({"num_splits": splits, "block_n": block_n, "num_warps": warps,
                                     "num_stages": stages, "error": repr(e)[:200]})
    return rows


@section("split_sweep")
def split_sweep(q, kc, vc, tables, seq_lens, L, scale, nbytes, copy_gbps, counts, **launch):
    """The default launch at each given split count per sequence (length-aware splits off): at
    long contexts and few sequences the grid is a few waves of programs, and how full the last one
    is shows here."""
    rows = []
    for n in counts:
        ms, _ = time_paged(q, kc, vc, tables, seq_lens, L, scale, reps=3, num_splits=n, split_tokens=0, **launch)
        gbps = nbytes / ms / 1e6
        rows.append({"num_splits": n, "programs": q.shape[0] * kc.shape[2] * n, "ms": ms, "GBps": gbps,
                     "bandwidth_fraction": gbps / copy_gbps if copy_gbps else None})
        print("splits", rows[-1], flush=True)
    return rows


@section("plan_variants")
def plan_variants(q, kc, vc, tables, seq_lens, L, scale, nbytes, shares, **launch):
    """The balanced plan (decode_plan's default split mode) with its even share at other sizes, and
    the one-wave variant: base splits floor(slots / (seqs x KV heads)) and the share shrunk by one
    program per (sequence, KV head), so that rounding each sequence's parts up never takes the
    programs past one wave of slots = DECODE_PROGRAMS_PER_SM per SM (at one 100k sequence on the H200
    the plan's base alone is 400 programs of 396, its balanced cut 512). Rows name the share in
    programs (absolute) and the base (None: the plan's)."""
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    slots = decode_plan.DECODE_PROGRAMS_PER_SM * sms
    pairs = q.shape[0] * kc.shape[2]
    variants = [(f"share{n}_per_sm", None, n * sms) for n in shares]
    if pairs < slots:
        variants.append(("one_wave", max(1, slots // pairs), max(1, slots - pairs)))
    rows = []
    for name, base, share in variants:
        ms, _ = time_paged(q, kc, vc, tables, seq_lens, L, scale, reps=3, num_splits=base,
                           split_tokens=decode_plan.BALANCED, share_programs=share, **launch)
        rows.append({"variant": name, "base_splits": base, "share_programs": share, "ms": ms,
                     "GBps": nbytes / ms / 1e6})
        print("plan", rows[-1], flush=True)
    return rows


@section("block_size_sweep")
def block_size_sweep(B, L, H, Hkv, D, dtype, scale, copy_gbps):
    rows = []
    for bs in (1, 8, 16, 32, 64, 128, 256):
        try:
            q, kc, vc, tables, seq_lens = make_paged(B, L, H, Hkv, D, bs, dtype)
            ms, _ = time_paged(q, kc, vc, tables, seq_lens, L, scale, reps=3)
            gbps = decode_bytes(B, L, H, Hkv, D, bs, kc.element_size()) / ms / 1e6
            rows.append({"block_size": bs, "ms": ms, "GBps": gbps,
                         "bandwidth_fraction": gbps / copy_gbps if copy_gbps else None})
            del q, kc, vc, tables
        except Exception as e:
            rows.append({"block_size": bs, "error": repr(e)[:300]})
        torch.cuda.empty_cache()
    return rows


@section("prefill")
def prefill(H, Hkv, D, dtype, scale, num_seqs=8, q_len=1024, block_size=16):
    """Paged prefill of num_seqs fresh prompts vs causal flash SDPA on the same contiguous tokens."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, kc, vc, tables, seq_lens = make_paged(num_seqs, q_len, H, Hkv, D, block_size, dtype, seed=1)
    query = torch.randn(num_seqs * q_len, H, D, device="cuda", dtype=dtype)
    qsl = torch.arange(0, (num_seqs + 1) * q_len, q_len, device="cuda", dtype=torch.int32)
    out = torch.empty_like(query)
    fn = lambda: triton_ops.paged_prefill(query, kc, vc, qsl, seq_lens, tables, 0, num_seqs, q_len,  # noqa: E731
                                          scale, out)
    fn()
    paged_ms = bench_ms(fn, reps=3)
    k, v = contiguous_kv(kc, tables, q_len), contiguous_kv(vc, tables, q_len)
    q4 = query.view(num_seqs, q_len, H, D).transpose(1, 2)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        sf = lambda: F.scaled_dot_product_attention(q4, k, v, is_causal=True, scale=scale, enable_gqa=True)  # noqa
        ref = sf()
        sdpa_ms = bench_ms(sf, reps=3)
    err = (out.view(num_seqs, q_len, H, D).transpose(1, 2).float() - ref.float()).abs().max().item()
    flops = 4 * num_seqs * H * D * q_len * (q_len + 1) / 2
    return {"num_seqs": num_seqs, "q_len": q_len, "block_size": block_size, "paged_ms": paged_ms,
            "sdpa_flash_causal_ms": sdpa_ms, "paged_over_contiguous": paged_ms / sdpa_ms,
            "paged_TFLOPs": flops / paged_ms / 1e9, "max_abs_diff_vs_sdpa": err}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output", default=str(ROOT / "benchmarks/results/h200/paged_decode.json"))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--skip", default="", help="comma list: sweep,flex,blocks,prefill")
    ap.add_argument("--splits", type=int, nargs="*", default=[],
                    help="also time the default launch at these split counts per sequence (e.g. at --batch 1 "
                         "--context 100000: 32 48 64 96 128)")
    ap.add_argument("--shares", type=int, nargs="*", default=[],
                    help="also time the balanced plan with its even share at these programs per SM (default "
                         "DECODE_SHARE_PROGRAMS_PER_SM), and its one-wave variant (plan_variants)")
    ap.add_argument("--launches", nargs="*", default=[],
                    help="also time these decode launches ('+'-joined changes to the default, as "
                         "PAGEDSERVE_DECODE_LAUNCH takes them, e.g. bn64+s4), each at the default plan and "
                         "with --splits and --shares")
    ap.add_argument("--timing", choices=["graph", "flush"], default="graph")
    args = ap.parse_args()
    TIMING["mode"] = args.timing
    skip = set(filter(None, args.skip.split(",")))
    git_commit()  # refuse before measuring, not after
    B, L, H, Hkv, D, dtype = args.batch, args.context, 32, 8, 128, torch.bfloat16
    scale = D ** -0.5
    dev = torch.cuda.get_device_name()
    print(f"device {dev}, torch {torch.__version__}", flush=True)

    results, baselines, ratios = {}, {}, {}
    config = {"batch": B, "context": L, "num_heads": H, "num_kv_heads": Hkv, "head_dim": D,
              "dtype": "bfloat16", "block_size": args.block_size, "torch": torch.__version__,
              "triton": __import__("triton").__version__,
              "timing": ("CUDA graph replays (triton.testing.do_bench_cudagraph), median of repeats"
                         if args.timing == "graph" else
                         "triton.testing.do_bench median (L2 flushed), median of repeats")}
    out_path = Path(args.output)

    def save():
        """Written after every section, so a run cut short still leaves what it measured."""
        write_result(out_path, "paged_decode", None, config, results, baselines, ratios, markdown, device=dev,
                     extra={"errors": ERRORS} if ERRORS else None)

    copy = copy_bandwidth()
    copy_gbps = copy["GBps"] if copy else None
    if copy:
        baselines["device_copy"] = copy
    print("copy", copy, flush=True)

    q, kc, vc, tables, seq_lens = make_paged(B, L, H, Hkv, D, args.block_size, dtype)
    nbytes = decode_bytes(B, L, H, Hkv, D, args.block_size, kc.element_size())
    splits = decode_plan.choose_num_splits(B, Hkv, L, q.device)
    paged = section("paged_decode")(time_paged)(q, kc, vc, tables, seq_lens, L, scale)
    if paged:
        paged_ms, paged_out = paged
        gbps = nbytes / paged_ms / 1e6
        results["paged_decode"] = {"ms": paged_ms, "GBps": gbps, "bytes": nbytes, "num_splits": splits,
                                   "block_n": decode_plan.DECODE_BLOCK_N}
        if copy_gbps:
            ratios["bandwidth_fraction"] = gbps / copy_gbps
        print("paged", results["paged_decode"], flush=True)
    save()

    kv = section("contiguous_kv")(lambda: (contiguous_kv(kc, tables, L), contiguous_kv(vc, tables, L)))()
    k, v = kv if kv else (None, None)
    sdpa = time_sdpa(q, k, v, scale) if kv else None
    if sdpa:
        for name, r in sdpa.items():
            entry = {key: val for key, val in r.items() if key != "out"}
            if "out" in r and paged:
                entry["max_abs_diff_vs_paged"] = (r["out"].float() - paged_out.float()).abs().max().item()
            if "ms" in entry:
                entry["GBps"] = nbytes / entry["ms"] / 1e6
            baselines[f"sdpa_{name}_contiguous"] = entry
        # Against the fastest SDPA backend on contiguous KV, not only flash: on the H200 the
        # default backend beat flash for this decode shape.
        timed = [r["ms"] for r in sdpa.values() if r.get("ms")]
        if timed and paged:
            ratios["paged_over_contiguous"] = paged_ms / min(timed)
        if sdpa.get("flash", {}).get("ms") and paged:
            ratios["paged_over_sdpa_flash"] = paged_ms / sdpa["flash"]["ms"]
        print("sdpa", {n: e.get("ms", e.get("error")) for n, e in sdpa.items()}, flush=True)
    save()

    if args.splits and paged:
        rows = split_sweep(q, kc, vc, tables, seq_lens, L, scale, nbytes, copy_gbps, args.splits)
        if rows:
            results["split_sweep"] = rows
        save()

    if args.shares and paged:
        rows = plan_variants(q, kc, vc, tables, seq_lens, L, scale, nbytes, args.shares)
        if rows:
            results["plan_variants"] = rows
        save()

    for text in args.launches if paged else []:
        chosen = decode_plan.parse_decode_launch(text)
        launch = dict(block_n=chosen.block_n, num_warps=chosen.num_warps, num_stages=chosen.num_stages,
                      heads_fastest=chosen.heads_fastest)
        ms = section(f"launch {text}")(time_paged)(q, kc, vc, tables, seq_lens, L, scale, reps=3, **launch)
        if not ms:
            continue
        entry = {"launch": text, "ms": ms[0], "GBps": nbytes / ms[0] / 1e6}
        print("launch", entry, flush=True)
        if args.splits:
            entry["split_sweep"] = split_sweep(q, kc, vc, tables, seq_lens, L, scale, nbytes, copy_gbps,
                                               args.splits, **launch)
        if args.shares:
            entry["plan_variants"] = plan_variants(q, kc, vc, tables, seq_lens, L, scale, nbytes, args.shares,
                                                   **launch)
        results.setdefault("launches", []).append(entry)
        save()

    if "sweep" not in skip:
        rows = config_sweep(q, kc, vc, tables, seq_lens, L, scale)
        if rows:
            results["config_sweep"] = rows
            ok = [r for r in rows if r.get("ms")]
            if ok:
                best = min(ok, key=lambda r: r["ms"])
                results["best_config"] = dict(best, GBps=nbytes / best["ms"] / 1e6)
                print("best config", results["best_config"], flush=True)
        save()

    if "flex" not in skip:
        runs = [("flex_paged_block_mask", lambda: time_flex_paged(q, kc, vc, tables, L, args.block_size, scale))]
        if kv:
            runs.append(("flex_contiguous", lambda: time_flex_contiguous(q, k, v, scale)))
        for name, run in runs:
            r = run()
            if r:
                entry = {key: val for key, val in r.items() if key != "out"}
                if paged:
                    entry["max_abs_diff_vs_paged"] = (r["out"].float() - paged_out.float()).abs().max().item()
                    ratios[f"paged_over_{name}"] = paged_ms / r["ms"]
                entry["GBps"] = nbytes / entry["ms"] / 1e6
                baselines[name] = entry
                print(name, entry, flush=True)
            save()
    del q, kc, vc, tables, k, v, kv
    torch.cuda.empty_cache()

    if "blocks" not in skip:
        rows = block_size_sweep(B, L, H, Hkv, D, dtype, scale, copy_gbps)
        if rows:
            results["block_size_sweep"] = rows
            print("block sizes", rows, flush=True)
        save()
    if "prefill" not in skip:
        pre = prefill(H, Hkv, D, dtype, scale)
        if pre:
            results["prefill"] = pre
            print("prefill", pre, flush=True)
    save()
    print(json.dumps(ratios), flush=True)
    print(f"wrote {out_path}", flush=True)


def markdown(rec: dict) -> str:
    c, r, b, x = rec["config"], rec["results"], rec["baselines"], rec["ratios"]
    fmt = lambda v: "–" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))  # noqa: E731
    lines = [f"# Paged decode attention — {rec['device']}", "",
             f"batch {c['batch']} × context {c['context']}, {c['num_heads']} q heads / {c['num_kv_heads']} KV heads, "
             f"head_dim {c['head_dim']}, {c['dtype']}, block_size {c['block_size']}; commit `{rec['commit'][:10]}`, "
             f"{rec['date']}; `{rec['command']}`", "",
             "| kernel | ms | GB/s |", "|---|---|---|"]
    if "paged_decode" in r:
        lines.append(f"| pagedserve paged decode (Triton, default launch) | {fmt(r['paged_decode']['ms'])} | "
                     f"{fmt(r['paged_decode']['GBps'])} |")
    if "best_config" in r:
        bc = r["best_config"]
        lines.append(f"| pagedserve, best swept config (splits {bc['num_splits']}, BLOCK_N {bc['block_n']}, "
                     f"warps {bc['num_warps']}, stages {bc['num_stages']}) | {fmt(bc['ms'])} | {fmt(bc['GBps'])} |")
    for name, e in b.items():
        lines.append(f"| {name} | {fmt(e.get('ms'))} | {fmt(e.get('GBps'))} |")
    lines += ["", "| ratio | value |", "|---|---|"] + [f"| {k} | {fmt(v)} |" for k, v in x.items()]
    if "block_size_sweep" in r:
        lines += ["", "| block size | ms | GB/s | bandwidth fraction |", "|---|---|---|---|"]
        lines += [f"| {row['block_size']} | {fmt(row.get('ms'))} | {fmt(row.get('GBps'))} | "
                  f"{fmt(row.get('bandwidth_fraction'))} |" for row in r["block_size_sweep"]]
    if "prefill" in r:
        p = r["prefill"]
        lines += ["", f"Prefill {p['num_seqs']} × {p['q_len']} tokens (block_size {p['block_size']}): paged "
                  f"{fmt(p['paged_ms'])} ms vs causal flash SDPA {fmt(p['sdpa_flash_causal_ms'])} ms "
                  f"({fmt(p['paged_TFLOPs'])} TFLOP/s)."]
    if rec.get("errors"):
        lines += ["", "Sections that failed: " + ", ".join(rec["errors"])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
