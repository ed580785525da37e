"""The plain-torch FP8 KV reference with per-KV-head scales (no interpreter: the CPU path itself):
the per-sequence path and the full-graph stand-in (static_paged_attention) both read the e4m3
pools as stored * scale[head], i.e. equal attention over pools dequantized head by head."""
from dataclasses import replace

import torch

from pagedserve.attention import reference
from pagedserve.attention.kv_quant import quantize_kv
from paged_batch import make_batch


def test_reference_reads_per_head_scales_in_both_paths():
    batch = make_batch([(20, 1), (0, 1), (0, 9), (13, 6)], 2, H=6, Hkv=3, D=8, block_size=4, seed=21)
    ks, vs = torch.tensor([0.002, 0.08, 0.03]), torch.tensor([0.05, 0.00125, 0.01])
    kc, vc = quantize_kv(batch.k_cache, ks), quantize_kv(batch.v_cache, vs)
    reference.write_kv(batch.new_k, batch.new_v, kc, vc, batch.meta.slot_mapping, ks, vs)
    # head by head, each with its own scale alone
    deq_k = torch.stack([kc[:, :, h].float() * ks[h] for h in range(3)], 2)
    deq_v = torch.stack([vc[:, :, h].float() * vs[h] for h in range(3)], 2)
    want = reference.paged_attention(batch.query, deq_k, deq_v, batch.meta, 0.25)
    eager = reference.paged_attention(batch.query, kc, vc, batch.meta, 0.25, k_scale=ks, v_scale=vs)
    static = reference.static_paged_attention(batch.query, kc, vc, replace(batch.meta, unified_capacity=(8, 8)),
                                              0.25, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(eager, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(static, want, rtol=1e-5, atol=1e-6)
