"""The values an EngineConfig option may take: its fields offer them as the CLI's choices
(config.py) and its checks hold a value to them (config_checks.py). Their own module so that both
import them without a circle; pagedserve.config re-exports every one.
"""
from __future__ import annotations

STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar")
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
