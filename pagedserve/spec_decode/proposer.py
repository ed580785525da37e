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

Host-side proposers (``proposes_on_host = True``: n-gram, the benchmarks' stand-ins) propose on
the host, cheaply and without the device, from the history alone. The engine may then ask
``has_proposals(requests)`` before it gives up an overlapped step (engine/step_pipeline.py step):
whether propose(requests) would give any request at least one token. It is asked over the host's
histories while a step is in flight (one token stale: the in-flight token is not in them) and
must leave every later propose() as it would have been: a history it saw may be followed by a
longer one of the same sequence (the stale one's continuation), and it must consume nothing a
proposal draws (a wrapper's random generator). A proposer without the attribute (a draft model:
its proposals need the device) is never asked; every speculating step it is in is synchronous.
A host-side proposer may also offer ``peek_proposals(requests)``: the token ids propose(requests)
would give, under the same rules (it leaves later proposals as they would have been; a random
proposer draws from a generator of its own). The engine takes the adaptive policy's probes with
it, scored against the tokens decoding goes on to emit, in overlapped steps
(spec_decode/shadow.py); without it a probe is a verified, synchronous step.

Construction: spec_decode/factory.py builds the proposer the config names; a draft-model
proposer is `pagedserve.spec_decode.draft_model.DraftModelProposer(spec, engine)` with spec the
SpeculativeConfig and engine the LLMEngine it serves. The engine builds it (factory.load_draft_model)
before sizing its KV pool: engine.config, engine.device, engine.dtype, engine.hf_config and
engine.max_model_len are there; the pool sizes are not (the engine calls allocate_kv later).
"""
from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch


class TokenHistory(SequenceABC):
    """prompt + output as one read-only Sequence[int] without concatenating them (what
    ProposalRequest.token_ids holds in the engine): O(1) to make each step, slices copy only
    what they cover, so a proposer that keeps its own copy can append just the new tail."""
    __slots__ = ("prompt", "output")

    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self.prompt, self.output = prompt, output

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    def __getitem__(self, i):
        p = len(self.prompt)
        if isinstance(i, slice):
            lo, hi, step = i.indices(len(self))
            if step != 1:
                return (self.prompt + self.output)[i]
            if hi <= p:
                return self.prompt[lo:hi]
            if lo >= p:
                return self.output[lo - p:hi - p]
            return self.prompt[lo:] + self.output[:hi - p]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.prompt[i] if i < p else self.output[i - p]


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


class HostProposer(Proposer, Protocol):
    """A proposer that proposes on the host from the history alone (see the module docstring)."""
    proposes_on_host: bool  # True

    def has_proposals(self, requests: list[ProposalRequest]) -> bool: ...
    # Optional: def peek_proposals(self, requests: list[ProposalRequest]) -> list[list[int]]


def proposes_on_host(proposer: object) -> bool:
    """Whether the engine may ask proposer.has_proposals (a HostProposer)."""
    return bool(getattr(proposer, "proposes_on_host", False))
