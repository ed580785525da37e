"""Engine configuration: dataclasses validated once, at construction.

EngineConfig holds every `LLM(...)` argument; the core only ever sees the two
small torch-free pieces it needs, CacheConfig and SchedulerConfig (core/config.py).
"""
from __future__ import annotations

import dataclasses
import numbers
import os
from dataclasses import dataclass, field

from pagedserve.core.chunk_cost import COST_MIN_TOKENS, COST_SCALE as LONG_PREFILL_COST_SCALE
from pagedserve.core.config import KV_ALLOCATORS, PREEMPTION_MODES, SCHEDULING_POLICIES, CacheConfig, SchedulerConfig

STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar")
# Whitespace characters a JSON grammar allows in one gap (engine/structured/compiler.parse_spec);
# 0: unbounded, as vLLM. Not bounded by default: on the H200 at 3333762 a bound of 20 took the
# constrained TPOT p50 at 10 req/s from 6.0 to 22.3 ms (the bounded grammar's mask fills cost more
# and the host step outran the device's; structured_runs/whitespace_bound_3333762.tar.gz).
STRUCTURED_OUTPUTS_MAX_WHITESPACE = 0
CUDAGRAPH_MODES = ("decode", "piecewise", "full")
# The server's output parsers (entrypoints/openai/tool_parsers, reasoning_parsers; a test keeps
# these lists equal to the registries there, which config must not import).
CHAT_TEMPLATE_CONTENT_FORMATS = ("auto", "string", "openai")
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "phi4_mini_json", "pythonic")
REASONING_PARSERS = ("qwen3", "deepseek_r1")


# max_model_len -1 ("auto" on the command line): fit it to the KV cache once that is sized (LLMEngine).
MAX_MODEL_LEN_AUTO = -1
DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float", "bf16", "fp16", "fp32")
DEVICES = ("auto", "cpu", "cuda")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
QUANTIZATION_METHODS = ("fp8",)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# calculate_kv_scales' granularity, by compressed-tensors' kv_cache_scheme strategy names.
KV_CACHE_SCALE_STRATEGIES = ("tensor", "attn_head")


# Batch limits when the user sets none: vLLM's defaults (its EngineArgs.get_batch_defaults), which an
# experienced user expects. A GPU of >= 70 GiB (H100, H200, MI300; not an A100, where vLLM measured a
# larger token budget to lose throughput) takes 1024 sequences, and a 16384-token step offline (LLM,
# bench) or 8192 behind the server, where a shorter step keeps the running streams' inter-token
# latency down. Elsewhere 256 sequences and 8192 tokens (vLLM's server takes 2048 there; 8192 is
# what our serving figures were measured with).
LARGE_DEVICE_BYTES = 70 * 2**30
SMALL_DEVICE_MAX_NUM_SEQS, SMALL_DEVICE_BATCHED_TOKENS = 256, 8192
LARGE_DEVICE_MAX_NUM_SEQS = 1024
LARGE_DEVICE_BATCHED_TOKENS = {"offline": 16384, "serving": 8192}


