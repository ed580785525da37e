"""cuDNN's unmasked prefix attention (the gathered long-prefill path's largest part) per memory layout.

attention/gathered_prefill.py gathers a long chunk's context into a buffer laid out as the pool's
pages are ([positions, KV heads, D]) and hands cuDNN strided heads-first views of it, with each KV
group's query heads folded into the query length. This times that call beside the layouts it could
use instead, at the same shape, to see whether the layout costs cuDNN anything:

  pool_strided    K/V [1, Hkv, L, D] viewed from [L, Hkv, D] (the engine's call), q folded
  heads_contig    K/V contiguous [1, Hkv, L, D], q folded
  gqa_private     the engine's op, q [1, H, c, D] unfolded (a strided view) against the Hkv-head views
  gqa_unfolded    q [1, H, c, D] unfolded, K/V contiguous, public SDPA's enable_gqa (cuDNN forced)
  flash_folded    torch's flash kernel on the engine's views, for scale

Each variant is checked against the engine's call (bf16, max abs difference) before it is timed.
Then, on small shapes, where cuDNN's causal mask sits when queries are fewer than keys (top-left
or bottom-right: the latter would let one call attend a chunk and its prefix, no merge).
GPU only:  python benchmarks/kernels/cudnn_layouts.py --output $OUT/cudnn_layouts.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def variants(c: int, L: int, heads: int, kv_heads: int, d: int):
    """(name -> zero-argument call returning [1, H, c, D]) over one random shape."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    g = heads // kv_heads
    scale = d ** -0.5
    pool_k = torch.randn(L, kv_heads, d, device="cuda", dtype=torch.bfloat16)
    pool_v = torch.randn_like(pool_k)
    q = torch.randn(c, heads, d, device="cuda", dtype=torch.bfloat16)
    folded = q.view(c, kv_heads, g, d).permute(1, 2, 0, 3).reshape(1, kv_heads, g * c, d).contiguous()
    k_view, v_view = (t.permute(1, 0, 2).unsqueeze(0) for t in (pool_k, pool_v))
    k_contig, v_contig = k_view.contiguous(), v_view.contiguous()
    q_heads = q.permute(1, 0, 2).unsqueeze(0).contiguous()
    aten = torch.ops.aten

    def unfold(o):  # [1, Hkv, g * c, D] -> [1, H, c, D]
        return o.view(1, kv_heads, g, c, d).reshape(1, heads, c, d)

    def cudnn(qq, k, v):
        return aten._scaled_dot_product_cudnn_attention(qq, k, v, None, True, 0.0, False, False, scale=scale)[0]

    def gqa():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(q_heads, k_contig, v_contig, scale=scale,
                                                                    enable_gqa=True)

    def gqa_private():  # the op the engine calls, its queries unfolded (a strided view) against Hkv heads
        return cudnn(q.permute(1, 0, 2).unsqueeze(0), k_view, v_view)

    return {
        "pool_strided": lambda: unfold(cudnn(folded, k_view, v_view)),
        "gqa_private": gqa_private,
        "heads_contig": lambda: unfold(cudnn(folded, k_contig, v_contig)),
        "gqa_unfolded": gqa,
        "flash_folded": lambda: unfold(aten._scaled_dot_product_flash_attention(
            folded, k_view, v_view, 0.0, False, False, scale=scale)[0]),
    }


def causal_alignment(c: int, L: int, heads: int, kv_heads: int, d: int) -> dict:
    """Where cuDNN's causal mask sits when queries are fewer than keys: each variant's max abs
    difference from attention with the mask aligned to the top-left corner (query i sees keys
    <= i, SDPA's documented is_causal) and to the bottom-right (query i sees keys <= L - c + i,
    a chunk after its prefix, FlashAttention-2's alignment), references in float32 on the GPU."""
    scale = d ** -0.5
    g = heads // kv_heads
    q = torch.randn(1, heads, c, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, kv_heads, L, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    kr, vr = (t.repeat_interleave(g, dim=1) for t in (k, v))
    rows = torch.arange(c, device="cuda")[:, None]
    cols = torch.arange(L, device="cuda")[None, :]
    refs = {}
    for name, allowed in (("top_left", cols <= rows), ("bottom_right", cols <= rows + (L - c))):
        scores = (q.float() @ kr.float().transpose(-1, -2)) * scale
        refs[name] = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ vr.float()
    aten = torch.ops.aten
    calls = {"cudnn_causal": lambda: aten._scaled_dot_product_cudnn_attention(
                 q, kr, vr, None, True, 0.0, True, False, scale=scale)[0],
             "cudnn_causal_gqa": lambda: aten._scaled_dot_product_cudnn_attention(
                 q, k, v, None, True, 0.0, True, False, scale=scale)[0]}
    out = {}
    for name, fn in calls.items():
        try:
            o = fn().float()
            out[name] = {ref: round((o - r).abs().max().item(), 5) for ref, r in refs.items()}
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        print("causal", c, L, name, out[name], flush=True)
    return out


def time_ms(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["8192x98304", "8192x32768", "2048x98304", "4096x65536"],
                    help="c x L: chunk queries x prefix keys")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--output", required=True)
    args = ap.parse_args(argv)
    from pagedserve.benchmark.results import write_result
    results = {}
    for shape in args.shapes:
        c, L = (int(x) for x in shape.split("x"))
        calls = variants(c, L, args.heads, args.kv_heads, args.head_dim)
        ref = calls["pool_strided"]().float()
        flops = 4 * args.heads * c * L * args.head_dim
        row = {}
        for name, fn in calls.items():
            try:
                err = (fn().float() - ref).abs().max().item()
                ms = time_ms(fn, args.reps)
                row[name] = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1), "max_abs_diff": err}
            except Exception as e:  # a layout the backend refuses is a result too
                row[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            print(shape, name, row[name], flush=True)
        results[shape] = row
    alignment = {f"{c}x{L}": causal_alignment(c, L, args.heads, args.kv_heads, args.head_dim)
                 for c, L in ((256, 1024), (1024, 4096))}
    base = {s: r["pool_strided"]["ms"] for s, r in results.items()}
    ratios = {f"{name}_over_pool_strided_{s}": round(r[name]["ms"] / base[s], 4)
              for s, r in results.items() for name in r if "ms" in r[name] and name != "pool_strided"}
    write_result(args.output, "cudnn_layouts", None, vars(args), results, ratios=ratios,
                 extra={"causal_alignment": alignment})
    return 0


if __name__ == "__main__":
    sys.exit(main())
