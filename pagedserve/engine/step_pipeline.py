"""The step half of LLMEngine (llm_engine.py): one step is schedule -> execute -> sample -> outputs.

step() admits the requests whose grammar has compiled, lets speculation propose
(engine/speculation.py), asks the Scheduler for the step's plan, runs it on the runner
(synchronously, _run_sync, or launched ahead of its tokens, _launch), has the sampled tokens
appended (engine/token_application.py, the other half) and returns the outputs of the requests
that advanced or finished.

Overlapped steps (EngineConfig.async_scheduling): step() schedules and launches step N+1 (its
placeholder tokens read from N's sampled ids on the device), and only then waits for N's tokens
(copied out on a side stream) and processes them, so the device runs N+1 while the host appends,
detokenizes, checks stops and builds N's outputs, and then schedules N+2. Each call still
returns the outputs of one step (one step late); a request added after a step is launched joins
the next one. A sequence that N finishes has its N+1 row discarded.

Everything here acts on the engine's own state; the mixin holds none of its own.
"""
from __future__ import annotations

import time

from pagedserve.engine import prompt_logprobs
from pagedserve.engine.bad_words import needs_host_tail
from pagedserve.engine.inflight import InflightStep
from pagedserve.outputs import RequestOutput
from pagedserve.runner.async_output import AsyncHostCopy
from pagedserve.sampling_params import RequestOutputKind, SamplingParams
from pagedserve.sequence import SequenceGroup, SequenceStatus

FINAL_ONLY = RequestOutputKind.FINAL_ONLY


def overlaps(p: SamplingParams, forked: bool = False) -> bool:
    """Whether a request's steps can overlap (see EngineConfig.async_scheduling): nothing it needs
    reads the newest token on the host before the next step, and it does not fork. Logprobs travel
    with the sampled ids (DeviceSample.packed); min_tokens needs only how many tokens there are;
    penalties take the token in flight from the device (TokenApplication._sample_device). n /
    best_of > 1 forks at its first sample, a synchronous step; forked, its sequences decode as any
    others (forked=True)."""
    return p.prompt_logprobs is None and (p.best_of == 1 or forked) and not needs_host_tail(p)


