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

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "opt")


def train_tokenizer(path: str | os.PathLike, vocab_size: int = 320):
    """A byte-level BPE trained offline on CORPUS, saved as an HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def tiny_config(arch: str, vocab_size: int, **overrides):
    from transformers import (LlamaConfig, MistralConfig, OPTConfig, Qwen2Config, Qwen3Config)

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
    elif arch == "opt":
        cfg = OPTConfig(vocab_size=vocab_size, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=512, word_embed_proj_dim=64,
                        bos_token_id=0, eos_token_id=1, pad_token_id=2, do_layer_norm_before=True)
    else:
        raise ValueError(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


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
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kw)
    return path
