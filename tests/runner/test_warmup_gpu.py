"""No cold start on CUDA (skipped without a GPU): after the engine is built, a varied workload
compiles no new Triton kernel and captures no new CUDA graph.

Triton 3.6 keeps each JITFunction's compiled kernels per device in device_caches[device][0]
(a dict keyed by specialisation and options); the sizes of those dicts before and after the
workload must be equal for every kernel of every pagedserve module loaded.
"""
import random
import sys

import pytest
import torch

from pagedserve import SamplingParams
from pagedserve.attention import Attention

from engine.helpers import make_llm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _jit_functions() -> dict[str, object]:
    """name -> JITFunction, for every Triton function of a loaded pagedserve module."""
    from triton.runtime.jit import JITFunction
    found = {}
    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.startswith("pagedserve.") or mod is None:
            continue
        for name, obj in vars(mod).items():
            while not isinstance(obj, JITFunction) and hasattr(obj, "fn"):  # Autotuner, Heuristics
                obj = obj.fn
            if isinstance(obj, JITFunction):
                found.setdefault(id(obj), (f"{mod_name}.{name}", obj))  # re-exports count once
    return dict(found.values())


def _compiled_counts() -> dict[str, int]:
    return {name: sum(len(entry[0]) for entry in fn.device_caches.values())
            for name, fn in _jit_functions().items()}


def _workload(vocab: int, max_len: int) -> tuple[list[dict], list[SamplingParams]]:
    rng = random.Random(0)
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    prompts, params = [], []
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.8),
        dict(temperature=0.7, top_k=10),
        dict(temperature=0.9, top_p=0.85),
        dict(temperature=0.9, top_k=30, top_p=0.9, min_p=0.02),
        dict(temperature=1.0, seed=7),
        dict(temperature=0.0, logprobs=4),
        dict(temperature=0.8, logprobs=0, repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.3),
        dict(temperature=0.8, n=2, seed=3),                 # forks: copy-on-write of the last block
        dict(temperature=0.0, min_tokens=6),
    ]
    lengths = [1, 2, 3, 15, 16, 17, 31, 64, 100, 130, 200, 300, max_len - 40]
    for i in range(48):
        n = lengths[i % len(lengths)]
        body = [rng.randrange(3, vocab) for _ in range(n)]
        prompts.append({"prompt_token_ids": (shared + body)[:max_len - 20] if i % 3 == 0 else body})
        kind = kinds[i % len(kinds)]
        max_tokens = max(rng.randrange(1, 20), kind.get("min_tokens", 0))
        params.append(SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kind))
    return prompts, params


# A mixture of experts adds the routing, one-program sort/pad and grouped-GEMM kernels.
# cudagraph_mode "full": mixed steps replay full graphs (the unified kernel) and the rest of the
# kernels must still be warm for the steps beyond them. fp8_gemm: FP8 weights with the Triton W8A8
# GEMM (PAGEDSERVE_FP8_GEMM triton / auto: a config per token bucket, split-K kernels).
@pytest.mark.parametrize("arch,enforce_eager,async_scheduling,cudagraph_mode,fp8_gemm",
                         [("llama", e, a, "piecewise", None) for e in (False, True) for a in (True, False)]
                         + [("llama", False, True, "full", None), ("llama", False, False, "full", None)]
                         + [("qwen3_moe", False, True, "piecewise", None), ("mixtral", True, False, "piecewise", None)]
                         + [("llama", False, True, "piecewise", "auto"), ("llama", True, False, "piecewise", "triton")])
def test_no_compile_or_capture_after_start(tiny_model_dir, monkeypatch, arch, enforce_eager, async_scheduling,
                                           cudagraph_mode, fp8_gemm):
    quant = {}
    if fp8_gemm:
        from pagedserve.layers.quant import fp8_ops
        if not fp8_ops.scaled_mm_supported(torch.device("cuda")):
            pytest.skip("needs a GPU with FP8")
        monkeypatch.setattr(fp8_ops, "_GEMM_MODE", fp8_gemm)
        quant = {"quantization": "fp8"}
    _check_no_compile_or_capture(tiny_model_dir, monkeypatch, arch, enforce_eager, async_scheduling, cudagraph_mode,
                                 **quant)


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_no_compile_after_start_with_an_fp8_decode_launch(tiny_model_dir, monkeypatch, enforce_eager):
    """An FP8 KV cache whose decode launch differs from the bf16 one (BLOCK_N, warps, the f16 cast:
    PAGEDSERVE_DECODE_LAUNCH_FP8, as an A/B or a flipped DECODE_FP8_LAUNCH would): the warm-up
    and the graphs compile that launch, and serving meets nothing else."""
    from pagedserve.attention import decode_plan
    monkeypatch.setenv(decode_plan.DECODE_FP8_LAUNCH_ENV, "bn256+w8+s2+f16")
    decode_plan.fp8_decode_launch_settings.cache_clear()
    try:
        assert decode_plan.decode_launch_for(torch.float8_e4m3fn) != decode_plan.decode_launch_for(torch.bfloat16)
        runner = _check_no_compile_or_capture(tiny_model_dir, monkeypatch, "llama", enforce_eager, True, "piecewise",
                                              kv_cache_dtype="fp8")
        assert runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    finally:
        decode_plan.fp8_decode_launch_settings.cache_clear()


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_no_compile_after_start_with_nano_batches(tiny_model_dir, monkeypatch, enforce_eager):
    """Decode steps of >= 4 rows as two nano-batches (models/nano_batches.py): the graphs capture
    their halves' launches, and eagerly the warm-up's decode steps take the same path."""
    runner = _check_no_compile_or_capture(tiny_model_dir, monkeypatch, "llama", enforce_eager, True, "piecewise",
                                          nano_batch_rows=4)
    assert (runner.graphs is not None and bool(runner.graphs.nano)) != enforce_eager


