"""FP8 KV cache with per-KV-head checkpoint scales at TP=2 (two processes, gloo, float32): each rank
keeps its own KV head's scales (loader: sharded as k_proj / v_proj) and generates exactly what
TP=1 does. The scales differ 25x between the heads and the smaller one clips some of head 0's K/V
at +-448, so a rank reading the other head's scales would not match."""
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from pagedserve import LLM
from tp_helpers import assert_same_greedy, greedy, launch_children

K_SCALES, V_SCALES = torch.tensor([0.002, 0.05]), torch.tensor([0.04, 0.0016])


def test_tp2_per_head_kv_scales_match_tp1(tiny_model_dir, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir("llama"), model)  # 2 KV heads: one per rank at TP=2
    tensors = load_file(str(model / "model.safetensors"))
    for layer in range(2):
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = K_SCALES.clone()
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = V_SCALES.clone()
    save_file(tensors, str(model / "model.safetensors"))
    kw = dict(device="cpu", num_gpu_blocks_override=64, block_size=8, kv_cache_dtype="fp8")
    one = LLM(str(model), **kw)
    attn = one.llm_engine.runner.model.model.layers[0].self_attn.attn
    assert torch.equal(attn.k_scale, K_SCALES) and torch.equal(attn.v_scale, V_SCALES)
    ref = greedy(one, max_tokens=8)
    one.shutdown()
    llm = LLM(str(model), tensor_parallel_size=2, **kw)
    try:
        rank0 = llm.llm_engine.runner.runner.model.model.layers[0].self_attn.attn
        assert torch.equal(rank0.k_scale, K_SCALES[:1]) and torch.equal(rank0.v_scale, V_SCALES[:1])
        assert_same_greedy(ref, greedy(llm, max_tokens=8))
    finally:
        llm.shutdown()
    assert not launch_children(os.getpid())
