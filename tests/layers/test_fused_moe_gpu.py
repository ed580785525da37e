"""The Triton MoE kernels on CUDA (skipped without a GPU), against the torch path on the same
device, across shapes (tiny, Qwen3-30B-A3B's, Mixtral-8x7B's, with TP=2's halved intermediate)
and dtypes; the whole MoE layer captured in a CUDA graph (no host sync in routing, sort/pad or the
GEMMs) replays with new inputs; every tuned table in the repo loads and gives correct results; the
warm-up runs every config. Whole tiny MoE models against HF in bf16: tests/runner/test_cuda_runner.py
(MoE families are in ARCHS)."""
import functools
import json

import pytest
import torch

from moe_cases import experts, routings, tokens

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = "cuda"
SHAPES = {  # E, H, I (per rank), top_k
    "tiny": (8, 256, 96, 2),
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "qwen3-30b-a3b-tp2": (128, 2048, 384, 8),
    "mixtral-8x7b": (8, 4096, 14336, 2),
}
# Relative to the output's largest magnitude: bf16/fp16 differ from the torch path only in the
# GEMMs' summation order and the final top-k sum (one float32 sum here, bf16 adds there).
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4}


@pytest.fixture(scope="module")
def ops():
    from pagedserve.layers import fused
    fused.reset()
    mod = fused.fused_moe_ops(torch.device(DEV))
    if mod is None:
        pytest.fail("Triton MoE kernels unavailable on CUDA (PAGEDSERVE_FUSED_MOE=0, or the import failed)")
    return mod


@functools.lru_cache(maxsize=None)  # ~10 GB of the GPU for every shape x dtype
def _experts(shape: str, dtype):
    E, H, I, _ = SHAPES[shape]
    return experts(E, H, I, dtype, DEV)


def _close(got, ref, dtype):
    assert got.dtype == ref.dtype and got.shape == ref.shape
    scale = ref.float().abs().max().item()
    err = (got.float() - ref.float()).abs().max().item()
    assert err <= TOL[dtype] * scale, (err, scale)


@pytest.mark.parametrize("T", [1, 7, 64, 333])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_triton_matches_torch(ops, shape, dtype, T):
    from pagedserve.layers.fused_moe.reference import fused_experts_torch
    E, H, I, K = SHAPES[shape]
    if shape == "mixtral-8x7b" and dtype == torch.float32 and T > 64:
        pytest.skip("fp32 Mixtral at many tokens: slow in the torch path, covered by bf16")
    w13, w2 = _experts(shape, dtype)
    x = tokens(T, H, dtype, DEV)
    logits = torch.randn(T, E, device=DEV, dtype=dtype, generator=torch.Generator(device=DEV).manual_seed(0))
    weights, ids = ops.route(logits, K, True)
    w = weights.to(dtype)
    _close(ops.fused_experts(x, w13, w2, w, ids), fused_experts_torch(x, w13, w2, w, ids), dtype)


@pytest.mark.parametrize("case", list(routings(9, 8, 2)))
def test_dispatch_corners(ops, case):
    from pagedserve.layers.fused_moe.reference import fused_experts_torch
    w13, w2 = experts(8, 256, 96, torch.bfloat16, DEV)
    weights, ids = routings(9, 8, 2)[case]
    weights, ids = weights.to(DEV), ids.to(DEV)
    x = tokens(weights.shape[0], 256, torch.bfloat16, DEV)
    _close(ops.fused_experts(x, w13, w2, weights, ids, may_drop=case == "dropped_pairs"),
           fused_experts_torch(x, w13, w2, weights, ids), torch.bfloat16)


@pytest.mark.parametrize("renormalize", [False, True])
def test_route_matches_torch(ops, renormalize):
    from pagedserve.layers.fused_moe.routing import select_experts_torch
    logits = torch.randn(300, 128, device=DEV, dtype=torch.bfloat16)
    w, ids = ops.route(logits, 8, renormalize)
    ref_w, ref_ids = select_experts_torch(logits, 8, renormalize)
    # bf16 logits over 128 experts tie often (the H200 run at 60933c1 found 5% of ids differing):
    # among tied logits any id is a right pick. So: distinct experts, the same picked values in
    # the same order, and the same ids in every row with no tie among its top k + 1 logits.
    assert (ids.sort(dim=1).values.diff(dim=1) != 0).all()
    picked, ref_picked = logits.float().gather(1, ids.long()), logits.float().gather(1, ref_ids.long())
    assert torch.equal(picked, ref_picked)
    top = logits.float().topk(9, dim=1).values
    untied = (top.diff(dim=1) != 0).all(dim=1)
    assert untied.sum() > 30 and torch.equal(ids[untied], ref_ids[untied])
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)


