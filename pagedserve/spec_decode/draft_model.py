"""DraftModelProposer: a smaller model with the target's tokenizer proposes the next k tokens.

It runs in the engine's process and on its device, beside the target, with its own weights (the
project's loader: safetensors, or dummy weights with the target's load_format and seed), its own
paged KV pools (a CacheEngine) and its own blocks (draft_kv.DraftKVManager over a core BlockPool).

One propose() round, for every request at once:
1. Catch-up forward (one batched, prefill-style forward): per sequence the verified tokens whose
   KV the draft does not hold yet, i.e. those after the longest still-valid prefix (what it saw
   before plus the proposals the target accepted; rejected ones are rolled back by lowering the
   count). Its last row's logits give proposal 1. Merging the catch-up with the first draft step
   saves a forward and yields the same tokens (the last verified token is the first decode input).
   Right after a prefill or a preemption by recompute the catch-up is the whole sequence, so a
   round's catch-up is capped at the target's max_num_batched_tokens tokens (plan_catch_up): the
   short ones first; a sequence that does not fit writes a piece of its KV and gets no proposal
   this round (it decodes unspeculated), and goes on next round. One forward per round, so a
   long prompt never stalls the running decodes behind a long draft prefill.
2. k - 1 batched decode forwards, each on the previous proposal, give proposals 2..k. Their
   metadata is uploaded once and advanced on the device (spec_decode/draft_steps.py); the drawn
   tokens stay there as the next inputs. A round reads the device once, at its end (to_host):
   every step is queued before the host waits for any, so the host's work per step hides behind
   the device's, and a step costs the host a graph replay and a few launches whatever the batch.
Each proposal is drawn from the draft's distribution at the request's temperature (argmax at 0;
otherwise softmax(logits / T) with exponential-race noise from the sequence's own generator when
it has one, else the proposer's), and its probability row is returned for the rejection sampler.
The proposer leaves KV for proposals 1..k-1 in its cache; the next round keeps what was accepted.

On CUDA (unless enforce_eager) the decode forwards replay CUDA graphs of the draft
(runner/cuda_graph.DecodeCUDAGraphs, one per batch bucket), and a short catch-up replays them as
one decode row per token (runner/decode_rows.py), as the target's steps do. The buckets go up to
twice max_num_seqs (within max_num_batched_tokens): a round after one whose proposals were all
accepted catches up on two tokens per request (the last proposal, which has no KV yet, and the
bonus token), so a full batch's catch-up still replays a graph. It does so while its decode rows
read at most twice what one decode step over the same sequences reads (or the runner's own limit,
when larger); a longer catch-up (a prompt, a recompute) runs eagerly.

How many draft blocks. Inside an engine, as many as the target's pool has (same block size, so
the same tokens): the engine loads the draft's weights before the target's pool is sized
(defer_kv), so the profile counts them, and spec_decode/kv_split.py splits the KV budget between
the two pools (allocate_kv). Built on its own (num_blocks=None): as many tokens as the target's
pool holds (target_num_blocks * block_size, when given; else max_num_seqs * max_model_len),
capped by memory: on CUDA at DRAFT_KV_FREE_FRACTION of the device memory free after the draft's
weights are loaded, on CPU at the engine's cpu_kv_cache_gib. The draft never needs more than the
target (verified tokens plus k - 1 proposals, against the target's k lookahead slots), except
with prefix caching: a block the target shares between sequences is one draft block per sequence.
A request whose blocks do not fit gets fewer proposals this round, or none (always allowed).

Activation memory: spec_decode/draft_checks.py (check_draft_not_wider).
"""
from __future__ import annotations

import logging
import os

import numpy as np
import torch

from pagedserve.config import EngineConfig
from pagedserve.layers.sampler import to_device
from pagedserve.models.loader import get_max_model_len, get_model, load_hf_config, resolve_dtype
from pagedserve.runner.batch import ModelInput, build_model_input
from pagedserve.runner.cache_engine import CacheEngine, cache_block_bytes
from pagedserve.runner.decode_rows import MAX_PREFILL_POSITIONS, as_decode_rows
from pagedserve.spec_decode.catch_up import CatchUpPlan, plan_catch_up
from pagedserve.spec_decode.config import SpeculativeConfig
from pagedserve.spec_decode.draft_checks import check_draft_not_wider, check_vocab_compatible
from pagedserve.spec_decode.draft_kv import DraftKVManager
from pagedserve.spec_decode.draft_steps import DraftDecodeSteps
from pagedserve.spec_decode.proposer import ProposalRequest, Proposals

