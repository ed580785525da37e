"""FP8 KV kernels with per-tensor vs per-KV-head scales on the GPU: the same e4m3 pools and work,
only the scales' shape ([1] or [num_kv_heads]) differs. Times the cache write, the decode kernel
(batch x context, Llama-3.1-8B attention: 32 q heads, 8 KV heads, head_dim 128) and a prefill
chunk, each with triton.testing.do_bench (median ms), and checks the two outputs agree when every
head's scale equals the shared one. A number not measured is absent from the JSON.

    python benchmarks/kernels/fp8_kv_scales.py --output $OUT/fp8_kv_scales.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "attention"))

from pagedserve.attention import triton_ops  # noqa: E402
from pagedserve.attention.kv_quant import quantize_kv  # noqa: E402
from pagedserve.benchmark.results import git_commit  # noqa: E402
from paged_batch import make_batch  # noqa: E402

H, HKV, D = 32, 8, 128


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    shapes = [(args.context - 1, 1)] * args.batch + [(0, 1024)]
    batch = make_batch(shapes, args.batch, H=H, Hkv=HKV, D=D, block_size=16, dtype=torch.bfloat16, device="cuda")
    scales = {"per_tensor": (torch.tensor([0.02], device="cuda"), torch.tensor([0.015], device="cuda")),
              "per_head": (torch.full((HKV,), 0.02, device="cuda"), torch.full((HKV,), 0.015, device="cuda"))}
    ks, vs = scales["per_tensor"]
    kc, vc = quantize_kv(batch.k_cache, ks), quantize_kv(batch.v_cache, vs)
    m, nd = batch.meta, args.batch
    try:
        commit = git_commit()
    except Exception as e:  # a copy without its .git, or a dirty tree: say so rather than fail
        commit = f"unknown ({e.__class__.__name__})"
    result = {"commit": commit, "device": torch.cuda.get_device_name(), "batch": args.batch,
              "context": args.context, "shape": {"heads": H, "kv_heads": HKV, "head_dim": D}, "ms": {}}
    outs = {}
    for name, (k_s, v_s) in scales.items():
        out = torch.empty_like(batch.query)
        k2, v2 = kc.clone(), vc.clone()
        t = {"write_kv": bench(lambda: triton_ops.write_kv(batch.new_k, batch.new_v, k2, v2, m.slot_mapping, k_s, v_s)),
             "decode": bench(lambda: triton_ops.paged_decode(batch.query[:nd], kc, vc, m.seq_lens[:nd],
                                                             m.block_tables[:nd], args.context, D ** -0.5, out[:nd],
                                                             k_scale=k_s, v_scale=v_s)),
             "prefill_1024": bench(lambda: triton_ops.paged_prefill(batch.query, kc, vc, m.query_start_loc, m.seq_lens,
                                                                    m.block_tables, nd, 1, 1024, D ** -0.5, out,
                                                                    k_scale=k_s, v_scale=v_s))}
        result["ms"][name] = {k: round(v, 4) for k, v in t.items()}
        outs[name] = out.float()
        print(name, result["ms"][name], flush=True)
    result["max_abs_diff_equal_scales"] = (outs["per_tensor"] - outs["per_head"]).abs().max().item()
    result["per_head_over_per_tensor"] = {k: round(result["ms"]["per_head"][k] / result["ms"]["per_tensor"][k], 4)
                                          for k in result["ms"]["per_tensor"]}
    print(json.dumps(result, indent=1))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
