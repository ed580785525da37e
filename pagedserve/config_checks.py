"""EngineConfig's checks, run once at construction (EngineConfig.__post_init__ calls
check_engine_config), so that a bad argument fails with its name before any model is loaded. Two
of them also settle a value in place: a field's type (check_types: a path-like str field becomes a
str, a numpy integer an int) and speculative_config (its canonical dict).
"""
from __future__ import annotations

import dataclasses
import numbers
import os

from pagedserve.config_choices import (CHAT_TEMPLATE_CONTENT_FORMATS, CUDAGRAPH_MODES, DTYPES, KV_CACHE_DTYPES,
                                       KV_CACHE_SCALE_STRATEGIES, LOAD_FORMATS, MAX_MODEL_LEN_AUTO,
                                       QUANTIZATION_METHODS, REASONING_PARSERS, STRUCTURED_OUTPUTS_BACKENDS,
                                       TOOL_CALL_PARSERS)
from pagedserve.core.config import PREEMPTION_MODES, SCHEDULING_POLICIES, CacheConfig

# A field's annotation -> (its check, how an error names the type). Not bools for numbers (True
# blocks is a slip), not floats for integers.
_TYPE_CHECKS = {
    "int": (lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool), "an integer"),
    "float": (lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool), "a number"),
    "bool": (lambda v: isinstance(v, bool), "a bool"),
    "str": (lambda v: isinstance(v, str), "a string"),
}


