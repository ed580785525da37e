"""The vLLM side: `vllm --config off | draft_model_kK | ngram_kK`, vLLM offline with speculative_config
(draft = target: {"method": "draft_model", "model": <the same dir>}; {"method": "ngram"}), run with
vLLM on sys.path (--site DIR adds it). One config a process: vLLM cannot change its speculative config
after start.

Weights: the checkpoint in args.weights (load_format auto; the draft_model is the same directory), or
vLLM's dummy weights in args.model's config when args.weights is None (vLLM's dummy init is uniform
+-1e-3, norms included, unlike ours: such parts are never set against ours, see collect).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from .common import WARMUP_TOKENS, log, make_prompts, sync, timing

VLLM_ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "VLLM_USE_FLASHINFER_SAMPLER": "0"}


def vllm_counters(llm) -> tuple[int, int] | None:
    """(draft tokens, accepted tokens) from vLLM's metrics (vllm:spec_decode_*), None if absent."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # noqa: BLE001 (an older vLLM, or stats off)
        return None
    got = {m.name: getattr(m, "value", None) for m in metrics}
    d, a = got.get("vllm:spec_decode_num_draft_tokens"), got.get("vllm:spec_decode_num_accepted_tokens")
    return None if d is None or a is None else (int(d), int(a))


def vllm(config: str, args, on_run=None) -> dict:
    """One vLLM config (off, draft_model_kK, ngram_kK): {"bB": {...}} for each batch of args.batches,
    each batch an untimed warm-up generate (WARMUP_TOKENS) then t2 and t, timed; on_run(results), when
    given, after the start and after every batch."""
    import vllm as vllm_pkg
    from vllm import LLM, SamplingParams

    for k, v in VLLM_ENV.items():
        os.environ.setdefault(k, v)
    if args.weights:
        model_dir, scratch = str(args.weights), None
    else:  # dummy: a directory holding the config only
        model_dir = scratch = tempfile.mkdtemp(prefix="spec_vllm_")
        shutil.copy(Path(args.model) / "config.json", Path(model_dir) / "config.json")
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    kw = dict(model=model_dir, load_format="auto" if args.weights else "dummy", skip_tokenizer_init=True,
              dtype="bfloat16", max_model_len=args.max_model_len,
              gpu_memory_utilization=args.vllm_gpu_memory_utilization, max_num_seqs=max(args.batches),
              enable_prefix_caching=False, seed=0, disable_log_stats=False)
    if config != "off":
        method, k = config.rsplit("_k", 1)
        spec = {"method": method, "num_speculative_tokens": int(k)}
        if method == "draft_model":
            spec["model"] = model_dir
        else:
            spec.update(prompt_lookup_min=1, prompt_lookup_max=5)
        kw["speculative_config"] = spec
    t0 = time.perf_counter()
    llm = LLM(**kw)
    results: dict = {"engine_seconds": round(time.perf_counter() - t0, 1), "vllm_version": vllm_pkg.__version__,
                     "llm_kwargs": {k: v for k, v in kw.items() if k != "model"}}
    log(f"vllm {config}: engine up in {results['engine_seconds']} s")
    if on_run is not None:
        on_run(results)

    def gen(prompts, n):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        sync()
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        sync()
        return time.perf_counter() - t, [list(o.outputs[0].token_ids) for o in outs]

    for b in args.batches:
        prompts = make_prompts(b, args.prompt_len, vocab)
        warmup, _ = gen(prompts, WARMUP_TOKENS)
        t2, _ = gen(prompts, 2)
        before = vllm_counters(llm)
        t, outs = gen(prompts, args.output_len)
        after = vllm_counters(llm)
        res = timing(t, t2, warmup, outs, args.output_len)
        if before is not None and after is not None and after[0] > before[0]:
            res.update(proposed_tokens=after[0] - before[0], accepted_tokens=after[1] - before[1],
                       acceptance_rate=round((after[1] - before[1]) / (after[0] - before[0]), 4))
        results[f"b{b}"] = res
        log(f"vllm {config} b{b}: {res}")
        if on_run is not None:
            on_run(results)
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)
    return results
