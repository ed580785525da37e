"""Speculative decoding: proposers (n-gram, draft model), the rejection
sampler, the adaptive policy and the speculative config. The scheduler only
knows lookahead slots; everything that proposes or verifies lives here or in
the runner's sampler layer."""
