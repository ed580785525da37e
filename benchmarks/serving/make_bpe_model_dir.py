#!/usr/bin/env python3
"""A serving-benchmark model dir whose tokenizer is a real byte-level BPE of about the model's size.

The word-level tokenizer of make_bench_model_dir.py ("t0".."tN-1") has no token for "{" or '"', so
no JSON grammar could ever be followed with it. Structured-output benchmarks need a vocabulary
shaped like a real one: this trains a byte-level BPE (the `tokenizers` library) on the Python
sources found on the machine (the standard library's, then the installed packages'), up to the
config's vocab_size less 256 special tokens, and writes it beside the real config.json (dummy
weights are loaded by the engines). bpe_info.json says how many tokens it learned and its hash.
The grammar's mask cost depends on the vocabulary's size and its tokens' bytes, which this keeps.

    python3 benchmarks/serving/make_bpe_model_dir.py benchmarks/models/llama-3.1-8b OUT_DIR [--max-mb 40]
"""
import argparse
import glob
import hashlib
import json
import os
import shutil
import sysconfig

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

N_SPECIAL = 256


def corpus(max_bytes: int):
    """The standard library's .py files, then the installed packages', each in sorted order, up to
    max_bytes (a stripped standard library alone taught only 59k tokens on the GPU machine)."""
    paths = sysconfig.get_paths()
    files = [f for root in (paths["stdlib"], paths["purelib"])
             for f in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True))]
    total = 0
    for path in files:
        try:
            text = open(path, encoding="utf-8").read()
        except (UnicodeDecodeError, OSError):
            continue
        total += len(text)
        yield text
        if total >= max_bytes:
            return


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--max-mb", type=float, default=60)
    args = ap.parse_args()
    os.makedirs(args.dst, exist_ok=True)
    cfg = json.load(open(os.path.join(args.src, "config.json")))
    n = cfg["vocab_size"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=n - N_SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(int(args.max_mb * 2**20)), trainer=trainer)
    learned = tok.get_vocab_size()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"] + [f"<|reserved_{i}|>" for i in range(N_SPECIAL - 2)]
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=specials[0], eos_token=specials[1])
    fast.save_pretrained(args.dst)
    # The config's special ids follow the tokenizer (the vocab_size, so the LM head, stays the model's).
    cfg["bos_token_id"], cfg["eos_token_id"] = learned, learned + 1
    json.dump(cfg, open(os.path.join(args.dst, "config.json"), "w"), indent=1)
    digest = hashlib.sha256(open(os.path.join(args.dst, "tokenizer.json"), "rb").read()).hexdigest()[:16]
    info = {"vocab_size": n, "tokenizer_tokens": learned + N_SPECIAL, "bpe_tokens": learned,
            "tokenizer_sha256_16": digest, "corpus_mb": args.max_mb}
    json.dump(info, open(os.path.join(args.dst, "bpe_info.json"), "w"), indent=1)
    print(json.dumps(info))


if __name__ == "__main__":
    main()
