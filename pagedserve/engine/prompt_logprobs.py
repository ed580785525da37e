"""SamplingParams(prompt_logprobs=k), vLLM's name: the logprob of every prompt token given the ones
before it, with the top k alternatives, as `RequestOutput.prompt_logprobs`.

The runner returns, beside a step's sampling logits, the logits of the flat rows that predict prompt
positions of requests that ask (runner/batch.prompt_logprob_spans names them); this module turns them
into one PositionLogprobs per position (the prompt token, its rank, the top k: plain numbers, made
into vLLM's Logprob dicts by the front end), filled chunk by chunk, so chunked prefill and a
recomputed prompt (preemption) give the same list. Invariants: such a request reads no cached prefix (each position
must be computed once, Sequence.reads_prefix_cache) and its steps never overlap (step_pipeline.overlaps),
so the host sees every chunk's rows in order. Position 0 stays None: nothing predicts it.
"""
from __future__ import annotations

import torch

from pagedserve.layers.sampler import token_ranks
from pagedserve.logprobs import PositionLogprobs
from pagedserve.runner.batch import prompt_logprob_spans
from pagedserve.sampling_params import RequestOutputKind
from pagedserve.sequence import SequenceGroup


def start(group: SequenceGroup) -> None:
    """Prepare a new request that asks for prompt logprobs."""
    if group.sampling_params.prompt_logprobs is None:
        return
    for seq in group.seqs:
        seq.reads_prefix_cache = False
    group.prompt_logprobs = [None] * len(group.prompt_token_ids)


def record(scheduled: list, num_decodes: int, logits: torch.Tensor) -> None:
    """Fold one step's prompt-row logits ([rows of every span, in order], any float dtype) in."""
    spans = prompt_logprob_spans(scheduled, num_decodes)
    raw = logits.float()
    logp = torch.log_softmax(raw, dim=-1)
    at = 0
    for i, _, count, first in spans:
        s = scheduled[i]
        group, k = s.group, s.group.sampling_params.prompt_logprobs
        rows = logp[at:at + count]
        ids = s.seq.prompt_token_ids[first:first + count]
        targets = torch.tensor(ids, device=rows.device)
        ranks = token_ranks(raw[at:at + count], targets).tolist()
        at += count
        chosen = rows.gather(1, targets[:, None])[:, 0].tolist()
        top_v, top_i = (rows.topk(k, dim=-1) if k else (rows[:, :0], rows[:, :0].long()))
        top_v, top_i = top_v.tolist(), top_i.tolist()
        for j in range(count):
            t, lp = ids[j], chosen[j]
            group.prompt_logprobs[first + j] = PositionLogprobs(
                [t] + top_i[j], [lp] + [lp if x == t else v for x, v in zip(top_i[j], top_v[j])], ranks[j])
    if at != logits.shape[0]:
        raise RuntimeError(f"prompt logprobs: the runner returned {logits.shape[0]} rows, the step's spans "
                           f"name {at}")


def for_output(group: SequenceGroup) -> list | None:
    """What RequestOutput.prompt_logprobs carries now (the engine's PositionLogprobs): the list once
    the whole prompt is computed (a DELTA request gets it in one output only), else None."""
    if group.prompt_logprobs is None or group.first_token_time is None:
        return None
    if group.sampling_params.output_kind is RequestOutputKind.DELTA:
        if group.sent_prompt_logprobs:
            return None
        group.sent_prompt_logprobs = True
    return group.prompt_logprobs
