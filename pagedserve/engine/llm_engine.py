"""LLMEngine: add_request / step / abort. One step is schedule -> execute -> sample -> outputs.

The engine owns the glue and nothing else: the Scheduler (core) decides which tokens run and
owns every block; the ModelRunner turns the plan into logits; the Sampler picks tokens; the
OutputProcessor appends, detokenizes and applies the stop rules. Per-step host work is
O(scheduled sequences), never O(blocks).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Iterable

import torch

from pagedserve.config import CacheConfig, EngineConfig
from pagedserve.core.scheduler import Scheduler
from pagedserve.engine.beam_search import BeamSearchState, LiveBeam
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.layers.sampler import Sampler, SampleRow, derive_seed, needs_only_temperature
from pagedserve.models.loader import get_max_model_len, load_hf_config, resolve_dtype
from pagedserve.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from pagedserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from pagedserve.runner.executor import build_executor
from pagedserve.runner.model_runner import resolve_device
from pagedserve.sequence import Sequence, SequenceGroup, SequenceStatus


FINAL_ONLY = RequestOutputKind.FINAL_ONLY


def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"tokenizer: cannot load a tokenizer from {path!r} (a local HF directory): {e}") from e


def _eos_ids(model_dir: str, hf_config: Any, tokenizer: Any | None) -> set[int]:
    """EOS from the tokenizer and generation_config.json (falling back to config.json)."""
    ids: set[int] = set()

    def add(v):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(x for x in v if isinstance(x, int))
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    try:
        from transformers import GenerationConfig
        add(GenerationConfig.from_pretrained(model_dir, local_files_only=True).eos_token_id)
    except (OSError, ValueError):
        add(getattr(hf_config, "eos_token_id", None))
    return ids


class LLMEngine:
    def __init__(self, config: EngineConfig):
        if config.model is None:
            raise ValueError("model must be a local HF model directory, got None")
        self.config = config
        self.hf_config = load_hf_config(config.model)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.hf_config, self.device)

        model_max = get_max_model_len(self.hf_config)
        max_model_len = config.max_model_len or model_max
        if max_model_len > model_max:
            raise ValueError(f"max_model_len must be <= {model_max} (the model's limit), got {max_model_len}")
        self.max_model_len = max_model_len

        self.tokenizer = None
        if not config.skip_tokenizer_init:
            self.tokenizer = _load_tokenizer(config.tokenizer or config.model)

        # One process, or rank 0 of a tensor-parallel group: the engine cannot tell them apart.
        self.runner = build_executor(config, self.hf_config, self.device, self.dtype)
        self.runner.load_model()
        num_gpu_blocks, num_cpu_blocks = self.runner.determine_num_blocks()
        self.runner.init_kv_cache(num_gpu_blocks, num_cpu_blocks)
        self.cache_config = CacheConfig(block_size=config.block_size, num_gpu_blocks=num_gpu_blocks,
                                        num_cpu_blocks=num_cpu_blocks,
                                        enable_prefix_caching=config.enable_prefix_caching,
                                        kv_allocator=config.kv_allocator)
        self.scheduler_config = config.scheduler_config(max_model_len)
        for measured in ("recompute_seconds_per_token", "swap_seconds_per_block"):
            if measured in self.runner.profile:  # see ModelRunner.measures_costs for when they are absent
                setattr(self.scheduler_config, measured, self.runner.profile[measured])
        self.scheduler = Scheduler(self.scheduler_config, self.cache_config)
        self.vocab_size = self.runner.vocab_size

        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.seed)
        self.sampler = Sampler(self.generator)
        self.eos_token_ids = _eos_ids(config.model, self.hf_config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids, max_model_len)

        self._groups: dict[str, SequenceGroup] = {}
        # request_id -> True when its rows can take Sampler.sample_plain (decided once, at add).
        # request id -> temperature, for requests whose rows need nothing but it (the sampler's plain path)
        self._plain_sampling: dict[str, float] = {}
        self._seq_generators: dict[int, torch.Generator] = {}
        self._beams: dict[str, BeamSearchState] = {}
        self._beam_results: dict[str, BeamSearchOutput] = {}
        # Optional phase clock (pagedserve.engine.step_timer.StepTimer); None costs nothing.
        self.step_timer = None

    # ---- construction helpers -------------------------------------------------------------

    @classmethod
    def from_engine_args(cls, config: EngineConfig) -> "LLMEngine":
        return cls(config)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> "LLMEngine":
        return cls(make_engine_config(model, **kwargs))

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def shutdown(self) -> None:
        """Release the executor (with tensor parallelism: stop and reap the other ranks). Idempotent."""
        self.runner.shutdown()

    # ---- requests -------------------------------------------------------------------------

    def _prompt_ids(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids, text = prompt["prompt_token_ids"], prompt.get("prompt")
            elif "prompt" in prompt:
                return self._prompt_ids(prompt["prompt"])
            else:
                raise ValueError("prompt dict must hold 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError("prompt must be token ids (prompt_token_ids) when skip_tokenizer_init=True")
            return prompt, list(self.tokenizer.encode(prompt))
        else:
            ids, text = prompt, None
        if isinstance(ids, (str, bytes)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt_token_ids must be a list of integers")
        ids = list(ids)
        if not ids:
            raise ValueError("prompt must not be empty (prompt_token_ids is [])")
        return text, ids

    def _check_token_ids(self, name: str, ids: Iterable[int]) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{name} must be in [0, {self.vocab_size}) (the model's vocab), got {bad[:5]}")

    def _new_group(self, request_id: str, prompt: Any, params: SamplingParams,
                   arrival_time: float | None) -> SequenceGroup:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._groups:
            raise ValueError(f"request_id must be unique: {request_id!r} is already running")
        text, ids = self._prompt_ids(prompt)
        self._check_token_ids("prompt_token_ids", ids)
        self._check_token_ids("stop_token_ids", params.stop_token_ids)
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not supported (must be None)")
        if params.best_of > self.scheduler_config.max_num_seqs:
            raise ValueError(f"best_of ({params.best_of}) must be <= max_num_seqs ({self.scheduler_config.max_num_seqs})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt length ({len(ids)} tokens) must be < max_model_len ({self.max_model_len})")
        if params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=self.max_model_len - len(ids))
        elif len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt length ({len(ids)} tokens) + max_tokens ({params.max_tokens}) must be <= "
                f"max_model_len ({self.max_model_len})")
        capacity = self.cache_config.num_gpu_blocks * self.cache_config.block_size
        if self.cache_config.kv_allocator == "paged" and len(ids) + params.max_tokens > capacity:
            # It could never run to the end, even alone: reject it now, not halfway through.
            raise ValueError(
                f"prompt length ({len(ids)} tokens) + max_tokens ({params.max_tokens}) must fit in the KV "
                f"cache ({capacity} token slots = num_gpu_blocks {self.cache_config.num_gpu_blocks} x "
                f"block_size {self.cache_config.block_size})")
        now = time.time()
        arrival = now if arrival_time is None else arrival_time
        group = SequenceGroup(request_id=request_id, seqs=[Sequence(prompt_token_ids=ids)],
                              sampling_params=params, arrival_time=arrival, prompt=text)
        group.metrics.update(arrival_time=arrival, num_prompt_tokens=len(ids))
        return group

    def add_request(self, request_id: str, prompt: str | list[int] | dict,
                    sampling_params: SamplingParams | None = None, arrival_time: float | None = None) -> None:
        """Validate, tokenize and queue a request. Raises ValueError naming the bad field."""
        if sampling_params is None:
            sampling_params = SamplingParams()
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        group = self._new_group(request_id, prompt, sampling_params, arrival_time)
        seq = group.seqs[0]
        if sampling_params.seed is not None:
            self._seq_generators[seq.seq_id] = self._make_generator(sampling_params.seed)
        p = group.sampling_params
        if needs_only_temperature(p) and p.min_tokens == 0 and p.best_of == 1:
            self._plain_sampling[request_id] = p.temperature
        self._groups[request_id] = group
        self.scheduler.add_seq_group(group)

    def add_beam_search_request(self, request_id: str, prompt: str | list[int] | dict,
                                params: BeamSearchParams) -> None:
        """Queue a beam search; its result is taken with pop_beam_search_output once finished."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if params.beam_width > self.scheduler_config.max_num_seqs:
            raise ValueError(f"beam_width ({params.beam_width}) must be <= max_num_seqs "
                             f"({self.scheduler_config.max_num_seqs})")
        sp = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True)
        group = self._new_group(request_id, prompt, sp, None)
        self._beams[request_id] = BeamSearchState(params, self.eos_token_ids, params.max_tokens)
        self._groups[request_id] = group
        self.scheduler.add_seq_group(group)

    def pop_beam_search_output(self, request_id: str) -> BeamSearchOutput | None:
        return self._beam_results.pop(request_id, None)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort running requests; unknown (or already finished) ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        known = [r for r in ids if r in self._groups]
        if not known:
            return
        self.scheduler.abort_seq_group(known)
        for r in known:
            group = self._groups.pop(r)
            self._plain_sampling.pop(r, None)
            self._beams.pop(r, None)
            for s in group.seqs:
                self._seq_generators.pop(s.seq_id, None)

    def has_request(self, request_id: str) -> bool:
        """True while the request is queued or running."""
        return request_id in self._groups

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self._groups)

    def get_kv_cache_stats(self, token_counts: bool = True):
        """KVCacheStats; token_counts=False is the O(1) read (num_live_tokens left None)."""
        return self.scheduler.get_kv_cache_stats(token_counts)

    def _make_generator(self, seed: int) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        return g

    # ---- the step -------------------------------------------------------------------------

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """Run one scheduler step; returns outputs of requests that advanced or finished, each
        in its SamplingParams.output_kind shape. final_only=True treats every request as
        FINAL_ONLY (only finished ones report, which saves copying for offline use); a DELTA
        request then reports everything not yet sent."""
        timer = self.step_timer
        if timer is not None:
            timer.begin()
        out = self.scheduler.schedule()
        if timer is not None:
            timer.mark("schedule")
        touched: dict[int, SequenceGroup] = {}
        for group in out.ignored:
            for seq in group.seqs:
                if not seq.status.finished:
                    seq.status = SequenceStatus.FINISHED_IGNORED
            touched[id(group)] = group
        if not out.is_empty:
            logits = self.runner.execute(out)
            if timer is not None:
                timer.mark("execute", sync=True)
            self.scheduler.update_after_step(out)
            sampled = [s for s in out.scheduled if s.do_sample]
            if sampled and logits is not None:
                now = time.time()
                for s in sampled:
                    group = s.group
                    if group.first_token_time is None:
                        group.first_token_time = now
                        group.metrics["first_token_time"] = now
                    # final_only (for the whole step, or FINAL_ONLY for this request) reports
                    # finished groups only, and every group that finishes here is still in
                    # running, so free_finished_seq_groups() hands it back below.
                    if not final_only and group.sampling_params.output_kind is not FINAL_ONLY:
                        touched[id(group)] = group
                self._process_samples(logits, sampled)

        # The scheduler may also end groups on its own (one that outgrew the whole cache).
        for group in self.scheduler.free_finished_seq_groups():
            touched.setdefault(id(group), group)
        outputs = []
        for group in touched.values():
            rid = group.request_id
            finished = group.finished
            if rid in self._beams:
                if finished:
                    self._finish_beam_group(group)
                continue
            if finished or not final_only:
                outputs.append(self.output_processor.make_output(group))
            if finished:
                self._groups.pop(rid, None)
                self._plain_sampling.pop(rid, None)
                for s in group.seqs:
                    self._seq_generators.pop(s.seq_id, None)
        if timer is not None:
            timer.mark("postprocess")
        return outputs

    def _process_samples(self, logits: torch.Tensor, sampled: list) -> None:
        get = self._plain_sampling.get
        temps = [get(s.group.request_id) for s in sampled]
        if None not in temps and (all(temps) or not any(temps)):
            self._process_plain_samples(logits, sampled, temps)
            return
        rows: list[SampleRow] = []
        targets: list[tuple[Any, int]] = []  # (scheduled seq, fork index) per row
        beam_rows: list[tuple[Any, int]] = []
        for i, s in enumerate(sampled):
            if s.group.request_id in self._beams:
                beam_rows.append((s, i))
                continue
            p = s.group.sampling_params
            seq = s.seq
            suppress = self.output_processor.stop_token_ids(s.group) \
                if len(seq.output_token_ids) < p.min_tokens else []
            first_fork = p.best_of > 1 and len(s.group.seqs) == 1 and not seq.output_token_ids
            for j in range(p.best_of if first_fork else 1):
                if j == 0:
                    gen = self._seq_generators.get(seq.seq_id)
                else:
                    gen = None if p.seed is None else self._make_generator(derive_seed(p.seed, j))
                rows.append(SampleRow(i, p, seq.prompt_token_ids, seq.output_token_ids, gen, suppress))
                targets.append((s, j))
        if rows:
            timer = self.step_timer
            if timer is not None:
                timer.mark("postprocess")
            result = self.sampler.sample(logits, rows)
            if timer is not None:
                timer.mark("sample")
            forks: dict[int, Sequence] = {}
            # Fork first: children copy the parent's tokens before the parent appends its own.
            for r, (s, j) in enumerate(targets):
                if j > 0:
                    child = s.seq.fork()
                    self.scheduler.fork_seq(s.seq, child)
                    s.group.seqs.append(child)
                    if rows[r].generator is not None:
                        self._seq_generators[child.seq_id] = rows[r].generator
                    forks[r] = child
            for r, (s, j) in enumerate(targets):
                seq = forks.get(r, s.seq)
                status = self.output_processor.append_token(
                    seq, s.group, result.token_ids[r], result.logprobs[r], result.top_logprobs[r])
                if status is not None:
                    seq.status = status
                    self.scheduler.free_seq(seq)
                    self._seq_generators.pop(seq.seq_id, None)
        if beam_rows:
            self._beam_step(logits, beam_rows)

    def _process_plain_samples(self, logits: torch.Tensor, sampled: list, temps: list[float]) -> None:
        """Every row needs only its temperature (no seeds, filters, penalties, logprobs, forks)."""
        timer = self.step_timer
        if timer is not None:
            timer.mark("postprocess")
        result = self.sampler.sample_plain(logits, temps)
        if timer is not None:
            timer.mark("sample")
        if self.output_processor.tokenizer is None:
            free = self.scheduler.free_seq
            for seq, status in self.output_processor.append_plain_tokens(sampled, result.token_ids,
                                                                          result.logprobs):
                seq.status = status
                free(seq)
            return
        append = self.output_processor.append_token
        for s, token, logprob in zip(sampled, result.token_ids, result.logprobs):
            seq = s.seq
            status = append(seq, s.group, token, logprob, None)
            if status is not None:
                seq.status = status
                self.scheduler.free_seq(seq)

    # ---- beam search ----------------------------------------------------------------------

    def _beam_step(self, logits: torch.Tensor, beam_rows: list) -> None:
        idx = torch.tensor([i for _, i in beam_rows], device=logits.device)
        x = logits.index_select(0, idx).float()
        temps = [self._beams[s.group.request_id].params.temperature for s, _ in beam_rows]
        if any(t > 0 for t in temps):
            t = torch.tensor([t if t > 0 else 1.0 for t in temps], device=x.device)
            x = x / t[:, None]
        k = max(self._beams[s.group.request_id].num_candidates for s, _ in beam_rows)
        vals, ids = torch.log_softmax(x, dim=-1).topk(min(k, x.shape[-1]), dim=-1)
        vals, ids = vals.tolist(), ids.tolist()
        touched = {}
        for r, (s, _) in enumerate(beam_rows):
            self._beams[s.group.request_id].pending[s.seq.seq_id] = (ids[r], vals[r])
            touched[s.group.request_id] = s.group
        for rid, group in touched.items():
            state = self._beams[rid]
            live = [s for s in group.seqs if not s.status.finished]
            # The scheduler may run a group's beams in different steps (e.g. after a swap-in);
            # the search advances once every live beam has its next-token distribution.
            if all(s.seq_id in state.pending for s in live):
                beams = [(s, *state.pending[s.seq_id]) for s in live]
                state.pending.clear()
                self._advance_beams(group, state, beams)

    def _advance_beams(self, group: SequenceGroup, state: BeamSearchState, beams: list) -> None:
        n = state.num_candidates
        conts = state.step([LiveBeam(seq.output_token_ids, seq.cumulative_logprob, tid[:n], lps[:n])
                            for seq, tid, lps in beams])
        children: dict[int, list] = {}
        for c in conts:
            children.setdefault(c.parent, []).append(c)
        new_seqs: list[Sequence] = []
        for b, (seq, _, _) in enumerate(beams):
            if b not in children:
                seq.status = SequenceStatus.FINISHED_ABORTED
                self.scheduler.free_seq(seq)
        for b, (seq, _, _) in enumerate(beams):
            mine = children.get(b, [])
            for c in mine[1:]:
                child = seq.fork()
                self.scheduler.fork_seq(seq, child)
                child.append_token(c.token, c.logprob)
                new_seqs.append(child)
            if mine:
                seq.append_token(mine[0].token, mine[0].logprob)
                new_seqs.append(seq)
        if state.done:
            for seq in new_seqs:
                seq.status = SequenceStatus.FINISHED_STOPPED
                self.scheduler.free_seq(seq)
        # Dead beams leave the group once freed, so the group never grows past beam_width.
        group.seqs[:] = new_seqs or [beams[0][0]]

    def _finish_beam_group(self, group: SequenceGroup) -> None:
        rid = group.request_id
        state = self._beams.pop(rid)
        self._groups.pop(rid, None)
        prompt = group.prompt_token_ids
        if not state.done:
            # Ended from outside the search (the scheduler ran out of cache): the live beams
            # count as length-finished hypotheses.
            state.finish_live([(s.output_token_ids, s.cumulative_logprob) for s in group.seqs
                               if s.output_token_ids])
        seqs = []
        for h in state.best():
            out_text = full_text = None
            if self.tokenizer is not None:
                out_text = self.tokenizer.decode(h.output_tokens, skip_special_tokens=True)
                full_text = self.tokenizer.decode(prompt + h.output_tokens, skip_special_tokens=True)
            seqs.append(BeamSearchSequence(tokens=prompt + h.output_tokens, cum_logprob=h.cum_logprob,
                                           score=h.score, output_tokens=h.output_tokens, text=full_text,
                                           output_text=out_text, finish_reason=h.finish_reason))
        self._beam_results[rid] = BeamSearchOutput(sequences=seqs)


def make_engine_config(model: str | None, **kwargs: Any) -> EngineConfig:
    """EngineConfig from LLM(...)-style keyword arguments; unknown names raise ValueError."""
    names = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "extra"}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise ValueError(f"unknown engine arguments: {', '.join(unknown)} (valid: {', '.join(sorted(names))})")
    return EngineConfig(model=model, **kwargs)
