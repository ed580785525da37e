"""Figure 15 on the CPU engine: `python benchmarks/paper/paper_figures.py sharing` runs this.

A tiny random OPT (tests/tiny_models.py, float32, made offline) serves the first
--sharing-requests alpaca-like requests (paper §6 lengths, token ids folded into its vocab)
with n=k parallel samples and with beam width k; see pagedserve/benchmark/sharing.py for
what is counted. Block size 16 as in the paper; prefix caching off so that only the
sharing of parallel sampling / beam search is measured; a cache large enough that nothing
is preempted.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import figure_plots as plots

MAX_MODEL_LEN = 512   # the tiny model's positions
VOCAB = 320           # the tiny tokenizer's vocabulary (the model pads past it)
PAPER = {"parallel_sampling": (0.061, 0.098), "beam_search": (0.376, 0.552)}


def run(args, write_json) -> dict:
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from tiny_models import make_tiny_model

    from pagedserve import LLM
    from pagedserve.benchmark.sharing import alpaca_prompts, measure_beam_search, measure_parallel_sampling

    widths = [int(x) for x in args.sharing_widths.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.sharing_model or make_tiny_model("opt", tmp)

        def make_llm():
            return LLM(str(model_dir), device="cpu", dtype="float32", block_size=16, enable_prefix_caching=False,
                       num_gpu_blocks_override=4096, swap_space=0.01, max_model_len=MAX_MODEL_LEN, seed=0)

        reqs = alpaca_prompts(args.sharing_requests, VOCAB, MAX_MODEL_LEN)
        results = {"parallel_sampling": {}, "beam_search": {}}
        for k in widths:
            results["parallel_sampling"][str(k)] = measure_parallel_sampling(make_llm, reqs, k)
            results["beam_search"][str(k)] = measure_beam_search(make_llm, reqs, k)
            print(f"k={k}: parallel sampling saves {results['parallel_sampling'][str(k)]['saving_mean_over_steps']:.1%},"
                  f" beam search {results['beam_search'][str(k)]['saving_mean_over_steps']:.1%}", flush=True)
    ratios = {f"{kind}.k{k}.saving": round(results[kind][str(k)]["saving_mean_over_steps"], 4)
              for kind in results for k in widths}
    config = {"model": "tiny random OPT (tests/tiny_models.py), float32, CPU", "workload": "alpaca-like",
              "num_requests": len(reqs), "prompt_lens": [len(p) for p, _ in reqs],
              "output_lens": [o for _, o in reqs], "block_size": 16, "enable_prefix_caching": False,
              "widths": widths, "parallel_sampling": "SamplingParams(n=k, temperature=1.0, seed=i, ignore_eos=True)",
              "beam_search": "BeamSearchParams(beam_width=k, ignore_eos=True)",
              "saving_definition": "mean over engine steps of 1 - distinct device blocks / block-table entries",
              "paper_figure15": PAPER}
    doc = write_json(args.results_dir / "cpu" / "sharing_memory.json", "sharing_memory", "cpu", config, results,
                     ratios)
    plots.sharing(results, PAPER, args.fig_dir / "sharing_memory.png")
    return doc
