"""LLMEngine: add_request / step / abort. One step is schedule -> execute -> sample -> outputs.

The engine owns the glue and nothing else: the Scheduler (core) decides which tokens run and
owns every block; the ModelRunner turns the plan into logits; the Sampler picks tokens; the
OutputProcessor appends, detokenizes and applies the stop rules. Per-step host work is
O(scheduled sequences), never O(blocks).

Here: start-up (weights, KV pools, the scheduler, the sampler) and the requests (add, abort, the
per-request state each step reads). The step itself is engine/step_pipeline.py, its token half
engine/token_application.py: mixins of LLMEngine over this state.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Iterable

import torch

from pagedserve.attention.kv_quant import kv_cache_dtype_name
from pagedserve.config import MAX_MODEL_LEN_AUTO, EngineConfig
from pagedserve.core.chunk_cost import CHUNK_ALIGN, COST_MIN_TOKENS
from pagedserve.core.config import CacheConfig
from pagedserve.core.kv_state import kv_cache_state
from pagedserve.core.scheduler import Scheduler
from pagedserve.engine import prompt_logprobs
from pagedserve.engine.beam_driver import BeamSearchDriver
from pagedserve.engine.beam_search import BeamSearchState
from pagedserve.engine.inflight import InflightStep
from pagedserve.engine.bad_words import with_bad_word_ids
from pagedserve.engine.input_processor import InputProcessor, eos_token_ids, load_tokenizer
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.engine.step_pipeline import StepPipeline, overlaps
from pagedserve.engine.step_timer import NULL_STEP_TIMER
from pagedserve.engine.structured import StructuredOutputs
from pagedserve.engine.speculation import Speculator, can_speculate
from pagedserve.engine.token_application import TokenApplication
from pagedserve.layers.sampler import Sampler, needs_only_temperature
from pagedserve.model_cost import ModelCost
from pagedserve.models.loader import get_max_model_len, load_hf_config, resolve_dtype
from pagedserve.outputs import BeamSearchOutput
from pagedserve.sampling_params import BeamSearchParams, SamplingParams
from pagedserve.runner.executor import build_executor
from pagedserve.runner.model_runner import resolve_device
from pagedserve.sequence import Sequence, SequenceGroup
from pagedserve.spec_decode.config import SpeculativeConfig
from pagedserve.spec_decode.factory import load_draft_model
from pagedserve.spec_decode.kv_split import split_kv_budget

logger = logging.getLogger(__name__)


class LLMEngine(StepPipeline, TokenApplication):
    def __init__(self, config: EngineConfig, detokenize: bool = True, serving: bool = False,
                 specs_checked: bool = False):
        """detokenize=False: outputs carry token ids only and stop strings are not applied
        (the API server does both); the tokenizer is still loaded for its EOS ids. serving: the
        engine runs in a core process (the server's, or a direct AsyncLLMEngine's), which picks
        its default step budget (config.batch_defaults). specs_checked: the OpenAI API server is in
        front and has parsed every structured-output spec (a 400 for a bad one), so the engine
        does not parse it again on its step thread (StructuredOutputs' schemas_checked). Not
        `serving`: a direct AsyncLLMEngine user's core serves too, and that user's bad spec must
        still be add_request's ValueError."""
        if config.model is None:
            raise ValueError("model must be a local HF model directory, got None")
        if config.trust_remote_code:
            logger.warning("trust_remote_code: pagedserve runs no code from the checkpoint; it serves the "
                           "architectures it implements (models/registry.py)")
        self.hf_config = load_hf_config(config.model, config.hf_overrides)
        self.device = resolve_device(config.device)
        # max_model_len auto: everything is built for the model's limit, then the length is cut to
        # what the KV pool holds once it is sized (below); the runner's bounds only need to cover it.
        fit_max_model_len = config.max_model_len == MAX_MODEL_LEN_AUTO
        if fit_max_model_len:
            config = dataclasses.replace(config, max_model_len=None)
        # Unset batch limits follow the device, as vLLM's do; the executor and every rank get the result.
        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(self.device)
            config = config.with_batch_defaults(props.total_memory, props.name, serving)
        else:
            config = config.with_batch_defaults(serving=serving)
        self.config = config
        self.dtype = resolve_dtype(config.dtype, self.hf_config, self.device)

        model_max = get_max_model_len(self.hf_config, config.disable_sliding_window)
        max_model_len = config.max_model_len or model_max
        if max_model_len > model_max:
            raise ValueError(f"max_model_len must be <= {model_max} (the model's limit), got {max_model_len}")
        self.max_model_len = max_model_len
        if not fit_max_model_len:
            # Validated now (e.g. a step budget below max_model_len without chunked prefill), not
            # only once the weights are loaded and the KV cache sized (the one kept is built below).
            config.scheduler_config(max_model_len)

        self.tokenizer = None
        if not config.skip_tokenizer_init:
            self.tokenizer = load_tokenizer(config.tokenizer or config.model, config.chat_template)

        spec = self._speculative_config(config)  # checked before any weights load
        # One process, or rank 0 of a tensor-parallel group: the engine cannot tell them apart.
        self.runner = build_executor(config, self.hf_config, self.device, self.dtype)
        self.runner.load_model()
        # A draft model's weights load before the sizing, so the profile counts them; its pool then
        # takes its share of the KV budget (spec_decode/kv_split.py).
        draft = load_draft_model(spec, self) if spec is not None and spec.method == "draft_model" else None
        num_gpu_blocks, num_cpu_blocks = self.runner.determine_num_blocks()
        if draft is not None:
            num_gpu_blocks = self._share_kv_with_draft(num_gpu_blocks, draft)
        if fit_max_model_len:
            max_model_len = self.max_model_len = min(model_max, num_gpu_blocks * config.block_size)
            self.runner.fit_max_model_len(max_model_len)  # LongRoPE's factors depend on it
            logger.info("max_model_len auto: %d tokens (what the KV cache holds: %d blocks of %d; the model's "
                        "limit %d)", max_model_len, num_gpu_blocks, config.block_size, model_max)
        self.runner.init_kv_cache(num_gpu_blocks, num_cpu_blocks)
        self.cache_config = CacheConfig(block_size=config.block_size, num_gpu_blocks=num_gpu_blocks,
                                        num_cpu_blocks=num_cpu_blocks,
                                        enable_prefix_caching=config.enable_prefix_caching,
                                        kv_allocator=config.kv_allocator,
                                        cache_dtype=kv_cache_dtype_name(config.kv_cache_dtype, self.dtype),
                                        # a draft model attends to the whole context through the same tables
                                        sliding_window=0 if draft is not None else
                                        int(self.runner.profile.get("sliding_window_all_layers", 0)))
        self.scheduler_config = config.scheduler_config(max_model_len)
        if config.long_prefill_budget_by_cost:
            self.scheduler_config.attention_cost_context = round(ModelCost.from_hf_config(
                self.hf_config).attention_cost_context() * config.long_prefill_cost_scale)
            self.scheduler_config.attention_cost_min_tokens = COST_MIN_TOKENS
        # Unset (None), the chunk alignment follows the Hopper long-prefill path: where the runner
        # turned it on (it reports the path's prefix bucket), whole query steps of 1,024. Not the
        # bucket (8,192, paired with chunks by cost until the 57th session): beside a decode the
        # budget less its token never fills a bucket, and chunks by tokens alone then drift off the
        # buckets (a 100k prompt beside one decode, H100: 7.37 s at 8,192, 6.87 at 1,024; 6.74 alone).
        if config.long_prefill_chunk_align is None:
            bucket = int(self.runner.profile.get("long_prefill_bucket", 0))
            self.scheduler_config.long_prefill_chunk_align = CHUNK_ALIGN if bucket else 0
        for measured in ("recompute_seconds_per_token", "swap_seconds_per_block"):
            if measured in self.runner.profile:  # see ModelRunner.measures_costs for when they are absent
                setattr(self.scheduler_config, measured, self.runner.profile[measured])
        self.use_scheduler(Scheduler(self.scheduler_config, self.cache_config))
        self.vocab_size = self.runner.vocab_size

        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.seed)
        self.sampler = Sampler(self.generator)
        self.eos_token_ids = eos_token_ids(config.model, self.hf_config, self.tokenizer)
        # Without detokenizing, the API server also makes the Logprob objects (pagedserve/logprobs.py).
        self.output_processor = OutputProcessor(self.tokenizer if detokenize else None,
                                                self.eos_token_ids, max_model_len, logprob_objects=detokenize)

        self._groups: dict[str, SequenceGroup] = {}
        # request id -> temperature, for requests whose rows need nothing but it (decided once, at add):
        # their rows can take Sampler.sample_plain_device
        self._plain_sampling: dict[str, float] = {}
        self._seq_generators: dict[int, torch.Generator] = {}
        # Grammars of structured-output requests (engine/structured/): compiles, matchers, masks.
        self.structured = StructuredOutputs(self.tokenizer, self.vocab_size, self.eos_token_ids, self.device,
                                            config.structured_outputs_backend,
                                            config.structured_outputs_compile_timeout_s,
                                            fill_threads=config.structured_outputs_fill_threads,
                                            max_whitespace=config.structured_outputs_max_whitespace,
                                            schemas_checked=specs_checked)
        self._beams = BeamSearchDriver(self.scheduler, self.tokenizer, self.structured.seqs)
        self.input_processor = InputProcessor(self.tokenizer, self.vocab_size, max_model_len,
                                              self.scheduler_config.max_num_seqs, self.cache_config,
                                              config.max_logprobs, eos_token_ids=self.eos_token_ids)
        self.max_logprobs = self.input_processor.max_logprobs  # -1 resolved to the vocabulary
        # Phase clock (pagedserve.engine.step_timer.StepTimer); the null one does nothing.
        self.step_timer = NULL_STEP_TIMER
        # With tensor parallelism too: the executor hands the sampled ids to every rank's device
        # inside the step (runner/sampled_ids.py).
        self.async_scheduling = config.async_scheduling
        self._sync_requests: set[str] = set()   # unfinished requests that force synchronous steps
        self._inflight: InflightStep | None = None
        self.last_step_tokens = 0  # tokens of the latest step (the server's iteration-tokens histogram)
        # Speculative decoding (engine/speculation.py): the proposer, policy and counters; the
        # requests that may speculate.
        self.speculator: Speculator | None = None
        self._spec_requests: set[str] = set()
        if spec is not None:
            self.speculator = Speculator(spec, self, proposer=draft)

    # ---- construction helpers -------------------------------------------------------------

    @staticmethod
    def _speculative_config(config: EngineConfig) -> SpeculativeConfig | None:
        """The parsed speculative_config, or a ValueError naming a combination that cannot speculate."""
        if config.speculative_config is None:
            return None
        if config.tensor_parallel_size > 1:
            raise ValueError("speculative_config with tensor_parallel_size > 1 is not supported yet")
        if config.kv_allocator != "paged":
            raise ValueError(f"speculative_config needs kv_allocator paged (got {config.kv_allocator!r}): "
                             "the contiguous baselines cannot roll back lookahead slots")
        return SpeculativeConfig.from_json(config.speculative_config)

    def _share_kv_with_draft(self, num_gpu_blocks: int, draft: Any) -> int:
        """Allocate the draft's KV pool and return the target's block count. The budget the runner
        sized for the target alone (its blocks x block bytes: gpu_memory_utilization after both
        models' weights, or cpu_kv_cache_gib) is split by spec_decode/kv_split.py. With
        num_gpu_blocks_override the user sized the target's pool: the draft gets as many blocks."""
        if self.config.num_gpu_blocks_override is not None:
            target, own = num_gpu_blocks, num_gpu_blocks
        else:
            block_bytes = self.runner.block_bytes
            target, own = split_kv_budget(num_gpu_blocks * block_bytes, block_bytes, draft.block_bytes)
            logger.info("KV budget shared with the draft model: %d blocks each (%d + %d bytes per block)",
                        target, block_bytes, draft.block_bytes)
        draft.allocate_kv(own)
        return target

    def use_scheduler(self, scheduler: Scheduler) -> None:
        """Run the engine's steps through `scheduler` (start-up, or a benchmark's fresh policy on the
        same weights and pools); call it with no request in flight."""
        self.scheduler = scheduler
        if getattr(self.runner, "incremental_inputs", False) is True:
            # The runner keeps block tables on the device and wants only what changed each step:
            # it forgets the old scheduler's rows, the new scheduler logs its changes from the start.
            self.runner.reset_request_state()
            scheduler.enable_table_log()

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> "LLMEngine":
        return cls(make_engine_config(model, **kwargs))

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def shutdown(self) -> None:
        """Release the executor (with tensor parallelism: stop and reap the other ranks). Idempotent."""
        self.structured.shutdown()
        self.runner.shutdown()

    # ---- requests -------------------------------------------------------------------------

    def _new_group(self, request_id: str, prompt: Any, params: SamplingParams,
                   arrival_time: float | None) -> SequenceGroup:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._groups:
            raise ValueError(f"request_id must be unique: {request_id!r} is already running")
        text, ids, params = self.input_processor.process(prompt, params)
        now = time.time()
        arrival = now if arrival_time is None else arrival_time
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
        group = SequenceGroup(request_id=request_id, seqs=[Sequence(prompt_token_ids=ids, cache_salt=salt)],
                              sampling_params=params, arrival_time=arrival, prompt=text)
        group.metrics.update(arrival_time=arrival, num_prompt_tokens=len(ids))
        prompt_logprobs.start(group)
        return group

    def add_request(self, request_id: str, prompt: str | list[int] | dict,
                    sampling_params: SamplingParams | None = None, arrival_time: float | None = None,
                    priority: int = 0) -> None:
        """Validate, tokenize and queue a request. Raises ValueError naming the bad field.
        priority (vLLM's): lower runs first, under scheduling_policy "priority" only."""
        self._check_priority(priority)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        sampling_params = with_bad_word_ids(sampling_params, self.tokenizer)
        group = self._new_group(request_id, prompt, sampling_params, arrival_time)
        group.priority = priority
        spec = sampling_params.structured_outputs
        grammar = None if spec is None else self.structured.check(spec)  # ValueError: a bad spec
        seq = group.seqs[0]
        if sampling_params.seed is not None:
            self._seq_generators[seq.seq_id] = self._make_generator(sampling_params.seed)
        p = group.sampling_params
        if needs_only_temperature(p) and p.min_tokens == 0 and p.best_of == 1:
            self._plain_sampling[request_id] = p.temperature
        if not overlaps(p):
            self._sync_requests.add(request_id)
        if self.speculator is not None and can_speculate(p):
            self._spec_requests.add(request_id)
        self._admit(group, grammar)

    def _admit(self, group: SequenceGroup, grammar: Any) -> None:
        """Register the group; it goes to the scheduler now, or, when it waits for its grammar's
        compile, once StructuredOutputs.poll() says it is ready (the start of a later step)."""
        self._groups[group.request_id] = group
        spec = group.sampling_params.structured_outputs
        if spec is None or self.structured.submit(group, spec, grammar):
            self.scheduler.add_seq_group(group)

    def _check_priority(self, priority: Any) -> None:
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority and self.scheduler_config.scheduling_policy != "priority":
            raise ValueError(f"priority ({priority}) needs scheduling_policy 'priority' (--scheduling-policy "
                             "priority); this engine serves first come, first served")

    def add_beam_search_request(self, request_id: str, prompt: str | list[int] | dict,
                                params: BeamSearchParams, arrival_time: float | None = None,
                                priority: int = 0, emit_output: bool = False) -> None:
        """Queue a beam search; its result is taken with pop_beam_search_output once finished,
        or, with emit_output (the engine core serving the API server), step() returns it as a
        RequestOutput: one CompletionOutput per hypothesis, best first, token ids (and, with
        params.logprobs set, each token's PositionLogprobs), no text."""
        self._check_priority(priority)
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if params.beam_width > self.scheduler_config.max_num_seqs:
            raise ValueError(f"beam_width ({params.beam_width}) must be <= max_num_seqs "
                             f"({self.scheduler_config.max_num_seqs})")
        k = self.input_processor.logprob_count("logprobs", params.logprobs)
        if k != params.logprobs:  # -1 as the vocabulary's size
            params = dataclasses.replace(params, logprobs=k)
        spec = params.structured_outputs
        grammar = None if spec is None else self.structured.check(spec)
        sp = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True,
                            structured_outputs=spec)
        group = self._new_group(request_id, prompt, sp, arrival_time)
        group.priority = priority
        self._beams.add(request_id, BeamSearchState(params, self.eos_token_ids, params.max_tokens), emit_output)
        self._sync_requests.add(request_id)
        self._admit(group, grammar)

    def pop_beam_search_output(self, request_id: str) -> BeamSearchOutput | None:
        return self._beams.results.pop(request_id, None)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort running requests; unknown (or already finished) ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        known = [r for r in ids if r in self._groups]
        if not known:
            return
        self.scheduler.abort_seq_group(known)
        for r in known:
            self._forget(self._groups.pop(r))
            self._beams.discard(r)

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

    def get_spec_decode_stats(self):
        """Speculative decoding's counters since start (SpecDecodeStats: drafts, draft and accepted
        tokens, per position, proposer seconds; acceptance_rate and mean_accepted_length), or None
        without speculative_config."""
        return None if self.speculator is None else self.speculator.stats

    def _forget(self, group: SequenceGroup) -> None:
        """Drop the engine's per-request state of a finished or aborted group."""
        rid = group.request_id
        self._plain_sampling.pop(rid, None)
        self._sync_requests.discard(rid)
        self._spec_requests.discard(rid)
        for s in group.seqs:
            self._seq_generators.pop(s.seq_id, None)
            if self.speculator is not None:
                self.speculator.finish(s.seq_id)
        if self.speculator is not None and not self._groups:
            self.speculator.idle()
        self.structured.forget(group)

    def get_kv_cache_state(self) -> dict:
        """Every block's state, the live block tables and the counters, as plain data
        (pagedserve.core.kv_state). O(blocks): for a dashboard at a few Hz, never per step. With
        speculative decoding, its counters too ("spec_decode")."""
        state = kv_cache_state(self.scheduler)
        if self.speculator is not None:
            st = self.speculator.stats
            state["spec_decode"] = dict(dataclasses.asdict(st), acceptance_rate=st.acceptance_rate,
                                        mean_accepted_length=st.mean_accepted_length)
        return state

    def _make_generator(self, seed: int) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        return g


def make_engine_config(model: str | None, **kwargs: Any) -> EngineConfig:
    """EngineConfig from LLM(...)-style keyword arguments; unknown names raise ValueError."""
    names = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "extra"}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise ValueError(f"unknown engine arguments: {', '.join(unknown)} (valid: {', '.join(sorted(names))})")
    return EngineConfig(model=model, **kwargs)
