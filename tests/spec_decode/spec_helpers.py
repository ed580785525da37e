"""Shared by the speculative-decoding engine tests: the config and the prompts."""

# The mechanism's tests speculate in every step the batch allows: yield pausing off (a threshold of 0).
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "min_speculation_yield": 0}
# As shipped: speculation pauses while it yields under 1.25 tokens per row (spec_decode/policy.py).
NGRAM_PAUSING = {k: v for k, v in NGRAM.items() if k != "min_speculation_yield"}
# The pause path under test: a threshold of 1 + k pauses after any step not wholly accepted.
NGRAM_EAGER_PAUSE = {**NGRAM, "min_speculation_yield": 1 + NGRAM["num_speculative_tokens"]}
# Copy-heavy prompts (the proposer finds matches) beside ordinary ones.
TEXTS = [
    "one two three four five six seven one two three four five six seven one two three",
    "The quick brown fox",
    "abc abc abc abc abc abc abc abc",
    "Paged attention stores the KV cache in fixed-size blocks, like pages of virtual memory. "
    "Paged attention stores the KV cache in fixed-size",
    "Hi",
]


class VerifiedProbes:
    """A host-side proposer without peek_proposals: the policy's probes are verified, synchronous
    steps (the path a draft model takes), not shadow probes (spec_decode/shadow.py). Install it
    over a built engine's: engine.speculator.proposer = VerifiedProbes(engine.speculator.proposer)."""
    proposes_on_host = True

    def __init__(self, inner):
        self.inner = inner

    def propose(self, requests):
        return self.inner.propose(requests)

    def has_proposals(self, requests):
        return self.inner.has_proposals(requests)

    def finish(self, seq_id):
        self.inner.finish(seq_id)


def verified_probes(llm):
    """llm with its proposer behind VerifiedProbes; returns llm."""
    sp = llm.llm_engine.speculator
    sp.proposer = VerifiedProbes(sp.proposer)
    return llm