def batch_defaults(device_memory_bytes: int, device_name: str, serving: bool) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) for a device of that memory and name (0 and "" for a
    CPU), offline or behind the server."""
    if device_memory_bytes >= LARGE_DEVICE_BYTES and "a100" not in device_name.lower():
        return LARGE_DEVICE_MAX_NUM_SEQS, LARGE_DEVICE_BATCHED_TOKENS["serving" if serving else "offline"]
    return SMALL_DEVICE_MAX_NUM_SEQS, SMALL_DEVICE_BATCHED_TOKENS


# A field's annotation -> (its check, how an error names the type). Not bools for numbers (True
# blocks is a slip), not floats for integers.
_TYPE_CHECKS = {
    "int": (lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool), "an integer"),
    "float": (lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool), "a number"),
    "bool": (lambda v: isinstance(v, bool), "a bool"),
    "str": (lambda v: isinstance(v, str), "a string"),
}


def option(default, help: str, choices: tuple | None = None):
    """A config field with its user-facing description: the CLI builds each flag's help, default
    and choices from this, so a new field gets its documented flag without touching the CLI."""
    metadata = {"help": help}
    if choices is not None:
        metadata["choices"] = choices
    return field(default=default, metadata=metadata)


@dataclass
class EngineConfig:
    """Every `LLM(...)` argument; `pagedserve serve/generate/bench` take each as --dashed-flag.

    async_scheduling (vLLM's name; on by default): overlapped steps. The engine schedules and
    prepares step N+1 while step N runs on the device; N's sampled ids feed N+1 on the device and
    reach the host on a side stream while N+1 runs. Steps fall back to the synchronous path while
    any unfinished request needs what the overlap cannot serve cheaply: beam search, n > 1 or
    best_of > 1 until its first sample (the fork) and prompt_logprobs. With tensor_parallel_size > 1 rank 0
    samples inside the step and broadcasts the ids to the other ranks (runner/sampled_ids.py).
    Greedy, temperature, top-k, top-p, min-p, seeds, logprobs (top-N: copied out with the ids),
    min_tokens (it needs only the count of tokens, in flight ones included), repetition /
    frequency / presence penalties (the token in flight is read on the device), stop tokens /
    strings, max_tokens and structured outputs overlap (a grammar's mask for step N+1 is filled while N+1's forward runs,
    docs/structured-outputs.md).
    Outputs are token-exact either way for greedy and seeded requests; unseeded sampling shares
    one generator, so its draws depend on the batch in both modes. The cost: each running
    sequence holds its next KV slot one step early, and one that stops computes one discarded
    token. False: always synchronous (A/B).
    """
    model: str | None = option(None, "local HF model directory (config.json + *.safetensors)")
    tokenizer: str | None = option(None, "tokenizer directory (default: the model directory)")
    dtype: str = option("auto", "weight and activation dtype; auto: float32 on CPU, the checkpoint's "
                                "float16 or else bfloat16 on CUDA", DTYPES)
    device: str = option("auto", "auto: CUDA when available, else CPU", DEVICES)
    seed: int = option(0, "seed of the engine's random state (requests may set their own)")
    block_size: int = option(16, "tokens per KV-cache block, 1 to 1024")
    gpu_memory_utilization: float = option(0.9, "fraction of GPU memory the engine may use, weights "
                                                "and KV cache together, in (0, 1]")
    num_gpu_blocks_override: int | None = option(None, "KV-cache blocks to allocate instead of "
                                                       "profiling memory (on CPU: instead of "
                                                       "--cpu-kv-cache-gib)")
    swap_space: float = option(4.0, "GiB of pinned CPU memory for KV blocks swapped out under "
                                    "memory pressure")
    max_num_seqs: int | None = option(None, "most sequences in one batch (default, as vLLM's: 1024 "
                                            "on a GPU of >= 70 GiB other than an A100, else 256)")
    max_num_batched_tokens: int | None = option(None, "token budget of one step (default: 16384 "
                                                      "offline and 8192 for serve on such a GPU, "
                                                      "8192 elsewhere; at least max_model_len with "
                                                      "chunked prefill off)")
    max_model_len: int | None = option(None, "longest prompt + output in tokens (default: the "
                                             "model's own limit); -1 or auto: the longest one "
                                             "request the KV cache holds, up to that limit (vLLM's); "
                                             "on the command line also 128K (131072) or 32k (32000)")
    hf_overrides: dict | None = option(None, "JSON object of HF config fields to override, as vLLM's: "
                                             "'{\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": "
                                             "4.0, \"original_max_position_embeddings\": 32768}}' (a RoPE "
                                             "dict merges into the model's own)")
    trust_remote_code: bool = option(False, "vLLM's; pagedserve never runs a checkpoint's own code, it serves "
                                            "the architectures it implements: accepted (with a warning) so "
                                            "vLLM command lines and scripts run")
    disable_sliding_window: bool = option(False, "cap max_model_len at the model's sliding window, so that "
                                                 "every layer attends to the whole context (vLLM's)")
    max_logprobs: int = option(20, "most logprobs, top_logprobs or prompt_logprobs a request may ask for "
                                   "(vLLM's; -1: the whole vocabulary)")
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of prompt prefixes seen before")
    preemption_mode: str = option("auto", "what to do with a sequence when KV blocks run out; auto: "
                                          "the cheaper of swap and recompute, measured",
                                  PREEMPTION_MODES)
    enable_chunked_prefill: bool = option(True, "split long prompts across steps, decodes first")
    scheduling_policy: str = option("fcfs", "fcfs: first come, first served; priority: by each request's "
                                            "priority (lower first), then arrival (vLLM's)", SCHEDULING_POLICIES)
    long_prefill_token_threshold: int = option(0, "a prompt with more tokens left than this prefills at "
                                                  "most this many a step, so decodes beside a very long "
                                                  "prompt wait less per step (vLLM's; 0: off; needs "
                                                  "enable_chunked_prefill)")
    long_prefill_budget_by_cost: bool | None = option(
        None, "in steps with decodes, count a prefill token's attention over the context before it against "
        "max_num_batched_tokens (a token after P earlier ones counts 1 + P/K, K from the model's shape: ~27k "
        "tokens for Llama-3.1-8B; prompts of 8,192+ tokens), so chunks deep in a long prompt are shorter and "
        "the decodes beside it wait less per step (default: on where the Hopper long-prefill path is on; "
        "not vLLM's)")
    long_prefill_cost_scale: float = option(
        LONG_PREFILL_COST_SCALE, "with long_prefill_budget_by_cost: K (the context at which a token's "
        "attention costs as much as its matmuls) times this, so a step beside decodes may cost more (> 1: "
        "fewer, longer steps; a faster prefill, longer gaps for the decodes) or less")
    long_prefill_chunk_align: int | None = option(
        None, "a prefill chunk cut short by the token budget ends on a multiple of this many tokens where "
        "that leaves it half its tokens or 1,024 (the rest follows in the next step, beside the decodes), "
        "so a long prompt's chunks start on the Hopper long-prefill path's prefix buckets (default: 8,192 "
        "where that path is on, else 0: off; set, it needs enable_chunked_prefill; not vLLM's)")
    long_prefill_drain: int = option(
        2048, "N > 0: a new prompt of at least 8,192 tokens (and N) waits, up to one decode step per N of "
        "its tokens, while running requests are that close to their max_tokens, so they finish instead of "
        "stalling through its whole prefill (2048, the default: at most 48 steps before a 100k prompt "
        "starts); 0: off (not vLLM's)")
    enforce_eager: bool = option(False, "never capture CUDA graphs")
    cudagraph_mode: str = option("piecewise", "decode: CUDA graphs for decode-only steps, steps with "
                                              "prefill tokens eager; piecewise: also graphs for those "
                                              "steps (up to 1024 tokens) with attention run eagerly "
                                              "between them (Llama family, one GPU); full: one whole "
                                              "graph per token-count bucket for steps of any mix (up "
                                              "to 8192 tokens), attention by the unified varlen "
                                              "kernel (one GPU)", CUDAGRAPH_MODES)
    cuda_graph_sizes: list[int] | None = option(None, "decode batch sizes to capture CUDA graphs "
                                                      "for (default, as vLLM's: 1, 2, 4, every 8 up "
                                                      "to 256, every 16 above, up to max_num_seqs); "
                                                      "a batch pads to the next size, one above the "
                                                      "largest runs eagerly")
    nano_batch_rows: int = option(0, "N >= 2: decode-only steps of >= N rows run as two nano-batches, one's "
                                     "attention beside the other's matmuls (Llama family, one GPU; untimed; "
                                     "not vLLM's); 0: off")
    nano_batch_sm_carveout: int = option(0, "with nano_batch_rows: SMs the matmuls leave to the attention")
    load_format: str = option("auto", "dummy: random weights of the config's shapes (benchmarks, "
                                      "no *.safetensors needed)", LOAD_FORMATS)
    skip_tokenizer_init: bool = option(False, "load no tokenizer: prompts must be token ids and "
                                              "outputs carry no text")
    tensor_parallel_size: int = option(1, "GPUs (ranks) one model is split over")
    enable_expert_parallel: bool = option(False, "mixture-of-experts layers: whole experts per rank "
                                                 "(num_experts / tensor_parallel_size each) instead of "
                                                 "every expert's intermediate dimension split")
    kv_allocator: str = option("paged", "paged KV cache, or a contiguous baseline of the paper",
                               KV_ALLOCATORS)
    # CPU default pool when no override is given: bounded so a laptop is not exhausted.
    cpu_kv_cache_gib: float = option(1.0, "GiB of KV cache on CPU when --num-gpu-blocks-override "
                                          "is not given")
    quantization: str | None = option(None, "fp8: quantize the linear layers' and MoE experts' weights to "
                                            "FP8 at load time (per-output-channel scales, dynamic per-token activation "
                                            "scales); FP8 checkpoints are read from config.json's "
                                            "quantization_config without it", QUANTIZATION_METHODS)
    kv_cache_dtype: str = option("auto", "auto: the model dtype; fp8 (fp8_e4m3): an e4m3 KV cache "
                                         "with per-layer K and V scales, twice the blocks for the "
                                         "same memory", KV_CACHE_DTYPES)
    calculate_kv_scales: bool = option(False, "with kv_cache_dtype fp8: set each layer's K/V scales "
                                              "from a start-up forward of random prompts (amax x 2 "
                                              "/ 448) instead of 1.0 or the checkpoint's")
    kv_cache_scale_strategy: str = option("tensor", "with calculate_kv_scales: one K and one V scale per layer "
                                                    "(tensor, vLLM's) or per KV head (attn_head, each head's "
                                                    "amax; compressed-tensors' name). A checkpoint's scales "
                                                    "load with the shape it gives them either way",
                                          KV_CACHE_SCALE_STRATEGIES)
    async_scheduling: bool = option(True, "overlap steps: schedule and prepare step N+1 while step N "
                                          "runs on the device (off: every step synchronous, for A/B)")
    # The OpenAI server's (vLLM's names); LLM(...) keeps them for `pagedserve serve` replicas.
    enable_auto_tool_choice: bool = option(False, "serve tool_choice=auto: the model may call "
                                                  "tools, read from its text by --tool-call-parser")
    tool_call_parser: str | None = option(None, "how the model writes tool calls: hermes "
                                                "(<tool_call> JSON, Qwen2.5/Qwen3/Hermes), "
                                                "llama3_json (Llama 3.x), mistral ([TOOL_CALLS])",
                                          TOOL_CALL_PARSERS)
    chat_template: str | None = option(None, "a Jinja chat template in place of the tokenizer's (chat "
                                             "completions, LLM.chat): a file's path, or the template itself")
    chat_template_content_format: str = option("auto", "how a message's content reaches the chat template "
                                                       "(vLLM's): string: its text parts joined by newlines; "
                                                       "openai: a list of {type: text, text} parts; auto: "
                                                       "openai where the template loops over a message's "
                                                       "content, else string", CHAT_TEMPLATE_CONTENT_FORMATS)
    generation_config: str = option("auto", "default sampling for requests that leave it unset (temperature, "
                                            "top_p, top_k, min_p, repetition_penalty, max_tokens): auto: the "
                                            "model's generation_config.json, as vLLM; vllm: pagedserve's own; or "
                                            "a folder holding a generation_config.json")
    override_generation_config: dict | None = option(None, "JSON of generation-config values that replace "
                                                           "the file's, e.g. '{\"temperature\": 0.5}'")
    reasoning_parser: str | None = option(None, "split the model's <think>...</think> text into "
                                                "the chat message's reasoning_content",
                                          REASONING_PARSERS)
    structured_outputs_backend: str = option("auto", "grammar library for structured outputs (json schema, "
                                                     "regex, choice, grammar); auto: xgrammar",
                                             STRUCTURED_OUTPUTS_BACKENDS)
    structured_outputs_compile_timeout_s: float = option(30.0, "seconds a request may wait for its "
                                                               "grammar to compile before it fails "
                                                               "(alone, with an error)")
    structured_outputs_max_whitespace: int = option(
        STRUCTURED_OUTPUTS_MAX_WHITESPACE, "most whitespace characters a JSON grammar allows between two "
        "tokens of the JSON; a model stuck emitting newlines must then go on (20 fits a newline and deep "
        "indentation; each fill costs more, ~4x TPOT at 10 req/s on the H200); 0: unbounded, as vLLM")
    structured_outputs_fill_threads: int | None = option(None, "xgrammar threads that fill a step's "
                                                               "grammar bitmask rows (default: half the "
                                                               "CPUs, at most 8)")
    speculative_config: dict | None = option(None, "speculative decoding, vLLM's JSON: "
                                                   "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' "
                                                   "(prompt_lookup_min/max) or method draft_model with "
                                                   "model; see docs/speculative-decoding.md")
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._check_types()
        if not -2**63 <= self.seed < 2**64:  # torch's manual_seed range; past it "Overflow when unpacking long long"
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")
        if self.speculative_config is not None:
            from pagedserve.spec_decode.config import SpeculativeConfig  # no torch: config stays light
            self.speculative_config = SpeculativeConfig.from_json(self.speculative_config).to_dict()
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}")
        # Finite: NaN passed "< 0" and failed later as "cannot convert float NaN to integer".
        for name in ("swap_space", "cpu_kv_cache_gib"):
            if not 0 <= getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0 GiB, got {getattr(self, name)}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0 (0: off), got {self.long_prefill_token_threshold}")
        if self.long_prefill_chunk_align is not None and self.long_prefill_chunk_align < 0:
            raise ValueError(f"long_prefill_chunk_align must be >= 0 (0: off), got {self.long_prefill_chunk_align}")
        if self.long_prefill_drain < 0:
            raise ValueError(f"long_prefill_drain must be >= 0 (0: off), got {self.long_prefill_drain}")
        if not self.long_prefill_cost_scale > 0:
            raise ValueError(f"long_prefill_cost_scale must be > 0, got {self.long_prefill_cost_scale} "
                             "(long_prefill_budget_by_cost=False turns the costs off)")
        if self.long_prefill_budget_by_cost and not self.enable_chunked_prefill:
            raise ValueError("long_prefill_budget_by_cost needs enable_chunked_prefill (it sizes prefill chunks)")
        # Without chunked prefill a prompt is never cut, so these would be ignored without a word.
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ValueError(f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) needs "
                             "enable_chunked_prefill (it caps prefill chunks; 0: off)")
        if self.long_prefill_chunk_align and not self.enable_chunked_prefill:
            raise ValueError(f"long_prefill_chunk_align ({self.long_prefill_chunk_align}) needs "
                             "enable_chunked_prefill (it aligns prefill chunks; 0: off)")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization method {self.quantization!r} is not supported (supported: "
                             f"{', '.join(QUANTIZATION_METHODS)})")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            raise ValueError("calculate_kv_scales needs kv_cache_dtype fp8")
        if self.kv_cache_scale_strategy not in KV_CACHE_SCALE_STRATEGIES:
            raise ValueError(f"kv_cache_scale_strategy must be one of {KV_CACHE_SCALE_STRATEGIES}, "
                             f"got {self.kv_cache_scale_strategy!r}")
        if self.kv_cache_scale_strategy != "tensor" and not self.calculate_kv_scales:
            raise ValueError(f"kv_cache_scale_strategy {self.kv_cache_scale_strategy!r} needs calculate_kv_scales "
                             "(it says how they are calculated; a checkpoint's per-head scales load without it)")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be auto, safetensors or dummy, got {self.load_format!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.max_model_len is not None and self.max_model_len < 1 and self.max_model_len != MAX_MODEL_LEN_AUTO:
            raise ValueError(f"max_model_len must be >= 1, or -1 (auto: what the KV cache holds), got {self.max_model_len}")
        if self.hf_overrides is not None:
            if not isinstance(self.hf_overrides, dict) or not all(isinstance(k, str) for k in self.hf_overrides):
                raise ValueError(f"hf_overrides must be a JSON object of config fields, got {self.hf_overrides!r}")
            for key in ("rope_scaling", "rope_parameters"):
                if key in self.hf_overrides and not isinstance(self.hf_overrides[key], dict):
                    raise ValueError(f"hf_overrides: {key} must be an object, got {self.hf_overrides[key]!r}")
        # Validate the pieces early so a bad argument fails before any model is loaded.
        CacheConfig(block_size=self.block_size, kv_allocator=self.kv_allocator)
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= 0, or -1 (the whole vocabulary), got {self.max_logprobs}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (one of "
                             f"{', '.join(TOOL_CALL_PARSERS)})")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got "
                             f"{self.tool_call_parser!r}")
        if self.chat_template_content_format not in CHAT_TEMPLATE_CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format must be one of {CHAT_TEMPLATE_CONTENT_FORMATS}, "
                             f"got {self.chat_template_content_format!r}")
        if self.chat_template is not None:  # a missing file fails here, before any model loads
            from pagedserve.engine.chat_template import resolve_chat_template
            resolve_chat_template(self.chat_template)
        if self.override_generation_config is not None and not isinstance(self.override_generation_config, dict):
            raise ValueError(f"override_generation_config must be a JSON object, got {self.override_generation_config!r}")
        from pagedserve.engine.generation_defaults import generation_defaults
        generation_defaults(self.model, self.generation_config, self.override_generation_config)  # fails here
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}, got "
                             f"{self.reasoning_parser!r}")
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(f"cudagraph_mode must be one of {CUDAGRAPH_MODES}, got {self.cudagraph_mode!r}")
        if self.structured_outputs_backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(f"structured_outputs_backend must be one of {STRUCTURED_OUTPUTS_BACKENDS}, "
                             f"got {self.structured_outputs_backend!r}")
        if self.structured_outputs_fill_threads is not None and self.structured_outputs_fill_threads < 1:
            raise ValueError(f"structured_outputs_fill_threads must be >= 1, "
                             f"got {self.structured_outputs_fill_threads}")
        if self.structured_outputs_max_whitespace < 0:
            raise ValueError(f"structured_outputs_max_whitespace must be >= 0 (0: unbounded), "
                             f"got {self.structured_outputs_max_whitespace}")
        if not self.structured_outputs_compile_timeout_s > 0:
            raise ValueError(f"structured_outputs_compile_timeout_s must be > 0, "
                             f"got {self.structured_outputs_compile_timeout_s}")
        if self.nano_batch_rows == 1 or self.nano_batch_rows < 0:
            raise ValueError(f"nano_batch_rows must be 0 (off) or >= 2, got {self.nano_batch_rows}")
        if self.nano_batch_sm_carveout < 0 or (self.nano_batch_sm_carveout and not self.nano_batch_rows):
            raise ValueError(f"nano_batch_sm_carveout must be >= 0 and needs nano_batch_rows, got "
                             f"{self.nano_batch_sm_carveout} with nano_batch_rows={self.nano_batch_rows}")
        if self.cuda_graph_sizes is not None:
            if not self.cuda_graph_sizes or any(not isinstance(b, int) or b < 1 for b in self.cuda_graph_sizes):
                raise ValueError(f"cuda_graph_sizes must be a non-empty list of batch sizes >= 1, "
                                 f"got {self.cuda_graph_sizes!r}")

    def _check_types(self) -> None:
        """TypeError naming the argument whose value is not of its field's type (the plain int,
        float, bool and str fields): a string failed as "'<' not supported between 'str' and 'int'",
        seed=None or 1.5 as torch's "manual_seed expected a long", max_model_len=1.5 and
        max_num_seqs=1.5 were taken, and "no" for a bool field was True."""
        for f in dataclasses.fields(self):
            base, _, none = f.type.partition(" | ")
            v = getattr(self, f.name)
            if base not in _TYPE_CHECKS or (v is None and none == "None"):
                continue
            if base == "str" and isinstance(v, os.PathLike):  # a pathlib.Path model directory, say
                v = os.fspath(v)
                setattr(self, f.name, v)
            ok, what = _TYPE_CHECKS[base]
            if not ok(v):
                raise TypeError(f"{f.name} must be {what}{' or None' if none else ''}, got {v!r}")
            if base == "int" and type(v) is not int:
                setattr(self, f.name, int(v))  # numpy's integers

    def with_batch_defaults(self, device_memory_bytes: int = 0, device_name: str = "",
                            serving: bool = False) -> "EngineConfig":
        """This config with max_num_seqs and max_num_batched_tokens filled in where unset, from the
        device (batch_defaults); a copy, so every tensor-parallel rank gets the same numbers."""
        seqs, tokens = batch_defaults(device_memory_bytes, device_name, serving)
        if not self.enable_chunked_prefill:
            tokens = None  # scheduler_config: at least max_model_len, which only the engine knows
        return dataclasses.replace(self, max_num_seqs=self.max_num_seqs or seqs,
                                   max_num_batched_tokens=self.max_num_batched_tokens or tokens)

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = SMALL_DEVICE_BATCHED_TOKENS
            if not self.enable_chunked_prefill:
                budget = max(budget, max_model_len)
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs or SMALL_DEVICE_MAX_NUM_SEQS,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            preemption_mode=self.preemption_mode,
            scheduling_policy=self.scheduling_policy,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            long_prefill_chunk_align=self.long_prefill_chunk_align or 0,  # None: the engine's pick
            long_prefill_drain=self.long_prefill_drain,
            long_prefill_drain_min_tokens=COST_MIN_TOKENS,
        )