def check_engine_config(config) -> None:
    """Every check of an EngineConfig's arguments (ValueError, or TypeError from check_types).
    config: the EngineConfig, unannotated, as config.py imports this module (no circle)."""
    check_types(config)
    if not -2**63 <= config.seed < 2**64:  # torch's manual_seed range; past it "Overflow when unpacking long long"
        raise ValueError(f"seed must be in [-2**63, 2**64), got {config.seed}")
    if config.speculative_config is not None:
        from pagedserve.spec_decode.config import SpeculativeConfig  # no torch: config stays light
        config.speculative_config = SpeculativeConfig.from_json(config.speculative_config).to_dict()
    if not 0.0 < config.gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {config.gpu_memory_utilization}")
    if config.num_gpu_blocks_override is not None and config.num_gpu_blocks_override < 1:
        raise ValueError(f"num_gpu_blocks_override must be >= 1, got {config.num_gpu_blocks_override}")
    # Finite: NaN passed "< 0" and failed later as "cannot convert float NaN to integer".
    for name in ("swap_space", "cpu_kv_cache_gib"):
        if not 0 <= getattr(config, name) < float("inf"):
            raise ValueError(f"{name} must be a finite number >= 0 GiB, got {getattr(config, name)}")
    if config.long_prefill_token_threshold < 0:
        raise ValueError(f"long_prefill_token_threshold must be >= 0 (0: off), got {config.long_prefill_token_threshold}")
    if config.long_prefill_chunk_align is not None and config.long_prefill_chunk_align < 0:
        raise ValueError(f"long_prefill_chunk_align must be >= 0 (0: off), got {config.long_prefill_chunk_align}")
    if config.long_prefill_drain < 0:
        raise ValueError(f"long_prefill_drain must be >= 0 (0: off), got {config.long_prefill_drain}")
    if not config.long_prefill_cost_scale > 0:
        raise ValueError(f"long_prefill_cost_scale must be > 0, got {config.long_prefill_cost_scale} "
                         "(long_prefill_budget_by_cost=False turns the costs off)")
    if config.long_prefill_budget_by_cost and not config.enable_chunked_prefill:
        raise ValueError("long_prefill_budget_by_cost needs enable_chunked_prefill (it sizes prefill chunks)")
    # Without chunked prefill a prompt is never cut, so these would be ignored without a word.
    if config.long_prefill_token_threshold and not config.enable_chunked_prefill:
        raise ValueError(f"long_prefill_token_threshold ({config.long_prefill_token_threshold}) needs "
                         "enable_chunked_prefill (it caps prefill chunks; 0: off)")
    if config.long_prefill_chunk_align and not config.enable_chunked_prefill:
        raise ValueError(f"long_prefill_chunk_align ({config.long_prefill_chunk_align}) needs "
                         "enable_chunked_prefill (it aligns prefill chunks; 0: off)")
    if config.dtype not in DTYPES:
        raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {config.dtype!r}")
    if config.quantization is not None and config.quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization method {config.quantization!r} is not supported (supported: "
                         f"{', '.join(QUANTIZATION_METHODS)})")
    if config.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {config.kv_cache_dtype!r}")
    if config.calculate_kv_scales and config.kv_cache_dtype == "auto":
        raise ValueError("calculate_kv_scales needs kv_cache_dtype fp8")
    if config.kv_cache_scale_strategy not in KV_CACHE_SCALE_STRATEGIES:
        raise ValueError(f"kv_cache_scale_strategy must be one of {KV_CACHE_SCALE_STRATEGIES}, "
                         f"got {config.kv_cache_scale_strategy!r}")
    if config.kv_cache_scale_strategy != "tensor" and not config.calculate_kv_scales:
        raise ValueError(f"kv_cache_scale_strategy {config.kv_cache_scale_strategy!r} needs calculate_kv_scales "
                         "(it says how they are calculated; a checkpoint's per-head scales load without it)")
    if config.load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be auto, safetensors or dummy, got {config.load_format!r}")
    if config.tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {config.tensor_parallel_size}")
    if config.max_model_len is not None and config.max_model_len < 1 and config.max_model_len != MAX_MODEL_LEN_AUTO:
        raise ValueError(f"max_model_len must be >= 1, or -1 (auto: what the KV cache holds), got {config.max_model_len}")
    if config.hf_overrides is not None:
        if not isinstance(config.hf_overrides, dict) or not all(isinstance(k, str) for k in config.hf_overrides):
            raise ValueError(f"hf_overrides must be a JSON object of config fields, got {config.hf_overrides!r}")
        for key in ("rope_scaling", "rope_parameters"):
            if key in config.hf_overrides and not isinstance(config.hf_overrides[key], dict):
                raise ValueError(f"hf_overrides: {key} must be an object, got {config.hf_overrides[key]!r}")
    # Validate the pieces early so a bad argument fails before any model is loaded.
    CacheConfig(block_size=config.block_size, kv_allocator=config.kv_allocator)
    if config.scheduling_policy not in SCHEDULING_POLICIES:
        raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {config.scheduling_policy!r}")
    if config.preemption_mode not in PREEMPTION_MODES:
        raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {config.preemption_mode!r}")
    if config.max_logprobs < -1:
        raise ValueError(f"max_logprobs must be >= 0, or -1 (the whole vocabulary), got {config.max_logprobs}")
    if config.max_num_seqs is not None and config.max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {config.max_num_seqs}")
    if config.max_num_batched_tokens is not None and config.max_num_batched_tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be >= 1, got {config.max_num_batched_tokens}")
    if config.enable_auto_tool_choice and config.tool_call_parser is None:
        raise ValueError("enable_auto_tool_choice needs tool_call_parser (one of "
                         f"{', '.join(TOOL_CALL_PARSERS)})")
    if config.tool_call_parser is not None and config.tool_call_parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got "
                         f"{config.tool_call_parser!r}")
    if config.chat_template_content_format not in CHAT_TEMPLATE_CONTENT_FORMATS:
        raise ValueError(f"chat_template_content_format must be one of {CHAT_TEMPLATE_CONTENT_FORMATS}, "
                         f"got {config.chat_template_content_format!r}")
    if config.chat_template is not None:  # a missing file fails here, before any model loads
        from pagedserve.engine.chat_template import resolve_chat_template
        resolve_chat_template(config.chat_template)
    if config.override_generation_config is not None and not isinstance(config.override_generation_config, dict):
        raise ValueError(f"override_generation_config must be a JSON object, got {config.override_generation_config!r}")
    from pagedserve.engine.generation_defaults import generation_defaults
    generation_defaults(config.model, config.generation_config, config.override_generation_config)  # fails here
    if config.reasoning_parser is not None and config.reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}, got "
                         f"{config.reasoning_parser!r}")
    if config.cudagraph_mode not in CUDAGRAPH_MODES:
        raise ValueError(f"cudagraph_mode must be one of {CUDAGRAPH_MODES}, got {config.cudagraph_mode!r}")
    if config.structured_outputs_backend not in STRUCTURED_OUTPUTS_BACKENDS:
        raise ValueError(f"structured_outputs_backend must be one of {STRUCTURED_OUTPUTS_BACKENDS}, "
                         f"got {config.structured_outputs_backend!r}")
    if config.structured_outputs_fill_threads is not None and config.structured_outputs_fill_threads < 1:
        raise ValueError(f"structured_outputs_fill_threads must be >= 1, "
                         f"got {config.structured_outputs_fill_threads}")
    if config.structured_outputs_max_whitespace < 0:
        raise ValueError(f"structured_outputs_max_whitespace must be >= 0 (0: unbounded), "
                         f"got {config.structured_outputs_max_whitespace}")
    if not config.structured_outputs_compile_timeout_s > 0:
        raise ValueError(f"structured_outputs_compile_timeout_s must be > 0, "
                         f"got {config.structured_outputs_compile_timeout_s}")
    if config.nano_batch_rows == 1 or config.nano_batch_rows < 0:
        raise ValueError(f"nano_batch_rows must be 0 (off) or >= 2, got {config.nano_batch_rows}")
    if config.nano_batch_sm_carveout < 0 or (config.nano_batch_sm_carveout and not config.nano_batch_rows):
        raise ValueError(f"nano_batch_sm_carveout must be >= 0 and needs nano_batch_rows, got "
                         f"{config.nano_batch_sm_carveout} with nano_batch_rows={config.nano_batch_rows}")
    if config.cuda_graph_sizes is not None:
        if not config.cuda_graph_sizes or any(not isinstance(b, int) or b < 1 for b in config.cuda_graph_sizes):
            raise ValueError(f"cuda_graph_sizes must be a non-empty list of batch sizes >= 1, "
                             f"got {config.cuda_graph_sizes!r}")


def check_types(config) -> None:
    """TypeError naming the argument whose value is not of its field's type (the plain int,
    float, bool and str fields): a string failed as "'<' not supported between 'str' and 'int'",
    seed=None or 1.5 as torch's "manual_seed expected a long", max_model_len=1.5 and
    max_num_seqs=1.5 were taken, and "no" for a bool field was True."""
    for f in dataclasses.fields(config):
        base, _, none = f.type.partition(" | ")
        v = getattr(config, f.name)
        if base not in _TYPE_CHECKS or (v is None and none == "None"):
            continue
        if base == "str" and isinstance(v, os.PathLike):  # a pathlib.Path model directory, say
            v = os.fspath(v)
            setattr(config, f.name, v)
        ok, what = _TYPE_CHECKS[base]
        if not ok(v):
            raise TypeError(f"{f.name} must be {what}{' or None' if none else ''}, got {v!r}")
        if base == "int" and type(v) is not int:
            setattr(config, f.name, int(v))  # numpy's integers
