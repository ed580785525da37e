"""References for the detokenizer flags (tests/engine, tests/server)."""
from __future__ import annotations

import json
from pathlib import Path


def vllm_fast_text(tok, prompt, out, skip_special_tokens, spaces_between_special_tokens):
    """vLLM's FastIncrementalDetokenizer transcribed: DecodeStream primed with the prompt, one
    step per output token; with neither flag, an added token after an added one is its content."""
    from tokenizers.decoders import DecodeStream
    backend = tok.backend_tokenizer
    stream = DecodeStream(ids=prompt, skip_special_tokens=skip_special_tokens)
    spaces = skip_special_tokens or spaces_between_special_tokens
    added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
    text, last_special = "", False
    for t in out:
        piece = stream.step(backend, t)
        if not spaces:
            content = added.get(t)
            if content is not None and last_special:
                piece = content
            last_special = content is not None
        text += piece or ""
    return text


def wordpiece_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "hello": 3, "world": 4, "##s": 5, "<s>": 6, "</s>": 7}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", cls_token="[CLS]",
                                  sep_token="[SEP]", bos_token="<s>", eos_token="</s>")
    tok.add_tokens(["<tool>"])  # an added token that is not special: vLLM joins it too
    return tok


def wordpiece_model(src: Path, d: Path) -> Path:
    """The tiny model's weights at `src` with wordpiece_tokenizer() in `d`."""
    tok = wordpiece_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return model_with_tokenizer(src, d, tok)


CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # for chat requests


def model_with_tokenizer(src: Path, d: Path, tok) -> Path:
    """The tiny model's weights at `src` with the small tokenizer `tok` (its ids within the
    model's vocab), in `d`."""
    for f in src.iterdir():
        if f.suffix == ".safetensors" or f.name in ("config.json", "generation_config.json"):
            (d / f.name).symlink_to(f)
    tok.save_pretrained(d)
    assert json.loads((d / "config.json").read_text())["vocab_size"] > len(tok)
    return d


def metaspace_tokenizer():
    """SentencePiece-style pieces: decode([id]) drops the leading "▁" of "▁true", which vLLM's
    decoded_token puts back as a space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "▁true": 1, "true": 2, "▁▁x": 3, "x": 4, "</s>": 5}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")
    tok.chat_template = CHAT_TEMPLATE
    return tok
