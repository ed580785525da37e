"""Test harness: drive the ModelRunner by hand (no scheduler), with deliberately scattered blocks.

Plays the core's role in the simplest honest way: a shuffled free list of physical blocks,
per-sequence block tables grown on demand, ScheduledSequence objects built per step.
"""
from __future__ import annotations

import random

import torch

from pagedserve.config import EngineConfig
from pagedserve.core.plan import ScheduledSequence, SchedulerOutput
from pagedserve.models.loader import load_hf_config
from pagedserve.runner.model_runner import ModelRunner
from pagedserve.sampling_params import SamplingParams
from pagedserve.sequence import Sequence, SequenceGroup


def make_runner(model_dir, block_size: int = 16, num_blocks: int = 256, num_cpu_blocks: int = 32,
                quantization: str | None = None, **engine_args) -> ModelRunner:
    """engine_args: further EngineConfig fields."""
    cfg = EngineConfig(model=str(model_dir), block_size=block_size, num_gpu_blocks_override=num_blocks,
                       device="cpu", dtype="float32", swap_space=0, quantization=quantization, **engine_args)
    runner = ModelRunner(cfg, load_hf_config(model_dir), torch.device("cpu"), torch.float32)
    runner.load_model()
    runner.init_kv_cache(num_blocks, num_cpu_blocks)
    return runner


class HandDriver:
    """Owns block tables for a few sequences; builds steps; appends greedy tokens."""

    def __init__(self, runner: ModelRunner, seed: int = 0):
        self.runner, self.bs = runner, runner.block_size
        self.free = list(range(runner.cache_engine.num_gpu_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.groups: dict[int, SequenceGroup] = {}

    def add(self, prompt: list[int]) -> Sequence:
        seq = Sequence(prompt_token_ids=list(prompt))
        self.tables[seq.seq_id] = []
        self.groups[seq.seq_id] = SequenceGroup(request_id=str(seq.seq_id), seqs=[seq],
                                                sampling_params=SamplingParams(temperature=0.0))
        return seq

    def schedule(self, seq: Sequence, num_new: int | None = None) -> ScheduledSequence:
        """Run the next num_new uncomputed tokens of seq (all of them by default); grows its table."""
        start = seq.num_computed_tokens
        n = seq.num_tokens - start if num_new is None else num_new
        table = self.tables[seq.seq_id]
        while len(table) * self.bs < start + n:
            table.append(self.free.pop())
        return ScheduledSequence(seq=seq, group=self.groups[seq.seq_id], start=start, num_new_tokens=n,
                                 block_table=list(table))

    def step(self, scheduled: list[ScheduledSequence], **cache_ops) -> torch.Tensor | None:
        """Execute; mark tokens computed; append the argmax for each sampling sequence."""
        out = SchedulerOutput(scheduled=scheduled, **cache_ops)
        logits = self.runner.execute(out)
        for s in scheduled:
            s.seq.num_computed_tokens = s.context_len
        sampling = [s for s in scheduled if s.do_sample]
        if logits is not None:
            assert logits.shape == (len(sampling), self.runner.vocab_size) and logits.dtype == self.runner.dtype
            for s, tok in zip(sampling, logits.argmax(-1).tolist()):
                s.seq.append_token(tok)
        else:
            assert not sampling
        return logits


def hf_model(model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF generate(do_sample=False) continuation (may stop early at EOS)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=2)
    return out[0, len(prompt):].tolist()


class Lockstep:
    """Two runners driven through the same hand-scheduled steps (a reference and the one under
    test): step(*items), items (name, num_new or None), a name seen first added with its prompt
    in both; returns the two steps' logits and records the runners' last_graph_path pairs."""

    def __init__(self, reference: ModelRunner, tested: ModelRunner, prompts, seed: int = 0):
        self.runners = (reference, tested)
        self.drivers = (HandDriver(reference, seed=seed), HandDriver(tested, seed=seed))
        self.prompts = prompts
        self.seqs: dict = {}  # (name, 0 or 1) -> Sequence
        self.paths: list[tuple[str, str]] = []

    def step(self, *items) -> list[torch.Tensor | None]:
        logits = []
        for key, d in enumerate(self.drivers):
            sched = []
            for name, num_new in items:
                if (name, key) not in self.seqs:
                    self.seqs[name, key] = d.add(self.prompts[name])
                sched.append(d.schedule(self.seqs[name, key], num_new))
            logits.append(d.step(sched))
        self.paths.append(tuple(r.last_graph_path for r in self.runners))
        return logits
