"""An engine-core process without a model, for measuring the serving path around it on CPU.

`python -m pagedserve.benchmark.modelless_core --step-ms 20 [--num-blocks 65536 ...]` followed by
the flags MPCoreClient gives a core (MPCoreClient(config, core_cmd=[...this module and its own
flags...])). It runs EngineCore's own busy loop over ModelLessEngine: the real Scheduler and KV
manager (so block tables, snapshots and their cost are real), one token per running sequence
per step, and each step taking at least --step-ms (the device's share, slept, so it costs no
CPU). What it leaves out: the model, sampling and detokenization.

No torch: nothing here (nor in the core's loop) imports it.
"""
from __future__ import annotations

import argparse
import sys
import time
from types import SimpleNamespace
from typing import Any

from pagedserve.core.config import CacheConfig, SchedulerConfig
from pagedserve.core.kv_state import kv_cache_state
from pagedserve.core.scheduler import Scheduler
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.sequence import Sequence, SequenceGroup, SequenceStatus

EOS = 2  # never sampled: every request runs to max_tokens


class ModelLessEngine:
    """The part of LLMEngine that EngineCore uses, with tokens made up instead of sampled."""

    def __init__(self, num_blocks: int = 65536, block_size: int = 16, max_num_seqs: int = 1024,
                 max_num_batched_tokens: int = 8192, max_model_len: int = 4096, step_s: float = 0.02,
                 vocab_size: int = 32000) -> None:
        self.cache_config = CacheConfig(block_size=block_size, num_gpu_blocks=num_blocks, num_cpu_blocks=0)
        self.scheduler_config = SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                                max_num_batched_tokens=max_num_batched_tokens)
        self.scheduler = Scheduler(self.scheduler_config, self.cache_config)
        self.max_model_len, self.vocab_size, self.eos_token_ids = max_model_len, vocab_size, {EOS}
        self.max_logprobs = 20  # EngineConfig's default; this core computes no logprobs
        self.output_processor = OutputProcessor(None, self.eos_token_ids, max_model_len)
        self.step_s = step_s
        self._next_step = time.monotonic()
        self._groups: dict[str, SequenceGroup] = {}
        self.hooks: list[Any] = []  # called with each snapshot dict (a benchmark's stamps)
        self.config = SimpleNamespace(model="(no model)")  # EngineCore.describe() names the model

    def add_request(self, request_id: str, prompt: dict, params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        if priority:
            raise ValueError("priority: this core serves first come, first served")
        if request_id in self._groups:
            raise ValueError(f"request_id must be unique: {request_id!r} is already running")
        ids = list(prompt["prompt_token_ids"])
        if not ids or len(ids) + (params.max_tokens or 0) > self.max_model_len:
            raise ValueError(f"prompt plus max_tokens must fit max_model_len ({self.max_model_len})")
        group = SequenceGroup(request_id, [Sequence(prompt_token_ids=ids)], params,
                              arrival_time=arrival_time or time.time())
        group.metrics.update(arrival_time=group.arrival_time, num_prompt_tokens=len(ids))
        self._groups[request_id] = group
        self.scheduler.add_seq_group(group)

    def abort_request(self, request_ids: list[str]) -> None:
        known = [r for r in request_ids if self._groups.pop(r, None) is not None]
        if known:
            self.scheduler.abort_seq_group(known)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self._groups)

    def get_kv_cache_stats(self, token_counts: bool = True):
        return self.scheduler.get_kv_cache_stats(token_counts)

    def get_kv_cache_state(self) -> dict:
        state = kv_cache_state(self.scheduler)
        for hook in self.hooks:
            hook(state)
        return state

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        touched: dict[int, SequenceGroup] = {}
        for group in out.ignored:
            for seq in group.seqs:
                seq.status = SequenceStatus.FINISHED_IGNORED
            touched[id(group)] = group
        if not out.is_empty:
            # A fixed clock, as a device would run the steps, whatever the host did meanwhile.
            now = time.monotonic()
            self._next_step = max(self._next_step + self.step_s, now)
            time.sleep(self._next_step - now)
            self.scheduler.update_after_step(out)
            t = time.time()
            append = self.output_processor.append_token
            for s in out.scheduled:
                if not s.do_sample:
                    continue
                seq, group = s.seq, s.group
                if group.first_token_time is None:
                    group.first_token_time = group.metrics["first_token_time"] = t
                status = append(seq, group, 100 + len(seq.output_token_ids) % 1000, 0.0, None)
                if status is not None:
                    seq.status = status
                    self.scheduler.free_seq(seq)
                touched[id(group)] = group
        for group in self.scheduler.free_finished_seq_groups():
            touched.setdefault(id(group), group)
        outputs = []
        for group in touched.values():
            if group.request_id not in self._groups:
                continue  # aborted
            outputs.append(self.output_processor.make_output(group))
            if group.finished:
                del self._groups[group.request_id]
        return outputs

    def shutdown(self) -> None:
        pass


def serve(engine: ModelLessEngine, input_address: str, output_address: str, parent_pid: int,
          wrap_output: Any = None) -> int:
    """The real core process's start-up and busy loop (run_engine_core) around this engine."""
    from pagedserve.engine.core import run_engine_core
    return run_engine_core(None, input_address, output_address, parent_pid, engine=engine,
                           wrap_output=wrap_output)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--num-blocks", type=int, default=65536)
    p.add_argument("--max-num-seqs", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    # What MPCoreClient passes to every core; the config's model settings mean nothing here.
    p.add_argument("--config", required=True)
    p.add_argument("--input", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--specs-checked", action="store_true")  # (MPCoreClient's; no grammars here)
    return p.parse_args(argv)


def make_engine(args: argparse.Namespace) -> ModelLessEngine:
    return ModelLessEngine(args.num_blocks, max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens, step_s=args.step_ms / 1e3)


if __name__ == "__main__":
    a = parse_args()
    sys.exit(serve(make_engine(a), a.input, a.output, a.parent_pid))
