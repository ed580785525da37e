"""Tiny random-weight HF models and an offline-trained BPE tokenizer, for tests.

Everything is made with transformers' own save_pretrained, so the loading code
under test reads exactly what a user's HF directory holds.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores the KV cache in fixed-size blocks, like pages of virtual memory.",
    "Héllo wörld! Ünïcödé text, 日本語のテキスト, emoji 🚀🔥 and ΕΛΛΗΝΙΚΑ letters.",
    "def main():\n    print('hello, world')\n    return 0\n",
    "Continuous batching lets requests join and leave the batch at every step.",
    "A block table maps logical blocks to physical blocks; copy-on-write shares them.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828",
    "Привет, мир! Как дела? Всё хорошо.",
] * 20

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral")
# Families whose norm weights are not Llama's plain multiply (Gemma's 1 + w, OLMo 2's whole-width
# q/k norms): their tiny models get norm weights off their initial values, so loading them is checked.
NORM_WEIGHTED = ("gemma2", "gemma3", "olmo2")
ARCHS = ("llama", "mistral", "ministral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "granite", "olmo2", "smollm3",
         "opt") + MOE_ARCHS


def train_tokenizer(path: str | os.PathLike, vocab_size: int = 320, corpus: list[str] | None = None):
    """A byte-level BPE trained offline on `corpus` (default CORPUS), saved as an HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS if corpus is None else corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def tiny_config(arch: str, vocab_size: int, **overrides):
    from transformers import (Gemma2Config, Gemma3TextConfig, GraniteConfig, LlamaConfig, MinistralConfig,
                              Olmo2Config, SmolLM3Config, MistralConfig, MixtralConfig, OPTConfig, Phi3Config,
                              Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig)

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False)
    if arch == "llama":
        cfg = LlamaConfig(**common, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 64})
    elif arch == "mistral":
        cfg = MistralConfig(**common, sliding_window=None)
    elif arch == "qwen2":
        cfg = Qwen2Config(**{**common, "tie_word_embeddings": True})
    elif arch == "qwen3":
        cfg = Qwen3Config(**common, head_dim=32)
    elif arch == "phi3":  # Phi-4-mini's shape of RoPE: LongRoPE on 3/4 of each head
        cfg = Phi3Config(**common, partial_rotary_factor=0.75, rope_parameters=longrope_parameters(12, 512),
                         original_max_position_embeddings=512)
    elif arch == "gemma2":  # soft caps small enough to bind at these scores (the real ones: 50 and 30)
        cfg = Gemma2Config(**{**common, "tie_word_embeddings": True}, head_dim=32, query_pre_attn_scalar=24,
                           sliding_window=16, attn_logit_softcapping=2.0, final_logit_softcapping=5.0)
    elif arch == "gemma3":  # a sliding layer (local RoPE) then a global one (linear-scaled RoPE), as in 1b's 5:1
        cfg = Gemma3TextConfig(**{**common, "tie_word_embeddings": True}, head_dim=32, query_pre_attn_scalar=24,
                               sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                               rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                   "rope_theta": 1000000.0}},
                               final_logit_softcapping=30.0)
    elif arch == "granite":  # multipliers of Granite 3's kind (3.1-8b: 12, 0.0078125, 0.22, 16)
        cfg = GraniteConfig(**common, embedding_multiplier=6.0, attention_multiplier=0.09, residual_multiplier=0.3,
                            logits_scaling=4.0)
    elif arch == "olmo2":
        cfg = Olmo2Config(**common)
    elif arch == "ministral":  # Ministral-8B's kind: sliding layers beside full ones, by layer_types
        cfg = MinistralConfig(**common, head_dim=16, sliding_window=16,
                              layer_types=["sliding_attention", "full_attention"])
    elif arch == "smollm3":  # a NoPE layer (SmolLM3's every fourth) beside a RoPE one
        cfg = SmolLM3Config(**{**common, "tie_word_embeddings": True}, no_rope_layers=[1, 0])
    elif arch == "opt":
        cfg = OPTConfig(vocab_size=vocab_size, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=512, word_embed_proj_dim=64,
                        bos_token_id=0, eos_token_id=1, pad_token_id=2, do_layer_norm_before=True)
    # Mixtures of experts: few experts, several per token, every layer kind of the family.
    elif arch == "qwen3_moe":  # normalised top-k (Qwen3-30B-A3B: 128 experts, top-8)
        cfg = Qwen3MoeConfig(**common, head_dim=32, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                             norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    elif arch == "qwen2_moe":  # shared expert with a sigmoid gate; layer 0 dense; top-k not renormalised
        cfg = Qwen2MoeConfig(**common, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=48, norm_topk_prob=False, decoder_sparse_step=1,
                             mlp_only_layers=[0])
    elif arch == "mixtral":  # top-2 of 4, renormalised
        cfg = MixtralConfig(**{**common, "intermediate_size": 64}, num_local_experts=4, num_experts_per_tok=2,
                            sliding_window=None)
    else:
        raise ValueError(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def longrope_parameters(rotary_dim: int, original: int, seed: int = 0) -> dict:
    """LongRoPE parameters with factors of a Phi-3 checkpoint's kind (short near 1, long up to ~20),
    random but fixed per seed."""
    g = torch.Generator().manual_seed(seed)
    n = rotary_dim // 2
    short = (1 + 0.1 * torch.rand(n, generator=g)).tolist()
    long = (1 + 19 * torch.linspace(0, 1, n) ** 2 + 0.1 * torch.rand(n, generator=g)).tolist()
    return {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short, "long_factor": long,
            "original_max_position_embeddings": original}


def make_tiny_model(arch: str, path: str | os.PathLike, seed: int = 0, max_shard_size: str | None = None,
                    **overrides) -> Path:
    """Save a tiny random model of `arch` plus tokenizer to `path`; returns the path."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    train_tokenizer(path)
    torch.manual_seed(seed)
    # Padded past the tokenizer, as real checkpoints pad their vocab (and some AutoTokenizer
    # classes add a special token on load).
    cfg = tiny_config(arch, overrides.pop("vocab_size", 384), **overrides)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    # Random init is small; scale weights up so logits are peaked and greedy ties are rare.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
            elif arch in NORM_WEIGHTED and "norm" in name:  # their norms' weights are read their own way
                p.add_(torch.randn_like(p) * 0.1)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kw)
    return path