QWEN2_WINDOW = dict(use_sliding_window=True, sliding_window=48, max_window_layers=1,
                    layer_types=["full_attention", "sliding_attention"])


@pytest.mark.parametrize("arch,model,layers", [("qwen2", QWEN2_WINDOW, [(0, 0.0), (48, 0.0)]),
                                               ("gemma2", {}, [(0, 2.0), (16, 2.0)])])
@pytest.mark.parametrize("enforce_eager,cudagraph_mode", [(False, "piecewise"), (False, "full"), (True, "piecewise")])
def test_no_compile_after_start_with_sliding_windows(tiny_model_dir, monkeypatch, enforce_eager, cudagraph_mode,
                                                     arch, model, layers):
    """Qwen2 with a 48-token window on one layer of two, Gemma 2's soft-capped layers with and
    without a window: each (window, cap) is a variant of every attention kernel (WINDOW, SOFTCAP),
    which the warm-up's steps and direct variants must all reach."""
    runner = _check_no_compile_or_capture(tiny_model_dir, monkeypatch, arch, enforce_eager, True, cudagraph_mode,
                                          model=model)
    assert sorted((m.sliding_window, m.logit_softcap) for m in runner.model.modules()
                  if isinstance(m, Attention)) == layers


def _check_no_compile_or_capture(tiny_model_dir, monkeypatch, arch, enforce_eager, async_scheduling,
                                 cudagraph_mode, model: dict | None = None, **llm_kw):
    """Builds the engine (a tiny model of arch with config fields `model`), runs the workload, and
    returns its runner."""
    model_dir = tiny_model_dir(arch, **(model or {}))
    llm = make_llm(model_dir, device="cuda", dtype="bfloat16", enforce_eager=enforce_eager,
                   async_scheduling=async_scheduling, block_size=16, num_gpu_blocks_override=34,
                   max_num_seqs=32, max_num_batched_tokens=128, enable_prefix_caching=True,
                   preemption_mode="swap", swap_space=0.05, cudagraph_mode=cudagraph_mode, **llm_kw)
    runner = llm.llm_engine.runner
    assert "warmup_seconds" in runner.profile
    graphs_before = sorted(runner.graphs.graphs) if runner.graphs is not None else []
    full_before = sorted(runner.full_graphs.graphs) if runner.full_graphs is not None else []
    assert (cudagraph_mode == "full" and not enforce_eager) == bool(full_before)
    compiled_before = _compiled_counts()
    assert sum(compiled_before.values()) > 0, "no Triton kernel found: the check would be vacuous"
    captures = []
    original = torch.cuda.CUDAGraph.capture_begin

    def counting(self, *args, **kwargs):
        captures.append(1)
        return original(self, *args, **kwargs)
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", counting)

    vocab = llm.llm_engine.vocab_size
    prompts, params = _workload(vocab, llm.llm_engine.max_model_len)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(c.token_ids) == p.max_tokens for o, p in zip(outs, params) for c in o.outputs)
    stats = llm.get_kv_cache_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0  # the workload met swaps and prefix hits

    compiled_after = _compiled_counts()
    new = {k: compiled_after[k] - compiled_before.get(k, 0) for k in compiled_after
           if compiled_after[k] != compiled_before.get(k, 0)}
    assert not new, f"Triton compiled after start-up: {new}"
    assert not captures
    assert (sorted(runner.graphs.graphs) if runner.graphs is not None else []) == graphs_before
    assert (sorted(runner.full_graphs.graphs) if runner.full_graphs is not None else []) == full_before
    return runner