logger = logging.getLogger(__name__)
GiB = 1 << 30
# Share of the device memory free after the draft's weights that its KV pools may take on CUDA
# (the rest: its activations and CUDA graphs).
DRAFT_KV_FREE_FRACTION = 0.8


def to_host(tokens: torch.Tensor) -> list:
    """A round's one device-to-host read: every draw of every step (tests count the calls)."""
    return tokens.tolist()


class DraftModelProposer:
    """The Proposer of spec_decode/proposer.py backed by a draft model (see the module docstring).

    draft: the draft's HF directory, or a transformers config (dummy weights only).
    target: the engine's config (device, dtype, block size, load format, seed, limits).
    target_hf_config: the target's transformers config (read from target.model when None).
    num_blocks / target_num_blocks: the draft pool's size, or the target pool's to match.
    defer_kv: load the weights only; allocate_kv(num_blocks) makes the pool later. The engine
    does so: the draft's weights are on the device before the target's KV pool is sized, and
    spec_decode/kv_split.py gives the draft its share of the KV budget.

    The factory's call, DraftModelProposer(spec, engine) (spec_decode/factory.py), passes a
    SpeculativeConfig and the LLMEngine instead: the draft is spec.model, and the engine gives
    its config, device, transformers config, max_model_len and KV pool size."""

    def __init__(self, draft, target, device: torch.device | str | None = None, *,
                 target_hf_config=None, num_blocks: int | None = None, target_num_blocks: int | None = None,
                 max_model_len: int | None = None, defer_kv: bool = False):
        if isinstance(draft, SpeculativeConfig):
            engine = target
            draft, target, device = draft.model, engine.config, engine.device
            target_hf_config = engine.hf_config
            max_model_len = max_model_len or getattr(engine, "max_model_len", None)
            cache_config = getattr(engine, "cache_config", None)
            if target_num_blocks is None and cache_config is not None and cache_config.num_gpu_blocks:
                target_num_blocks = cache_config.num_gpu_blocks
        if not isinstance(target, EngineConfig):
            raise ValueError(f"DraftModelProposer: target must be an EngineConfig, got {type(target).__name__}")
        device = target.device if device is None else device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if isinstance(draft, (str, os.PathLike)):
            self.draft_dir: str | None = os.fspath(draft)
            self.hf_config = load_hf_config(self.draft_dir)
        else:
            self.draft_dir, self.hf_config = None, draft
        if self.draft_dir is None and target.load_format != "dummy":
            raise ValueError("speculative_config.model: a draft given as a config needs load_format='dummy'")
        if target_hf_config is None:
            if target.model is None:
                raise ValueError("DraftModelProposer: pass target_hf_config when the engine config has no model")
            target_hf_config = load_hf_config(target.model, target.hf_overrides)
        check_vocab_compatible(self.hf_config, target_hf_config, self.draft_dir, target.tokenizer or target.model)
        check_draft_not_wider(self.hf_config, target_hf_config)
        self.vocab_size = self.hf_config.vocab_size
        self.block_size = target.block_size
        self.dtype = resolve_dtype(target.dtype, target_hf_config, self.device)
        target_len = max_model_len or target.max_model_len or get_max_model_len(target_hf_config)
        self.max_model_len = min(target_len, get_max_model_len(self.hf_config))
        sched = target.scheduler_config(target_len)
        # The target's step budget bounds each round's catch-up (plan_catch_up; the memory argument above).
        self.max_num_seqs, self.max_num_batched_tokens = sched.max_num_seqs, sched.max_num_batched_tokens
        try:
            self.model = get_model(self.hf_config, model_dir=self.draft_dir, device=self.device, dtype=self.dtype,
                                   load_format=target.load_format, seed=target.seed, max_model_len=self.max_model_len)
        except torch.cuda.OutOfMemoryError:
            raise ValueError("speculative_config.model: the draft model's weights do not fit in the device memory "
                             "left beside the target's weights; pick a smaller draft model") from None
        from pagedserve.attention.backend import Attention
        attn = [m for m in self.model.modules() if isinstance(m, Attention)]
        self._kv_shape = (len(attn), attn[0].num_kv_heads, attn[0].head_dim)
        self.block_bytes = cache_block_bytes(self._kv_shape[0], self.block_size, *self._kv_shape[1:], self.dtype)
        # Unseeded requests draw from this generator (seeded from the engine's seed: reproducible runs).
        self.generator = torch.Generator(device=self.device).manual_seed(target.seed)
        self._target = target
        self.kv: DraftKVManager | None = None
        self.graphs = None
        if not defer_kv:
            self.allocate_kv(num_blocks if num_blocks is not None
                             else self._default_num_blocks(target, target_num_blocks, self.block_bytes))

    # --- set-up -------------------------------------------------------------------------------------
    def allocate_kv(self, num_blocks: int) -> None:
        """The draft's KV pool of num_blocks blocks (and, on CUDA, its decode graphs over it). The
        engine calls it with spec_decode/kv_split.py's share once the target's pool is sized."""
        if self.kv is not None:
            raise RuntimeError("draft model: its KV cache is already allocated")
        num_layers, kv_heads, head_dim = self._kv_shape
        try:
            cache = CacheEngine(num_layers, kv_heads, head_dim, self.block_size, num_blocks, 0, self.dtype, self.device)
        except torch.cuda.OutOfMemoryError:  # num_gpu_blocks_override sized it: nothing checked it fits
            raise ValueError(f"speculative_config.model: the draft's KV cache of {num_blocks} blocks does not fit "
                             "in device memory; lower num_gpu_blocks_override") from None
        self.kv, self.cache = DraftKVManager(num_blocks, self.block_size), cache
        self.kv_caches = self.cache.kv_caches
        if self.device.type == "cuda" and not self._target.enforce_eager:
            self._capture_graphs(self._target, kv_heads)
        logger.info("draft model %s: %d KV blocks of %d tokens (%.2f GiB)", self.draft_dir or "(config)",
                    num_blocks, self.block_size, num_blocks * self.block_bytes / GiB)

    def _default_num_blocks(self, target: EngineConfig, target_num_blocks: int | None, block_bytes: int) -> int:
        if target_num_blocks is not None:
            tokens = target_num_blocks * target.block_size
        else:
            tokens = self.max_num_seqs * self.max_model_len
        wanted = -(-tokens // self.block_size)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * DRAFT_KV_FREE_FRACTION)
        else:
            budget = int(target.cpu_kv_cache_gib * GiB)
        n = min(wanted, budget // block_bytes)
        if n < wanted:
            logger.warning("draft model: memory for %d KV blocks of %d tokens, fewer than the %d that match the "
                           "target's pool; some sequences will get fewer proposals", n, self.block_size, wanted)
        if n < 1:
            raise ValueError(f"draft model: no memory for its KV cache ({block_bytes} bytes per block)")
        return n

    def _capture_graphs(self, target: EngineConfig, kv_heads: int) -> None:
        from pagedserve.runner.cuda_graph import DecodeCUDAGraphs, batch_buckets, graph_capturable

        if not graph_capturable(self.model):
            return
        # Twice max_num_seqs: a steady-state catch-up has up to two rows per request (module docstring).
        buckets = batch_buckets(min(2 * self.max_num_seqs, self.max_num_batched_tokens), target.cuda_graph_sizes)
        if buckets:
            self.graphs = DecodeCUDAGraphs(self.model, self.kv_caches, buckets, max_model_len=self.max_model_len,
                                           block_size=self.block_size, device=self.device, num_kv_heads=kv_heads)
            self.graphs.capture()

    # --- the Proposer interface ----------------------------------------------------------------------
    def finish(self, seq_id: int) -> None:
        self.kv.free(seq_id)

    @torch.inference_mode()
    def propose(self, requests: list[ProposalRequest]) -> Proposals:
        out: list[list[int]] = [[] for _ in requests]
        plan = self._plan(requests)
        active, ks = plan.active, plan.ks
        logits = self._catch_up(requests, plan.pieces) if plan.pieces else None
        for i, start, q in plan.pieces:  # a piece of a longer catch-up: its KV is written, no proposal
            if i not in ks:
                self.kv.commit(requests[i].seq_id, requests[i].token_ids[:start + q], [])
        if not active:
            return Proposals(out, None)
        reqs = [requests[i] for i in active]
        k = [ks[i] for i in active]
        tokens, probs = self._draft_steps(logits, reqs, k)
        drawn = to_host(tokens)  # the round's one device-to-host read: [steps, rows]
        for row, i in enumerate(active):
            out[i] = [drawn[s][row] for s in range(k[row])]
            self.kv.commit(requests[i].seq_id, requests[i].token_ids, out[i][:-1])
        return Proposals(out, probs)

    def _draft_steps(self, logits: torch.Tensor, reqs: list[ProposalRequest],
                     ks: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Proposals 1..max(ks) of the caught-up requests, all on the device and launched without
        reading it: from the catch-up's logits (proposal 1), then max(ks) - 1 decode steps whose
        metadata advances on the device (spec_decode/draft_steps.py). Returns the draws
        [max(ks), rows] (row r's first ks[r] are its proposals) and, when some request samples, the
        probability rows of the proposals in request order (Proposals.draft_probs)."""
        sampling = self._sampling(reqs, ks)
        steps = max(ks)
        tokens, probs = self._draw(logits, sampling, 0)
        all_tokens, all_probs = [tokens], [probs]
        if steps > 1:
            n = np.asarray([len(r.token_ids) for r in reqs], dtype=np.int64)
            decode = DraftDecodeSteps(self.model, self.kv_caches, self.block_size, self.graphs, self.device,
                                      positions=n, last=n + np.asarray(ks, dtype=np.int64) - 2,
                                      block_tables=[self.kv.block_table(r.seq_id) for r in reqs])
            for step in range(1, steps):
                tokens, probs = self._draw(decode.step(tokens), sampling, step)
                all_tokens.append(tokens)
                all_probs.append(probs)
        if sampling is None:
            return torch.stack(all_tokens), None
        # Step s's row r is proposal s + 1 of request r; request order lists each request's in turn.
        b = len(reqs)
        order = to_device([s * b + r for r, k in enumerate(ks) for s in range(k)], torch.long, self.device)
        return torch.stack(all_tokens), torch.cat(all_probs).index_select(0, order)

    def _sampling(self, reqs: list[ProposalRequest], ks: list[int]) -> tuple | None:
        """None when every request is greedy; else the rows' temperatures on the device (uploaded
        once a round), their own generators (None: the proposer's) and their ks."""
        if not any(r.temperature > 0 for r in reqs):
            return None
        temps = to_device([r.temperature for r in reqs], torch.float32, self.device)
        return temps, [r.generator if r.temperature > 0 else None for r in reqs], ks

    # --- one round's pieces ------------------------------------------------------------------------------
    def _plan(self, requests: list[ProposalRequest]) -> CatchUpPlan:
        """This round's catch-up (plan_catch_up) and each caught-up request's k, lowered to what
        the draft's length limit and its free blocks allow."""
        unseen = []
        for r in requests:
            n = len(r.token_ids)
            if n == 0 or r.num_speculative_tokens < 1:
                unseen.append(None)
                continue
            start = min(self.kv.match(r.seq_id, r.token_ids), n - 1)
            unseen.append((start, n - start))

        def reserve(i: int, tokens: int) -> int:
            r, n = requests[i], len(requests[i].token_ids)
            if tokens < n:  # a piece: KV for its tokens only
                return 0 if self.kv.reserve(r.seq_id, tokens) else -1
            # KV for positions 0 .. n + k - 2 (verified tokens, proposals 1..k-1), all < max_model_len.
            k = min(r.num_speculative_tokens, self.max_model_len - n + 1)
            while k >= 1 and not self.kv.reserve(r.seq_id, n + k - 1):
                k -= 1
            return k

        return plan_catch_up(unseen, self.max_num_batched_tokens, reserve)

    def _catch_up(self, requests: list[ProposalRequest], pieces: list[tuple[int, int, int]]) -> torch.Tensor:
        """One forward over the round's pieces (at most max_num_batched_tokens tokens): the draft
        writes their KV; returns the logits after the last token of each piece that ends its
        request's verified tokens (the active requests, in request order: proposal 1)."""
        ids = np.concatenate([np.asarray(requests[i].token_ids[s:s + q], dtype=np.int64) for i, s, q in pieces])
        ends = np.asarray([s + q == len(requests[i].token_ids) for i, s, q in pieces])
        return self._forward(ids, np.asarray([s for _, s, _ in pieces], dtype=np.int64),
                             np.asarray([q for _, _, q in pieces], dtype=np.int64),
                             [requests[i].seq_id for i, _, _ in pieces], sample_mask=ends)

    def _forward(self, input_ids: np.ndarray, starts: np.ndarray, query_lens: np.ndarray,
                 seq_ids: list[int], sample_mask: np.ndarray) -> torch.Tensor:
        """The catch-up's forward: logits [sample_mask.sum(), vocab] of the last query token of each
        sequence sample_mask selects, in the model's dtype. It replays the decode graph of its token
        count as one decode row per token where runner/decode_rows.py allows, else runs eagerly."""
        tables = [self.kv.block_table(s) for s in seq_ids]
        n = len(seq_ids)
        # One token per sequence, every one sampling (after a rejection): plain decode rows already.
        decode_only = bool((query_lens == 1).all() and sample_mask.all())
        inp: ModelInput = build_model_input(input_ids, starts, query_lens, tables, sample_mask,
                                            n if decode_only else 0, self.block_size, self.device)
        g = self.graphs
        if g is not None and g.bucket_for(len(input_ids)) is not None:
            # Decode rows while they read at most twice what a decode step of these sequences reads.
            reads = max(MAX_PREFILL_POSITIONS, 2 * int((starts + query_lens).sum()))
            meta = inp.attn_meta if decode_only else as_decode_rows(
                inp.attn_meta, inp.positions, max_prefill_tokens=g.buckets[-1], max_prefill_positions=reads)
            if meta is not None:
                hidden = g.run(inp.input_ids, inp.positions, meta)
                return self.model.compute_logits(hidden[inp.sample_indices])
        hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.attn_meta)
        return self.model.compute_logits(hidden[inp.sample_indices])

    def _draw(self, logits: torch.Tensor, sampling: tuple | None,
              step: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One token per row (int64, on the device) and, when the round has a sampled request
        (sampling: _sampling's), the rows' probabilities (one-hot for greedy rows: what they were
        drawn from). A request's own generator draws only at the steps that make its proposals
        (step < its k), so what it draws does not depend on the batch. Nothing here reads the device."""
        logits = logits[:, :self.vocab_size].float()
        tokens = logits.argmax(dim=-1)
        if sampling is None:
            return tokens, None
        temps, generators, ks = sampling
        sampled = temps > 0
        probs = torch.softmax(logits / torch.where(sampled, temps, 1.0)[:, None], dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for j, (gen, k) in enumerate(zip(generators, ks)):
            if gen is not None and step < k:
                # By type: a generator made on "cuda" reports cuda, the tensors cuda:0.
                if gen.device.type == probs.device.type:
                    noise[j].exponential_(generator=gen)
                else:  # a host generator beside a device draft: drawn on the host, copied without a sync
                    drawn = torch.empty(probs.shape[1]).exponential_(generator=gen)
                    noise[j].copy_(drawn if probs.device.type == "cpu" else drawn.pin_memory(), non_blocking=True)
        drawn = (probs / noise).argmax(dim=-1)  # exponential race: token i with probability probs[i]
        tokens = torch.where(sampled, drawn, tokens)
        one_hot = torch.zeros_like(probs).scatter_(1, tokens[:, None], 1.0)
        probs = torch.where(sampled[:, None], probs, one_hot)
        return tokens, probs
