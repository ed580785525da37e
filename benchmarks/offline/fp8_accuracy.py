"""FP8 accuracy of the demo model (real weights), measured through pagedserve's own model and paged KV.

Modes: baseline (the model dtype, float32 on CPU; bfloat16 on CUDA), fp8 weights (`quantization=
"fp8"`: per-channel weights, dynamic per-token activations), fp8 KV (e4m3 cache; scales 1.0, and
calibrated as `calculate_kv_scales` does at start-up, per layer or per KV head with
`kv_cache_scale_strategy="attn_head"`), and both. For each:
  - perplexity on pagedserve/demo_model/heldout.txt by eval.json's procedure (chapters as
    <s> chapter </s>, non-overlapping 512-token windows, every token but a window's first
    predicted); each window is one prefill that writes its K/V into a paged pool of the mode's
    dtype and attends over what the pool holds, as serving does;
  - mean KL(baseline || mode) of the next-token distributions over the same tokens;
  - greedy agreement: the first 64 greedy tokens of the LLM engine (the real serving path,
    decodes included) after each chapter's first 24 tokens, against the baseline's: the mean
    fraction of positions equal, and the mean length of the common prefix.
Writes benchmarks/results/cpu/fp8_accuracy.json (or --output). The engines run eagerly (no CUDA graphs
to capture for each mode; tests/attention/test_fp8_gpu.py checks graphs against eager).
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from pagedserve import SamplingParams  # noqa: E402
from pagedserve.attention import AttentionMetadata  # noqa: E402
from pagedserve.attention.backend import Attention  # noqa: E402
from pagedserve.attention.kv_quant import FP8_KV_DTYPE  # noqa: E402
from pagedserve.benchmark.results import write_result  # noqa: E402
from pagedserve.entrypoints.llm import LLM  # noqa: E402
from pagedserve.layers.quant import get_quantization_config  # noqa: E402
from pagedserve.models.loader import get_model, load_hf_config  # noqa: E402

DEMO = ROOT / "pagedserve" / "demo_model"
WINDOW, BLOCK, GREEDY_TOKENS, PROMPT_TOKENS = 512, 16, 64, 24
MODES = {  # name: (quantization, kv_cache_dtype, calculate_kv_scales, kv_cache_scale_strategy)
    "baseline": (None, "auto", False, "tensor"),
    "fp8_weights": ("fp8", "auto", False, "tensor"),
    "fp8_kv": (None, "fp8", False, "tensor"),
    "fp8_kv_calibrated": (None, "fp8", True, "tensor"),
    "fp8_kv_calibrated_per_head": (None, "fp8", True, "attn_head"),
    "fp8_weights_and_kv": ("fp8", "fp8", False, "tensor"),
    "fp8_weights_and_kv_calibrated": ("fp8", "fp8", True, "tensor"),
}


def heldout_ids(tok) -> tuple[list[int], list[list[int]]]:
    text = (DEMO / "heldout.txt").read_text().strip("\n")
    chapters = [tok(c).input_ids for c in text.split("\n\n")]
    return [t for c in chapters for t in c + [tok.eos_token_id]], chapters


def window_logits(model, ids: list[int], kv_dtype: torch.dtype, device) -> torch.Tensor:
    """Logits [n, vocab] of one prefill of ids through a paged pool of kv_dtype."""
    cfg = model.config
    n, nb = len(ids), -(-len(ids) // BLOCK)
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    pools = [tuple(torch.zeros(nb, BLOCK, cfg.num_key_value_heads, hd, dtype=kv_dtype, device=device)
                   for _ in range(2)) for _ in range(cfg.num_hidden_layers)]
    i32 = dict(dtype=torch.int32, device=device)
    meta = AttentionMetadata(slot_mapping=torch.arange(n, device=device), query_start_loc=torch.tensor([0, n], **i32),
                             seq_lens=torch.tensor([n], **i32), block_tables=torch.arange(nb, **i32)[None],
                             num_decodes=0, max_query_len=n, max_seq_len=n, block_size=BLOCK,
                             query_lens_cpu=[n], seq_lens_cpu=[n])
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids, device=device), torch.arange(n, device=device),
                                          pools, meta)).float()


def build(mode: str, hf, dtype, device):
    quant, kv = MODES[mode][:2]
    model = get_model(hf, model_dir=DEMO, device=device, dtype=dtype,
                      quant_config=get_quantization_config(quant, hf))
    return model, (FP8_KV_DTYPE if kv == "fp8" else dtype)


def calibrate_like_startup(mode: str, dtype: str, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The scales calculate_kv_scales gives at engine start-up (its random-prompt forward): each
    layer's K and V scales, [1] or [num_kv_heads]."""
    quant, kv, _, strategy = MODES[mode]
    llm = LLM(str(DEMO), device=device, dtype=dtype, quantization=quant, kv_cache_dtype="fp8",
              calculate_kv_scales=True, kv_cache_scale_strategy=strategy, num_gpu_blocks_override=64,
              enforce_eager=True)
    scales = [(m.k_scale.clone(), m.v_scale.clone()) for m in llm.llm_engine.runner.model.modules()
              if isinstance(m, Attention)]
    llm.shutdown()
    return scales