def test_layer_replays_in_cuda_graph(ops):
    from pagedserve.layers.fused_moe import FusedMoE
    E, H, I, K = SHAPES["qwen3-30b-a3b"]
    layer = FusedMoE(E, K, H, I, renormalize=True, round_weights=True).to(DEV, torch.bfloat16)
    w13, w2 = experts(E, H, I, torch.bfloat16, DEV)
    layer.w13_weight.data.copy_(w13)
    layer.w2_weight.data.copy_(w2)
    x = torch.zeros(16, H, device=DEV, dtype=torch.bfloat16)
    logits = torch.zeros(16, E, device=DEV, dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(x, logits)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x, logits)
    for seed in range(3):
        g = torch.Generator(device=DEV).manual_seed(seed)
        x.copy_(torch.randn(16, H, generator=g, device=DEV))
        logits.copy_(torch.randn(16, E, generator=g, device=DEV))
        graph.replay()
        _close(out.clone(), layer(x, logits), torch.bfloat16)


def test_tuned_tables_load_and_are_correct(ops):
    from pagedserve.layers.fused_moe.config import CONFIG_DIR, KEYS
    from pagedserve.layers.fused_moe.reference import fused_experts_torch
    files = sorted(CONFIG_DIR.glob("E=*.json"))
    if not files:
        pytest.skip("no tuned tables in the repo yet (benchmarks/kernels/tune_fused_moe.py writes them)")
    from moe_cases import fp8_experts
    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
              "fp8_w8a8": torch.bfloat16}  # FP8 experts: bfloat16 activations
    for path in files:
        fields = dict(kv.split("=", 1) for kv in path.stem.split(","))
        E, H, I, dtype = int(fields["E"]), int(fields["H"]), int(fields["I"]), dtypes[fields["dtype"]]
        w13, w2 = experts(E, H, I, dtype, DEV)
        scales = {}
        if fields["dtype"] == "fp8_w8a8":
            w13, w2, s13, s2 = fp8_experts(w13, w2)
            scales = dict(w13_scale=s13, w2_scale=s2)
        for tokens_key, cfg in json.loads(path.read_text()).items():
            assert set(KEYS) <= set(cfg), path.name
            T = min(int(tokens_key), 64)
            x = tokens(T, H, dtype, DEV)
            logits = torch.randn(T, E, device=DEV, generator=torch.Generator(device=DEV).manual_seed(0))
            w, ids = ops.route(logits, min(8, E), True)
            _close(ops.fused_experts(x, w13, w2, w.to(dtype), ids, cfg, **scales),
                   fused_experts_torch(x, w13, w2, w.to(dtype), ids, **scales), dtype)


def test_warm_up_runs_every_config(ops):
    from pagedserve.layers.fused_moe import FusedMoE
    from pagedserve.layers.fused_moe.warmup import warm_up_moe, warmup_token_counts
    model = torch.nn.Sequential(FusedMoE(8, 2, 256, 96, True, True), FusedMoE(8, 2, 256, 96, True, True))
    model.to(DEV, torch.bfloat16)
    counts = warmup_token_counts(model[0], 256, torch.bfloat16, torch.device(DEV), 512)
    assert warm_up_moe(model, 512) == len(counts) >= 2  # one shape: the second layer adds nothing


@pytest.mark.parametrize("T,E,top_k", [(1, 128, 8), (37, 128, 8), (512, 128, 8), (255, 8, 2), (2048, 8, 2)])
@pytest.mark.parametrize("block_m", [16, 64])
def test_one_program_align_compiles_and_equals_torch(T, E, top_k, block_m):
    """The fast path itself (fused_experts would fall back to torch, with a warning, if it failed)."""
    from pagedserve.layers.fused_moe import align, triton_align, triton_moe
    ids = torch.stack([torch.randperm(E, device=DEV)[:top_k] for _ in range(T)]).to(torch.int32)
    for got, want in zip(triton_align.align_block_size(ids, E, block_m), align.align_block_size(ids, E, block_m)):
        assert torch.equal(got, want)
    assert triton_moe._ONE_PROGRAM_ALIGN["ok"]
