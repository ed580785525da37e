"""StructuredOutputs: everything the engine does for requests with SamplingParams.structured_outputs.

Lifecycle of a constrained request:
  1. add_request: check() parses the spec synchronously (a bad schema / regex / grammar is a
     ValueError now) and submit() starts the compile on the pool (a cache hit is done at once).
     Behind the API server (schemas_checked), which has parsed the spec already, check() does not
     parse: submit() hands the parse to the pool, which runs it on the compile thread before the
     compile, off the step thread; a spec that fails there fails its request alone in poll(), as
     a failed compile does, and the parse counts inside compile_timeout_s.
  2. Until its compile is done the request waits here, outside the scheduler, while every other
     request keeps running; poll() at the start of each step hands over the ready ones and fails
     the ones whose compile raised or ran past structured_outputs_compile_timeout_s (that request
     alone finishes with finish_reason "abort" and an error naming the cause).
  3. Its first sequence gets a matcher (matchers.py); forks copy it; every step advance_and_fill()
     feeds each constrained row's grammar its newest token and fills its bitmask row on the host
     (masks.py: xgrammar's batch calls, the fill on its own threads, or with
     PAGEDSERVE_GRAMMAR_FILL_POOL=1 on fill_pool.py's long-lived ones), and apply() uploads the rows
     and masks the logits in place on the device before any sampling (penalties, temperature,
     top-k/p, greedy argmax all see -inf for a token the grammar forbids). With
     PAGEDSERVE_GRAMMAR_FILL=overlap the caller's other host work (the engine: processing the
     previous step's tokens) runs on a helper thread while this thread fills: xgrammar gives up
     the GIL for the whole fill, so the helper's Python runs meanwhile; advance_and_fill returns
     once both are done.
  4. A sequence whose matcher has accepted its stop token (EOS) finishes with "stop".
"""
from __future__ import annotations

import functools
import os
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable

import torch
import xgrammar as xgr

from pagedserve.config import STRUCTURED_OUTPUTS_MAX_WHITESPACE
from pagedserve.engine.structured.compiler import BACKENDS, GrammarCompilerPool, parse_spec
from pagedserve.engine.structured.fill_pool import FillPool
from pagedserve.engine.structured.masks import BATCH_FILL_MIN_ROWS, MaskBuffers, StepMask, default_fill_threads
from pagedserve.engine.structured.matchers import SeqGrammar, SeqGrammars
from pagedserve.sampling_params import StructuredOutputsParams


GRAMMAR_FILL_MODES = ("inline", "overlap")


def grammar_fill_mode() -> str:
    """PAGEDSERVE_GRAMMAR_FILL: what an overlapped step does while its masks fill. inline
    (default): nothing, the step loop fills, launches the sampler, then processes the previous
    step's tokens; overlap: a helper thread processes them during the fill (step_pipeline._launch).

    Why the fill stays on the step loop's thread and the Python work moves (the removed
    `background` mode did the opposite and measured slower): a thread needs the GIL to start and
    to return from a native call. A fill started on another thread waits for the GIL until the
    loop's Python stops (its switch interval, 5 ms, or the join), so it ran after that Python,
    not beside it. The loop's own native call gives the GIL up at once, and the helper takes it."""
    mode = os.environ.get("PAGEDSERVE_GRAMMAR_FILL", "").strip().lower() or "inline"
    if mode not in GRAMMAR_FILL_MODES:
        raise ValueError(f"PAGEDSERVE_GRAMMAR_FILL must be one of {', '.join(GRAMMAR_FILL_MODES)}, got {mode!r}")
    return mode


FILL_POOL_ENV = "PAGEDSERVE_GRAMMAR_FILL_POOL"


