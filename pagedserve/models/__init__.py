"""Model families on the paged KV cache (llama.py: Llama/Mistral/Qwen2/Qwen3, opt.py: OPT), the
architecture registry and the safetensors loader."""