class StepPipeline:
    """Mixin of LLMEngine: one step, from the schedule to the outputs."""

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """Run one scheduler step; returns outputs of requests that advanced or finished, each
        in its SamplingParams.output_kind shape. final_only=True treats every request as
        FINAL_ONLY (only finished ones report, which saves copying for offline use); a DELTA
        request then reports everything not yet sent. With overlapped steps the outputs are
        those of the step launched by the previous call (see the module docstring)."""
        timer = self.step_timer
        timer.begin()
        touched: dict[int, SequenceGroup] = {}
        if self.structured.pending:
            self._admit_compiled(touched)
        prev = self._inflight  # stays visible until processed: the step the scheduler plans around
        can_overlap = self.async_scheduling and not self._sync_requests

        def finish_inflight() -> None:
            # Speculation, or a request that needs every token on the host: the step in flight ends first.
            nonlocal prev
            if prev is not None:
                self._inflight = None
                self._process_inflight(prev, touched, final_only)
                prev = None

        # Speculation (engine/speculation.py) runs synchronous steps: proposals need every token on
        # the host. k = 0 (a large batch, a paused policy, a host-side proposer with nothing to
        # propose) keeps the step overlapped.
        spec_k = 0
        if self._spec_requests:
            spec_k = self.speculator.begin_step(self.scheduler, self._spec_requests, self._seq_generators,
                                                self.structured.seqs, prev is not None and can_overlap,
                                                finish_inflight)
        overlap = can_overlap and not spec_k
        if not overlap:
            finish_inflight()
        out = self.scheduler.schedule()
        if spec_k:
            for group in out.preempted:  # a draft model's state for them is stale once they resume
                for seq in group.seqs:
                    self.speculator.finish(seq.seq_id)
        timer.mark("schedule")
        self._note_scheduled(out)
        self._inflight = None
        for group in out.ignored:
            for seq in group.seqs:
                if not seq.status.finished:
                    seq.status = SequenceStatus.FINISHED_IGNORED
            touched[id(group)] = group
        if not out.is_empty:
            if overlap:
                self._inflight = self._launch(out, prev, touched, final_only)
            else:
                self._run_sync(out, touched, final_only)
        if spec_k:
            self.speculator.clear()  # no proposal outlives its step (an overlapped one must see none)
        if prev is not None and not prev.processed:
            self._process_inflight(prev, touched, final_only)
        if self._inflight is not None and not self._groups:
            self._inflight = None  # every request ended: its rows would all be discarded

        # The scheduler may also end groups on its own (one that outgrew the whole cache).
        for group in self.scheduler.free_finished_seq_groups():
            touched.setdefault(id(group), group)
        outputs = []
        for group in touched.values():
            rid = group.request_id
            finished = group.finished
            if rid in self._beams:
                if finished:
                    self._groups.pop(rid, None)
                    self._forget(group)
                    out = self._beams.finish(group)
                    if out is not None:  # a search served to the API server (add_beam_search_request)
                        outputs.append(out)
                continue
            if finished or not final_only:
                outputs.append(self.output_processor.make_output(group))
            if finished:
                self._groups.pop(rid, None)
                self._forget(group)
        timer.mark("postprocess")
        return outputs

    def _admit_compiled(self, touched: dict) -> None:
        """Requests whose grammar is ready join the scheduler; those whose compile failed or timed
        out end alone (finish_reason "abort", RequestOutput.error says why). With nothing else to
        run, wait a little for a compile instead of spinning."""
        st = self.structured
        if self._inflight is None and not self.scheduler.has_unfinished_seqs():
            st.wait_for_compiles(0.05)
        ready, failed = st.poll()
        for group in ready:
            self.scheduler.add_seq_group(group)
        for group, error in failed:
            for seq in group.seqs:
                seq.status = SequenceStatus.FINISHED_ABORTED
            group.error = error
            touched[id(group)] = group

    def _note_sampled(self, group: SequenceGroup, now: float, touched: dict, final_only: bool) -> None:
        if group.first_token_time is None:
            group.first_token_time = now
            group.metrics["first_token_time"] = now
        # final_only (for the whole step, or FINAL_ONLY for this request) reports finished groups
        # only, and every group that finishes here is still queued, so free_finished_seq_groups()
        # (or touched, for one finished while waiting) hands it back.
        if not final_only and group.sampling_params.output_kind is not FINAL_ONLY:
            touched[id(group)] = group

    def _note_scheduled(self, out) -> None:
        """The step's token count (last_step_tokens, the metrics' iteration tokens) and each
        request's first scheduled time (its queue time ends there): a request is first scheduled
        in a prefill row, so a decode row only adds its one token."""
        self.last_step_tokens = out.num_batched_tokens
        now = None
        for s in out.scheduled[out.num_decodes:]:  # decode rows come first
            if "first_scheduled_time" not in s.group.metrics:
                now = now or time.time()
                s.group.metrics["first_scheduled_time"] = now
                s.group.metrics["num_cached_tokens"] = s.start  # its prompt's prefix-cache hit

    def _run_sync(self, out, touched: dict, final_only: bool) -> None:
        """The synchronous step: execute, sample, and append before returning."""
        timer = self.step_timer
        timer.launch_begin(out)
        logits = self.runner.execute(out)
        timer.mark("execute", sync=True)
        prompt_logits = self.runner.last_prompt_logits
        if prompt_logits is not None:
            prompt_logprobs.record(out.scheduled, out.num_decodes, prompt_logits)
        sampled = [s for s in out.scheduled if s.do_sample]
        verified = []
        if self.speculator is not None and logits is not None and out.num_lookahead_tokens:
            # Verify first: the scheduler counts only verified tokens computed (num_rejected).
            logits, sampled, verified = self.speculator.verify(logits, sampled, self.sampler, self.generator,
                                                               self._seq_generators, self.structured)
        self.scheduler.update_after_step(out)
        now = time.time()
        if sampled and logits is not None:
            if self.structured.seqs:
                self._mask_logits(logits, sampled)
            for s in sampled:
                self._note_sampled(s.group, now, touched, final_only)
            self._process_samples(logits, sampled)
            if self._sync_requests:
                self._release_forked(sampled)
        if verified:
            for s, _, _ in verified:
                self._note_sampled(s.group, now, touched, final_only)
            self._append_verified(verified)
        timer.launch_end()

    def _release_forked(self, sampled: list) -> None:
        """A group that has forked (its first sample, just taken) may overlap from now on."""
        for s in sampled:
            rid = s.group.request_id
            if rid in self._sync_requests and rid not in self._beams and s.seq.output_token_ids \
                    and overlaps(s.group.sampling_params, forked=True):
                self._sync_requests.discard(rid)

    # ---- overlapped steps -----------------------------------------------------------------

    def _launch(self, out, prev: InflightStep | None, touched: dict, final_only: bool) -> InflightStep | None:
        """Queue the step on the device, sampling included, and start copying its tokens out;
        every sampled sequence gets a placeholder. Nothing here waits for the device. The
        executor calls the sampler inside the step (with tensor parallelism it then hands the
        ids to every rank's device before the step ends)."""
        timer = self.step_timer
        timer.launch_begin(out)
        sampled = [s for s in out.scheduled if s.do_sample]

        def process_prev():
            # Ends sequences and frees their blocks before update_after_step(out), which skips
            # the finished; their rows of this step are discarded when it is processed.
            self._process_inflight(prev, touched, final_only)
            prev.processed = True

        def sample(logits):
            timer.mark("execute")
            if self.structured.seqs:
                # The device runs this step's forward meanwhile: take the previous step's tokens,
                # advance the matchers, fill and apply this step's mask (vLLM's overlap); with
                # PAGEDSERVE_GRAMMAR_FILL=overlap, a helper thread processes those tokens during
                # the fill.
                alongside = process_prev if prev is not None and self.structured.overlap_fill else None
                self._mask_logits(logits, sampled, prev, alongside)
            return self._sample_device(logits, sampled, None if prev is None else prev.tokens)
        result = self.runner.execute(out, None if prev is None else prev.tokens, sample=sample)
        if result is None:
            timer.mark("execute")
        self.scheduler.update_after_step(out)
        if not sampled or result is None:
            timer.launch_end()
            return None
        for r, s in enumerate(sampled):
            seq = s.seq
            seq.num_inflight_tokens += 1
            seq.inflight_sample_row = r
        step = InflightStep(sampled, result.tokens, AsyncHostCopy(result))
        timer.launch_end()
        timer.mark("sample")
        return step
