"""Shared by the speculative-decoding engine tests: the config and the prompts."""

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
# Copy-heavy prompts (the proposer finds matches) beside ordinary ones.
TEXTS = [
    "one two three four five six seven one two three four five six seven one two three",
    "The quick brown fox",
    "abc abc abc abc abc abc abc abc",
    "Paged attention stores the KV cache in fixed-size blocks, like pages of virtual memory. "
    "Paged attention stores the KV cache in fixed-size",
    "Hi",
]
