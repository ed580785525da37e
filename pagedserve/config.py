"""Engine configuration: dataclasses validated once, at construction.

EngineConfig holds every `LLM(...)` argument; the core only ever sees the two
small torch-free pieces it needs, CacheConfig and SchedulerConfig (core/config.py).
Its checks are config_checks.py; the values its options may take, config_choices.py (each
re-exported here, where callers import them).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pagedserve.config_checks import check_engine_config
from pagedserve.config_choices import (CHAT_TEMPLATE_CONTENT_FORMATS, CUDAGRAPH_MODES, DEVICES, DTYPES, KV_CACHE_DTYPES,
                                       KV_CACHE_SCALE_STRATEGIES, LOAD_FORMATS, QUANTIZATION_METHODS, REASONING_PARSERS,
                                       STRUCTURED_OUTPUTS_BACKENDS, TOOL_CALL_PARSERS)
from pagedserve.config_choices import MAX_MODEL_LEN_AUTO  # noqa: F401 (re-exported: the engine and the CLI's)
from pagedserve.core.chunk_cost import COST_MIN_TOKENS, COST_SCALE as LONG_PREFILL_COST_SCALE
from pagedserve.core.config import KV_ALLOCATORS, PREEMPTION_MODES, SCHEDULING_POLICIES, SchedulerConfig
from pagedserve.core.config import CacheConfig  # noqa: F401 (re-exported, as before the checks moved)

# Whitespace characters a JSON grammar allows in one gap (engine/structured/compiler.parse_spec);
# 0: unbounded, as vLLM. Not bounded by default: on the H200 at 3333762 a bound of 20 took the
# constrained TPOT p50 at 10 req/s from 6.0 to 22.3 ms (the bounded grammar's mask fills cost more
# and the host step outran the device's; structured_runs/whitespace_bound_3333762.tar.gz).
STRUCTURED_OUTPUTS_MAX_WHITESPACE = 0


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
    long_prefill_budget_by_cost: bool = option(
        False, "in steps with decodes, count a prefill token's attention over the context before it against "
        "max_num_batched_tokens (a token after P earlier ones counts 1 + P/K, K from the model's shape: ~27k "
        "tokens for Llama-3.1-8B; prompts of 8,192+ tokens), so chunks deep in a long prompt are shorter and "
        "the decodes beside it wait less per step (0.45-0.67x the gaps beside a 100k prefill), at the price of "
        "more steps: its first token ~3% later beside long-context decodes (off by default; not vLLM's)")
    long_prefill_cost_scale: float = option(
        LONG_PREFILL_COST_SCALE, "with long_prefill_budget_by_cost: K (the context at which a token's "
        "attention costs as much as its matmuls) times this, so a step beside decodes may cost more (> 1: "
        "fewer, longer steps; a faster prefill, longer gaps for the decodes) or less")
    long_prefill_chunk_align: int | None = option(
        None, "a prefill chunk cut short by the token budget ends on a multiple of this many tokens where "
        "that leaves it half its tokens or 1,024 (the rest follows in the next step, beside the decodes), "
        "so a long prompt's chunks stay on the Hopper long-prefill path's whole query steps (default: 1,024 "
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
        check_engine_config(self)  # config_checks.py: every argument's check, and the values it settles

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