def fill_pool_enabled() -> bool:
    """PAGEDSERVE_GRAMMAR_FILL_POOL: who fills a step's masks from BATCH_FILL_MIN_ROWS rows. "0"
    (the default): xgrammar's BatchGrammarMatcher(fill_threads), which starts and joins its threads
    on every call; "1": a FillPool (fill_pool.py), fill_threads threads started once (the caller
    and fill_threads - 1 workers), each a serial fill of its share of the rows. Off until the H200
    measures it (benchmarks/kernels/structured_mask_cost.py --fill-compare, then a serving run)."""
    mode = os.environ.get(FILL_POOL_ENV, "").strip() or "0"
    if mode not in ("0", "1"):
        raise ValueError(f"{FILL_POOL_ENV} must be 0 or 1, got {mode!r}")
    return mode == "1"


@dataclass
class PendingCompile:
    group: Any                  # the SequenceGroup, not yet in the scheduler
    future: Future
    deadline: float             # time.monotonic() past which the request fails


class StructuredOutputs:
    """One engine's grammars: the compiler pool, requests waiting for a compile, per-sequence
    matchers and the bitmask buffers."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: set[int], device: torch.device,
                 backend: str = "auto", compile_timeout_s: float = 30.0, compile_threads: int = 2,
                 fill_threads: int | None = None,
                 max_whitespace: int = STRUCTURED_OUTPUTS_MAX_WHITESPACE, schemas_checked: bool = False) -> None:
        """schemas_checked: the engine serves the API server, which has parsed every spec
        (jsonschema's meta-schema check, the unenforced-keyword walk and xgrammar's conversion:
        entrypoints/openai/structured_outputs.py) off its event loop; here they would run again
        on the step thread, ~7 ms per KB of schema for the checks and ~6.5 ms for a 33 KB
        schema's conversion, stalling every request in flight. So check() skips the parse and the
        pool converts the spec on its compile thread (skipping the two checks); xgrammar's
        conversion there still refuses a malformed spec, failing that request alone."""
        if backend not in BACKENDS:
            raise ValueError(f"structured_outputs_backend must be one of {BACKENDS}, got {backend!r}")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.device = device
        self.compile_timeout_s = compile_timeout_s
        self.compile_threads = compile_threads
        self.max_whitespace = max_whitespace  # parse_spec's bound on JSON whitespace runs (0: none)
        self.schemas_checked = schemas_checked
        self._pool: GrammarCompilerPool | None = None   # built on first use (TokenizerInfo takes a moment)
        self.pending: dict[str, PendingCompile] = {}    # request id -> waiting for its grammar
        self.compiled: dict[str, xgr.CompiledGrammar] = {}  # request id -> its grammar (admitted)
        self.seqs = SeqGrammars()
        self.masks = MaskBuffers(xgr.get_bitmask_shape(1, vocab_size)[1], pinned=device.type == "cuda")
        threads = default_fill_threads() if fill_threads is None else fill_threads
        if threads < 1:
            raise ValueError(f"fill_threads must be >= 1, got {threads}")
        self._fill_serial = xgr.BatchGrammarMatcher(1).batch_fill_next_token_bitmask  # in the calling thread
        # PAGEDSERVE_GRAMMAR_FILL_POOL=1: threads that outlive the call (started on the first fill).
        self._fill_pool = FillPool(threads) if fill_pool_enabled() and threads > 1 else None
        if self._fill_pool is not None:
            self._fill_threaded = self._fill_pool.fill
        elif threads > 1:
            self._fill_threaded = xgr.BatchGrammarMatcher(threads).batch_fill_next_token_bitmask
        else:
            self._fill_threaded = self._fill_serial
        self.overlap_fill = grammar_fill_mode() == "overlap"
        self._helper: ThreadPoolExecutor | None = None  # runs advance_and_fill's `alongside`, on first use

    # ---- compiles -------------------------------------------------------------------------

    @property
    def pool(self) -> GrammarCompilerPool:
        if self._pool is None:
            self._pool = GrammarCompilerPool(self.tokenizer, self.vocab_size, self.stop_token_ids,
                                             threads=self.compile_threads)
        return self._pool

    @property
    def pool_if_started(self) -> GrammarCompilerPool | None:
        return self._pool

    def check(self, spec: StructuredOutputsParams) -> xgr.Grammar | None:
        """Parse the spec now (ValueError naming the problem); what submit() compiles. None: the
        same spec is in the compile cache, so parsing it again (~1 ms, most of it the JSON Schema
        meta-schema check) is skipped; or, behind the server (schemas_checked), the spec is not
        parsed here at all: submit() has the pool parse it on its compile thread."""
        if self.tokenizer is None:
            raise ValueError("structured_outputs needs the tokenizer: this engine was started with "
                             "skip_tokenizer_init=True")
        if self.schemas_checked:
            return None  # the server parsed it (a 400 for a bad one); the pool converts it again
        if self._pool is not None and self._pool.has(spec.key()):
            return None  # compiled (or compiling) already: parsed and checked then
        return parse_spec(spec, self.max_whitespace)

    def submit(self, group: Any, spec: StructuredOutputsParams, grammar: xgr.Grammar | None) -> bool:
        """Start (or reuse) the compile. True: the grammar was compiled already and the group may
        be scheduled now (start() done); False: the group waits here until poll() hands it over.
        A new compile always waits for poll(), even one whose thread has finished by now: poll
        weighs it against its deadline first, so whether it meets compile_timeout_s does not
        depend on which thread ran first (with a 1 us limit such a compile was served now and
        then, on a loaded machine)."""
        key = spec.key()
        compiled_already = self.pool.has(key)
        if grammar is None and not compiled_already:
            if self.schemas_checked:
                # On the compile thread, inside this request's deadline; a ValueError there fails
                # this request alone (poll), not add_request nor the step loop.
                grammar = functools.partial(parse_spec, spec, self.max_whitespace, True, True)
            else:  # evicted since check(): parse after all
                grammar = parse_spec(spec, self.max_whitespace)
        fut = self.pool.submit(key, grammar)
        if compiled_already and fut.done() and fut.exception() is None:
            self.start(group, fut.result())
            return True
        self.pending[group.request_id] = PendingCompile(group, fut, time.monotonic() + self.compile_timeout_s)
        return False

    def poll(self) -> tuple[list[Any], list[tuple[Any, str]]]:
        """(groups now ready to schedule, in arrival order; (group, error) of those that failed)."""
        if not self.pending:
            return [], []
        ready, failed = [], []
        now = time.monotonic()
        for rid, p in list(self.pending.items()):
            # The deadline first: a request still waiting when the engine looks past its deadline
            # has waited too long, whether or not its compile ended a moment ago (the engine looks
            # every step, so the limit is kept to within one step, and the outcome does not depend
            # on which thread ran first).
            if now >= p.deadline:
                del self.pending[rid]
                failed.append((p.group, f"structured_outputs: compiling the grammar took longer than "
                                        f"structured_outputs_compile_timeout_s={self.compile_timeout_s:g}"))
            elif p.future.done():
                del self.pending[rid]
                err = p.future.exception()
                if err is None:
                    self.start(p.group, p.future.result())
                    ready.append(p.group)
                elif isinstance(err, ValueError) and str(err).startswith("structured_outputs"):
                    failed.append((p.group, str(err)))  # parse_spec's own words, run on the pool
                else:
                    failed.append((p.group, f"structured_outputs: the grammar failed to compile: {err}"))
        return ready, failed

    def wait_for_compiles(self, timeout_s: float) -> None:
        """Block until some pending compile finishes or times out, at most timeout_s (an engine with
        nothing else to run waits here instead of spinning)."""
        if not self.pending:
            return
        until = min(p.deadline for p in self.pending.values()) - time.monotonic()
        wait([p.future for p in self.pending.values()], timeout=max(0.0, min(timeout_s, until)),
             return_when=FIRST_COMPLETED)

    def start(self, group: Any, compiled: xgr.CompiledGrammar) -> None:
        self.compiled[group.request_id] = compiled
        for seq in group.seqs:
            self.seqs.start(seq.seq_id, compiled)

    def forget(self, group: Any) -> None:
        """The request finished or was aborted: drop its wait, its grammar and its matchers."""
        self.pending.pop(group.request_id, None)
        self.compiled.pop(group.request_id, None)
        for seq in group.seqs:
            self.seqs.free(seq.seq_id)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.compiled

    # ---- per step -------------------------------------------------------------------------

    def grammar_of(self, seq: Any) -> SeqGrammar | None:
        return self.seqs.get(seq.seq_id)

    def advance_and_fill(self, rows: list[tuple[int, SeqGrammar, list[int], int | None]],
                         alongside: Callable[[], None] | None = None) -> StepMask | None:
        """A step's mask from (logits row, grammar, output tokens, pending) in increasing row
        order: each grammar first takes the tokens it has not accepted (SeqGrammars.advance: the
        output tokens, then `pending`, the previous overlapped step's token), then fills its row;
        the fill on xgrammar's threads. None when no row needs masking (a done
        grammar's row is discarded anyway: its sequence has ended, so it is left unmasked).
        alongside: host work run once, on the helper thread, while this thread fills (with nothing
        to fill, here after the accepts); this returns after it has ended and re-raises its error.
        It must not touch these rows' matchers; it may append their tokens (they have accepted
        them already) and read `done`."""
        if not rows:
            if alongside is not None:
                alongside()
            return None
        slot, bitmask = self.masks.take(rows[-1][0] + 1)
        SeqGrammars.advance([(g, out, pending) for _, g, out, pending in rows])
        live = [(i, g.matcher) for i, g, _, _ in rows if not g.done]
        if not live:
            if alongside is not None:
                alongside()
            return None
        if alongside is None:
            self._fill(live, bitmask)
        else:
            self._fill_alongside(live, bitmask, alongside)
        return StepMask(bitmask, live[-1][0] + 1, [i for i, _ in live], slot)

    def _fill_alongside(self, live: list[tuple[int, Any]], bitmask: torch.Tensor,
                        work: Callable[[], None]) -> None:
        """_fill on this thread while `work` runs on the helper: the helper is woken first and
        takes the GIL the moment xgrammar's call gives it up, so its Python overlaps the fill."""
        if self._helper is None:
            self._helper = ThreadPoolExecutor(1, thread_name_prefix="grammar-overlap")
        done = self._helper.submit(work)
        try:
            self._fill(live, bitmask)
        finally:
            error = done.exception()  # waits: the helper never outlives the step's mask
        if error is not None:
            raise error

    def _fill(self, live: list[tuple[int, Any]], bitmask: torch.Tensor) -> None:
        """Fill (logits row, matcher) rows: on xgrammar's threads (or the FillPool's) from
        BATCH_FILL_MIN_ROWS rows."""
        if live:
            fill = self._fill_threaded if len(live) >= BATCH_FILL_MIN_ROWS else self._fill_serial
            fill([m for _, m in live], bitmask, [i for i, _ in live])

    def fill(self, rows: list[tuple[int, SeqGrammar]]) -> StepMask | None:
        """advance_and_fill for grammars already caught up: (logits row, grammar) pairs."""
        if not rows:
            return None
        slot, bitmask = self.masks.take(rows[-1][0] + 1)
        live = [(i, g.matcher) for i, g in rows if not g.done]
        self._fill(live, bitmask)
        return StepMask(bitmask, live[-1][0] + 1, [i for i, _ in live], slot) if live else None

    def apply(self, logits: torch.Tensor, mask: StepMask | None) -> None:
        """Mask the logits in place on their device: forbidden tokens become -inf. Nothing here
        waits for the device: the rows (and the indices, when only some rows are masked) go up
        from pinned memory into persistent device buffers, queued before xgrammar's kernel."""
        if mask is None:
            return
        vocab = min(self.vocab_size, logits.shape[-1])
        # Every row of the logits masked: xgrammar needs no indices at all.
        indices = None if len(mask.indices) == logits.shape[0] else mask.indices
        if logits.device.type == "cpu":
            xgr.apply_token_bitmask_inplace(logits, mask.bitmask[:mask.rows], vocab_size=vocab, indices=indices)
            return
        bitmask, dev_indices = self.masks.upload(mask, logits.device, indices is not None)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=dev_indices)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
        if self._helper is not None:
            self._helper.shutdown(wait=True)
        if self._fill_pool is not None:
            self._fill_pool.close()
