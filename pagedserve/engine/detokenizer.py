"""Incremental detokenization: the text each new token adds, in O(window) work per token.

Decoding a token on its own is wrong twice over: byte-level tokens may end in the middle of
a UTF-8 character, and tokenizers merge or strip spaces depending on the neighbours. So each
step decodes a short window twice — [prefix, read) (text already emitted) and [prefix, end)
— and emits the difference. The window starts a few tokens back so the decoder sees context.
Text that ends in U+FFFD (an incomplete character) is held back until the next tokens
complete it; `flush` emits whatever is left when the sequence finishes.

spaces_between_special_tokens=False follows vLLM's detokenizers (detokenize_incrementally).

State is an immutable (prefix_offset, read_offset) pair of indices into the sequence's full
token list (prompt + output), so a forked child may share it with its parent.
"""
from __future__ import annotations

from typing import Any

_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"

DetokState = tuple[int, int]


def _decode(tokenizer: Any, ids: list[int], skip_special_tokens: bool,
            spaces_between_special_tokens: bool = True) -> str:
    # A fast tokenizer's Rust backend is what its decode() calls anyway (without clean-up);
    # calling it directly skips the Python wrapper, which dominates at one call per token.
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.decode(ids, skip_special_tokens=skip_special_tokens)
    # A slow tokenizer joins added tokens with spaces unless told not to, as vLLM's slow path.
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                            spaces_between_special_tokens=spaces_between_special_tokens,
                            clean_up_tokenization_spaces=False)


def added_token_contents(tokenizer: Any) -> dict[int, str] | None:
    """A fast tokenizer's added tokens (special or not), id -> content; None for a slow one or
    none. What vLLM's fast detokenizer joins under spaces_between_special_tokens=False."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None  # a slow tokenizer: _decode passes the flag to its decode()
    return {i: t.content for i, t in backend.get_added_tokens_decoder().items()} or None


def initial_state(num_prompt_tokens: int) -> DetokState:
    return (max(num_prompt_tokens - _CONTEXT_TOKENS, 0), num_prompt_tokens)


def _window(prompt_ids: list[int], output_ids: list[int], start: int, end: int) -> list[int]:
    """(prompt_ids + output_ids)[start:end] without building the whole concatenation."""
    p = len(prompt_ids)
    if start >= p:
        return output_ids[start - p:end - p]
    return prompt_ids[start:min(end, p)] + output_ids[:max(end - p, 0)]


def detokenize_incrementally(tokenizer: Any, prompt_ids: list[int], output_ids: list[int],
                             state: DetokState, skip_special_tokens: bool = True,
                             final: bool = False, spaces_between_special_tokens: bool = True,
                             added: dict[int, str] | None = None) -> tuple[str, DetokState]:
    """The new text of the tokens from read_offset on, and the next state.

    With final=True an incomplete trailing character is emitted anyway (as U+FFFD).
    spaces_between_special_tokens=False (with skip_special_tokens=False), as vLLM honours it: a
    slow tokenizer's decode() is told; with a fast one (added: added_token_contents), an added
    token right after an added output token adds its bare content, whatever spaces the decoder
    puts before it (vLLM's FastIncrementalDetokenizer), so the new tokens are taken one by one.
    """
    if added and not skip_special_tokens and not spaces_between_special_tokens:
        return _joined_incrementally(tokenizer, prompt_ids, output_ids, state, final, added)
    prefix, read = state
    end = len(prompt_ids) + len(output_ids)
    if read >= end:
        return "", state
    prefix_text = _decode(tokenizer, _window(prompt_ids, output_ids, prefix, read), skip_special_tokens,
                          spaces_between_special_tokens)
    full_text = _decode(tokenizer, _window(prompt_ids, output_ids, prefix, end), skip_special_tokens,
                        spaces_between_special_tokens)
    if len(full_text) <= len(prefix_text):
        # Nothing visible yet (a skipped special token, or bytes of a character in progress).
        return "", state
    if full_text.endswith(_REPLACEMENT) and not final:
        return "", state
    return full_text[len(prefix_text):], (read, end)


def _joined_incrementally(tokenizer: Any, prompt_ids: list[int], output_ids: list[int],
                          state: DetokState, final: bool, joined: dict[int, str]) -> tuple[str, DetokState]:
    """detokenize_incrementally one new token at a time: an added token right after an added
    output token (vLLM tracks output tokens only) adds its bare content; any other token adds
    what the window decode gives."""
    p = len(prompt_ids)
    text = ""
    for i in range(max(state[1], p), p + len(output_ids)):
        tid = output_ids[i - p]
        if i > p and tid in joined and output_ids[i - p - 1] in joined:
            # Text held back before it (never in practice: an added token decodes whole).
            head, state = detokenize_incrementally(tokenizer, prompt_ids, output_ids[:i - p], state,
                                                   False, final=True)
            text += head + joined[tid]
            state = (i, i + 1)
        else:
            new, state = detokenize_incrementally(tokenizer, prompt_ids, output_ids[:i - p + 1], state,
                                                  False, final=final and i == p + len(output_ids) - 1)
            text += new
    return text, state


def find_stop_string(text: str, stops: list[str], search_from: int) -> tuple[int, str] | None:
    """Earliest stop string that ends at or after `search_from` (text before it was checked)."""
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, max(0, search_from - len(s) + 1))
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best
