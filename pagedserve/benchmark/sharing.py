"""Memory saved by block sharing for parallel sampling and beam search (paper §6.3, Figure 15).

Measured on the real engine: after every engine step we read the device block tables and
count
  used      distinct physical blocks the live sequences point at (what sharing costs), and
  unshared  block-table entries (= the sum of ref counts), i.e. the blocks the very same
            sequences would hold if each had a private copy of its table (no sharing).
The paper reports "the number of blocks we saved by sharing divided by the number of total
blocks without sharing", averaged over the run; so the headline saving is the mean over
steps of 1 - used / unshared. The block-step weighted saving (1 - sum used / sum unshared)
and the saving at peak (1 - max used / max unshared) are reported beside it.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from pagedserve.layers.sampler import derive_seed
from pagedserve.sampling_params import BeamSearchParams, SamplingParams
from pagedserve.workloads import make_workload


@dataclass
class BlockTrace:
    """Per engine step (steps with any KV held): distinct blocks used and block-table entries."""
    used: list[int] = field(default_factory=list)
    unshared: list[int] = field(default_factory=list)

    def summary(self) -> dict:
        if not self.used:
            return {"steps": 0}
        return {"steps": len(self.used),
                "saving_mean_over_steps": statistics.mean(1 - u / t for u, t in zip(self.used, self.unshared)),
                "saving_block_steps": 1 - sum(self.used) / sum(self.unshared),
                "saving_at_peak": 1 - max(self.used) / max(self.unshared),
                "peak_blocks_used": max(self.used), "peak_blocks_unshared": max(self.unshared)}


class BlockRecorder:
    """Counts blocks after every step of an engine, by wrapping its step method on the instance.

    LLM.generate and LLM.beam_search drive the engine themselves, so this is the one place to
    observe every step without changing them. Use as a context manager.
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self.trace = BlockTrace()

    def __enter__(self) -> BlockTrace:
        inner = self.engine.step
        mgr = self.engine.scheduler.kv_cache_manager

        def step(*args, **kwargs):
            out = inner(*args, **kwargs)
            layouts = mgr.seq_layouts()
            entries = sum(len(lay.block_ids) for lay in layouts)
            if entries:
                self.trace.used.append(len({b for lay in layouts for b in lay.block_ids}))
                self.trace.unshared.append(entries)
            return out

        self.engine.step = step
        return self.trace

    def __exit__(self, *exc) -> None:
        del self.engine.step  # back to the class's method


def alpaca_prompts(num_requests: int, vocab_size: int, max_model_len: int, seed: int = 0):
    """The first requests of alpaca-like (paper §6 lengths), token ids folded into the vocab."""
    out = []
    for r in make_workload("alpaca-like", num_requests, seed=seed):
        prompt = [t % vocab_size for t in r.prompt_token_ids][: max_model_len // 2]
        out.append((prompt, max(1, min(r.output_len, max_model_len - len(prompt)))))
    return out


def measure_parallel_sampling(make_llm, requests, k: int, seed: int = 0) -> dict:
    """n=k samples per prompt with sharing, against the same samples as independent requests
    (seeds derive_seed(seed_i, j), which is how the engine seeds its forks)."""
    # Both runs step synchronously, as the paper's engine did: the overlap's one-step-early slot of
    # every running sequence would otherwise enter the counts (and n > 1 steps synchronously until
    # it forks, its independent twin not at all).
    llm = make_llm()
    llm.llm_engine.async_scheduling = False
    params = [SamplingParams(n=k, temperature=1.0, seed=seed + i, max_tokens=o, ignore_eos=True)
              for i, (_, o) in enumerate(requests)]
    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    with BlockRecorder(llm.llm_engine) as shared:
        outs = llm.generate(prompts, params, use_tqdm=False)
    ind_llm = make_llm()
    ind_llm.llm_engine.async_scheduling = False
    ind_params = [SamplingParams(temperature=1.0, seed=derive_seed(seed + i, j), max_tokens=o, ignore_eos=True)
                  for i, (_, o) in enumerate(requests) for j in range(k)]
    ind_prompts = [pr for pr in prompts for _ in range(k)]
    with BlockRecorder(ind_llm.llm_engine) as independent:
        ind_outs = ind_llm.generate(ind_prompts, ind_params, use_tqdm=False)
    shared_tokens = [c.token_ids for o in outs for c in o.outputs]
    ind_tokens = [o.outputs[0].token_ids for o in ind_outs]
    return {"k": k, **shared.summary(),
            "independent_peak_blocks_used": independent.summary().get("peak_blocks_used"),
            "outputs_equal_independent": shared_tokens == ind_tokens}


def measure_beam_search(make_llm, requests, k: int) -> dict:
    llm = make_llm()
    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    # beam_search takes one params for all its prompts: one call per distinct output length.
    by_len: dict[int, list] = {}
    for p, o in zip(prompts, requests):
        by_len.setdefault(o[1], []).append(p)
    with BlockRecorder(llm.llm_engine) as trace:
        for out_len, group in sorted(by_len.items()):
            llm.beam_search(group, BeamSearchParams(beam_width=k, max_tokens=out_len, ignore_eos=True))
    return {"k": k, **trace.summary()}
