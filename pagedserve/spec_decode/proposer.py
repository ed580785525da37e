"""The proposer interface: what speculative decoding asks of a proposer.

A proposer sits beside the runner. Each step the engine hands it, for every
running decode that speculates, the verified token history and how many
tokens it wants proposed; it returns up to that many token ids per request
(fewer, even zero, is always allowed: the request then verifies fewer slots).

Invariants:
- ``token_ids`` holds only verified tokens (prompt + accepted output), in order.
- ``Proposals.token_ids[i]`` belongs to ``requests[i]`` and has at most
  ``requests[i].num_speculative_tokens`` ids.
- ``draft_probs`` rows follow the proposed ids in request order (request 0's
  ids first); ``None`` means the proposer is deterministic (a one-hot q), as
  the n-gram proposer is.
- ``finish(seq_id)`` drops any per-sequence state (KV, caches); it is called
  when a sequence finishes, is aborted or preempted, and may be called for a
  sequence the proposer never saw.

Construction: spec_decode/factory.py builds the proposer the config names; a draft-model
proposer is `pagedserve.spec_decode.draft_model.DraftModelProposer(spec, engine)` with spec the
SpeculativeConfig and engine the LLMEngine it serves (engine.config, engine.device,
engine.dtype, engine.hf_config, engine.vocab_size are there when it is built).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch


@dataclass
class ProposalRequest:
    seq_id: int
    token_ids: Sequence[int]      # prompt + verified output tokens, in order (no unverified ones)
    num_speculative_tokens: int   # k wanted this step (>= 1)
    temperature: float            # 0 = greedy
    generator: torch.Generator | None  # the sequence's own generator when it has a seed


@dataclass
class Proposals:
    token_ids: list[list[int]]         # per request, 0..k proposed ids
    draft_probs: torch.Tensor | None   # [sum(len(ids)), vocab] probabilities the draft drew each
                                       # proposed token from; None = deterministic (one-hot) proposer


class Proposer(Protocol):
    def propose(self, requests: list[ProposalRequest]) -> Proposals: ...
    def finish(self, seq_id: int) -> None: ...   # drop per-sequence state (finished/aborted/preempted)