def greedy_outputs(mode: str, prompts: list[list[int]], dtype: str, device: str) -> list[list[int]]:
    quant, kv, calibrate, strategy = MODES[mode]
    llm = LLM(str(DEMO), device=device, dtype=dtype, quantization=quant, kv_cache_dtype=kv,
              calculate_kv_scales=calibrate, kv_cache_scale_strategy=strategy, num_gpu_blocks_override=256,
              enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="baseline dtype (default: float32 on CPU, bfloat16 on CUDA)")
    ap.add_argument("--output", default=str(ROOT / "benchmarks/results/cpu/fp8_accuracy.json"))
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset (baseline is always run first)")
    args = ap.parse_args()
    modes = ["baseline"] + [m for m in args.modes.split(",") if m != "baseline"]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"--modes: unknown {unknown}; known: {', '.join(MODES)}")
    dtype_name = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    dtype = getattr(torch, dtype_name)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(DEMO)
    hf = load_hf_config(DEMO)
    ids, chapters = heldout_ids(tok)
    windows = [ids[i:i + WINDOW] for i in range(0, len(ids) - 1, WINDOW) if len(ids[i:i + WINDOW]) >= 2]
    prompts = [c[:PROMPT_TOKENS] for c in chapters]

    base_logp, results = None, {}
    for mode in modes:
        model, kv_dtype = build(mode, hf, dtype, args.device)
        scales = None
        if MODES[mode][2]:
            scales = calibrate_like_startup(mode, dtype_name, args.device)
            layers = [m for m in model.modules() if isinstance(m, Attention)]
            for m, (k, v) in zip(layers, scales):
                m.set_kv_scale_per_head(k.numel() > 1)
                m.k_scale.copy_(k)
                m.v_scale.copy_(v)
        logps = [F.log_softmax(window_logits(model, w, kv_dtype, args.device)[:-1], -1) for w in windows]
        targets = [torch.tensor(w[1:], device=args.device) for w in windows]
        nll = sum(-lp.gather(1, t[:, None]).sum().item() for lp, t in zip(logps, targets))
        count = sum(len(t) for t in targets)
        entry = {"perplexity": round(math.exp(nll / count), 4), "tokens": count}
        if base_logp is None:
            base_logp, base_ppl = logps, entry["perplexity"]
        else:
            kl = sum(F.kl_div(lp, b, log_target=True, reduction="sum").item() for lp, b in zip(logps, base_logp))
            entry["mean_kl_vs_baseline"] = round(kl / count, 6)
            entry["perplexity_change_pct"] = round(100 * (entry["perplexity"] / base_ppl - 1), 3)
            entry["within_2pct"] = abs(entry["perplexity"] / base_ppl - 1) <= 0.02
        if scales:
            # over every layer (and head, per head)
            ks, vs = torch.cat([k for k, _ in scales]), torch.cat([v for _, v in scales])
            entry["kv_scales_k_range"] = [round(ks.min().item(), 5), round(ks.max().item(), 5)]
            entry["kv_scales_v_range"] = [round(vs.min().item(), 5), round(vs.max().item(), 5)]
        entry["greedy"] = greedy_outputs(mode, prompts, dtype_name, args.device)
        results[mode] = entry
        print(mode, {k: v for k, v in entry.items() if k != "greedy"}, flush=True)
    base = results["baseline"]["greedy"]
    for mode, entry in results.items():
        outs = entry.pop("greedy")
        if mode == "baseline":
            continue
        same = [sum(a == b for a, b in zip(o, r)) / GREEDY_TOKENS for o, r in zip(outs, base)]
        prefix = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), GREEDY_TOKENS) for o, r in zip(outs, base)]
        entry["greedy_agreement_64"] = round(sum(same) / len(same), 4)
        entry["greedy_common_prefix_mean"] = round(sum(prefix) / len(prefix), 2)
        entry["greedy_identical_sequences"] = f"{sum(p == GREEDY_TOKENS for p in prefix)}/{len(prefix)}"
    config = {"model": "pagedserve/demo_model (real weights, Llama, 4 layers, 1.5M parameters)",
              "baseline_dtype": dtype_name, "heldout": "heldout.txt, eval.json's procedure", "window": WINDOW,
              "block_size": BLOCK, "greedy": f"{len(prompts)} prompts (each chapter's first {PROMPT_TOKENS} tokens), "
                                             f"{GREEDY_TOKENS} tokens, LLM engine",
              "modes": {m: {"quantization": q, "kv_cache_dtype": k, "calculate_kv_scales": c,
                            "kv_cache_scale_strategy": st}
                        for m, (q, k, c, st) in MODES.items() if m in modes},
              "target": "perplexity within 2% of the baseline in every FP8 mode"}
    device = "cpu" if args.device == "cpu" else None
    write_result(args.output, "fp8_accuracy", None, config, results, device=device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
