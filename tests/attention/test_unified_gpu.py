"""The unified varlen kernel (triton_unified.py) compiled on the GPU against reference.py, at
Llama-3.1-8B attention sizes and long contexts, and replayed from a CUDA graph captured once per
token-count bucket for mixes it never saw at capture. Skipped without CUDA; CPU CI runs the same
kernel in the interpreter (test_unified_interpret.py)."""
from dataclasses import replace

import pytest
import torch

from pagedserve.attention import reference
from pagedserve.attention.kv_quant import quantize_kv
from pagedserve.attention.metadata import AttentionMetadata
from paged_batch import make_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOL = {torch.bfloat16: dict(rtol=2e-2, atol=2e-2), torch.float16: dict(rtol=5e-3, atol=5e-3),
       torch.float32: dict(rtol=1e-4, atol=1e-4)}
# Decodes (one over a 1-token context, one at 32k) beside chunks: fresh, mid-prompt, across blocks.
MIXED = [(1500, 1), (0, 1), (32000, 1), (77, 1), (0, 512), (1000, 333), (20000, 2048), (5, 1)]


@pytest.fixture(scope="module")
def ops():
    from pagedserve.attention import triton_ops
    return triton_ops


def _written(batch, k_scale=None, v_scale=None):
    kc, vc = batch.k_cache.clone(), batch.v_cache.clone()
    reference.write_kv(batch.new_k, batch.new_v, kc, vc, batch.meta.slot_mapping, k_scale, v_scale)
    ref = reference.paged_attention(batch.query, kc, vc, batch.meta, scale=batch.query.shape[-1] ** -0.5,
                                    k_scale=k_scale, v_scale=v_scale)
    return kc, vc, ref


@pytest.mark.parametrize("block_size", [16, 1, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_mixed_long_batch_llama8b_shape(ops, block_size, dtype):
    batch = make_batch(MIXED, 4, H=32, Hkv=8, D=128, block_size=block_size, dtype=dtype, device="cuda")
    kc, vc, ref = _written(batch)
    meta = replace(batch.meta, unified_work=None)
    out = ops.unified_paged_attention(batch.query, kc, vc, meta, 128 ** -0.5)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("H,Hkv,D", [(28, 4, 128), (16, 16, 64), (14, 2, 64), (32, 8, 128)])
@pytest.mark.parametrize("share", [None, 4, 4096])
def test_shapes_and_split_plans(ops, H, Hkv, D, share):
    """GQA groups 7, 1, 7 and 4; the device's split plan, almost none, and many splits."""
    shapes = [(7000, 1), (33, 1), (0, 200), (450, 129), (9000, 700)]
    batch = make_batch(shapes, 2, H=H, Hkv=Hkv, D=D, block_size=16, dtype=torch.bfloat16, device="cuda", seed=H)
    kc, vc, ref = _written(batch)
    meta = replace(batch.meta, unified_work=None)
    out = ops.unified_paged_attention(batch.query, kc, vc, meta, D ** -0.5, share_programs=share)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[torch.bfloat16])


def test_fp8_kv(ops):
    batch = make_batch(MIXED, 4, H=32, Hkv=8, D=128, block_size=16, dtype=torch.bfloat16, device="cuda", seed=3)
    ks = torch.tensor([0.01], device="cuda")
    vs = torch.tensor([0.008], device="cuda")
    batch.k_cache, batch.v_cache = quantize_kv(batch.k_cache, ks), quantize_kv(batch.v_cache, vs)
    kc, vc, ref = _written(batch, ks, vs)
    meta = replace(batch.meta, unified_work=None)
    out = ops.unified_paged_attention(batch.query, kc, vc, meta, 128 ** -0.5, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[torch.bfloat16])


def test_graph_replays_any_mix(ops):
    """One capture per bucket (4096 tokens, 16 sequences) with no work at capture; replays of three
    different mixes (decodes only, one 4k prompt, decodes beside long chunks) match the reference."""
    T, S, H, Hkv, D, bs, max_blocks = 4096, 16, 32, 8, 128, 16, 4096
    mixes = [[(100, 1)] * 16, [(0, 4000)], [(30000, 1), (5, 1), (60000, 1), (0, 1000), (12000, 2000), (3, 700)]]
    batches = [make_batch(m, next((i for i, (_, q) in enumerate(m) if q != 1), len(m)), H=H, Hkv=Hkv, D=D,
                          block_size=bs, dtype=torch.bfloat16, device="cuda", seed=j, spare_blocks=0)
               for j, m in enumerate(mixes)]
    dev = torch.device("cuda")
    num_blocks = max(b.k_cache.shape[0] for b in batches)
    kc = torch.zeros(num_blocks, bs, Hkv, D, dtype=torch.bfloat16, device=dev)
    vc = torch.zeros_like(kc)
    q = torch.zeros(T, H, D, dtype=torch.bfloat16, device=dev)
    qsl = torch.zeros(S + 1, dtype=torch.int32, device=dev)
    lens = torch.ones(S, dtype=torch.int32, device=dev)
    tables = torch.zeros(S, max_blocks, dtype=torch.int32, device=dev)

    def meta():
        return AttentionMetadata(slot_mapping=torch.full((T,), -1, dtype=torch.long, device=dev), query_start_loc=qsl,
                                 seq_lens=lens, block_tables=tables, num_decodes=0, max_query_len=T,
                                 max_seq_len=max_blocks * bs, block_size=bs,
                                 unified_capacity=ops.unified_capacity(T, S, H, Hkv, dev))
    ops.paged_attention(q, kc, vc, meta(), 128 ** -0.5)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.paged_attention(q, kc, vc, meta(), 128 ** -0.5)
    for batch in batches:
        k_w, v_w, ref = _written(batch)
        n, s = batch.query.shape[0], batch.meta.num_seqs
        kc[:k_w.shape[0]].copy_(k_w)
        vc[:v_w.shape[0]].copy_(v_w)
        q[:n].copy_(batch.query)
        qsl[:s + 1].copy_(batch.meta.query_start_loc)
        qsl[s + 1:].fill_(n)
        lens[:s].copy_(batch.meta.seq_lens)
        lens[s:].fill_(1)
        width = batch.meta.block_tables.shape[1]
        tables[:s, :width].copy_(batch.meta.block_tables)
        graph.replay()
        torch.testing.assert_close(out[:n].float(), ref.float(), **TOL[torch.bfloat16])
