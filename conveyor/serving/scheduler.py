"""Iteration-level scheduler: one token budget per step, running requests first, chunked prefill,
preemption by recompute. No torch here."""
from __future__ import annotations

import time
from collections import deque

from conveyor.serving.admission import Admission
from conveyor.serving.config import SchedulerConfig
from conveyor.serving.kv_cache_manager import KVCacheManager, cdiv
from conveyor.serving.outputs import ModelRunnerOutput, ScheduledChunk, SchedulerOutput
from conveyor.serving.request import Request, RequestStatus
from conveyor.serving.step_budget import StepBudget
from conveyor.serving.step_cost import StepCostModel


class Scheduler(Admission):
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self.num_preemptions_total = 0
        self.num_refused_ttft = 0  # requests refused by TTFT admission (admission_policy "slo")
        self._num_waiting_tokens = 0
        # Keep a few blocks back when admitting, so a new request does not force a preemption next step.
        self._watermark_blocks = max(1, kv_cache.num_blocks // 100)
        self.step_cost = StepCostModel()
        self.budget = StepBudget(config, self.step_cost)
        self._mean_step_s = 0.0  # recent step time (exponential average), for expected queue waits
        # Async scheduling: a chunk counts as computed when it is scheduled, and a sampling chunk leaves a
        # placeholder until update() gets its token, so the next step can be scheduled before this one ends.
        self._ahead = config.async_scheduling
        # Wall time for the latency targets; a simulator (benchmarks/slo_sim.py) swaps in its own clock.
        self.clock = time.monotonic

    # ---- queue state -------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, request: Request, *, check_ttft: bool = True) -> None:
        """Queue a request, or raise QueueFullError (429 upstream; admission.py says when). check_ttft=False: the
        engine process's inbox thread has held it against the TTFT target already (engine_inbox.py), and that
        decision is final."""
        self.check_admission(request, check_ttft=check_ttft)
        self.requests[request.request_id] = request
        self._enqueue(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """End requests from outside the step (abort, stop string); their blocks are freed now."""
        ended = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
                self._num_waiting_tokens -= request.num_tokens
            self._finish(request, status)
            ended.append(request)
        return ended

    # ---- one step ----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        budget = self.token_budget()
        scheduled: dict[str, ScheduledChunk] = {}
        running_status, chunked = RequestStatus.RUNNING, self.config.enable_chunked_prefill
        allocate = self.kv_cache.allocate_slots
        for request, remaining in self._decodes_first():
            if budget == 0:
                break
            if request.status is not running_status or remaining == 0:
                continue  # preempted earlier in this loop, or its one token is in flight (async scheduling)
            if request.num_output_placeholders and self._ends_in_flight(request):
                continue
            if remaining > budget and not chunked:
                continue
            num_new = remaining if remaining < budget else budget
            block_ids = allocate(request, num_new)
            if block_ids is None and (block_ids := self._preempt_for(request, num_new, scheduled, out)) is None:
                continue
            scheduled[request.request_id] = ScheduledChunk(request, request.num_computed_tokens, num_new, block_ids)
            budget -= num_new
        if not out.preempted_ids:
            held = self._hold_back_compiling(out)
            budget = self._admit_waiting(budget, scheduled)
            self.waiting.extendleft(reversed(held))
        out.chunks = list(scheduled.values())
        if self._ahead:
            for chunk in out.chunks:
                _commit_ahead(chunk)
        return out

    def token_budget(self) -> int:
        """This step's token budget (step_budget.py: fixed, or sized to the ITL target)."""
        return self.budget.tokens(self.running, self.waiting, self.clock(), self._mean_step_s)

    def observe_step(self, sched: SchedulerOutput, seconds: float) -> None:
        if sched.chunks:
            self._mean_step_s += 0.1 * (seconds - self._mean_step_s)
            # Without a reader the fit (least squares, a KV-read count over every chunk) was host work in every
            # step for nothing (~0.1 ms at batch 64 on a 2-core Zen 3).
            if self.budget.reads_step_cost:
                self.step_cost.observe(sched.num_scheduled_tokens, len(sched.chunks), seconds, sched.num_kv_reads)

    def _decodes_first(self) -> list[tuple[Request, int]]:
        """The running requests with their tokens not yet scheduled, decodes first: they are one token each and
        every running stream is waiting on its next token. Otherwise in running order."""
        decodes, prefills = [], []
        for r in self.running:  # num_tokens_to_schedule, inlined: this runs for every request of every step
            remaining = (len(r.prompt_token_ids) + len(r.output_token_ids) + r.num_output_placeholders
                         - r.num_computed_tokens)
            (decodes if remaining <= 1 else prefills).append((r, remaining))
        return decodes + prefills if prefills else decodes

    def _ends_in_flight(self, request: Request) -> bool:
        """A token in flight will be its last by length (max_tokens, the context): nothing more to schedule."""
        num_ahead = request.num_output_placeholders
        return (request.num_output_tokens + num_ahead >= request.max_tokens
                or request.num_tokens + num_ahead >= self.max_model_len)

    def _preempt_for(self, request: Request, num_new: int, scheduled: dict[str, ScheduledChunk],
                     out: SchedulerOutput) -> list[int] | None:
        """No room for request's num_new tokens: preempt others until there is; None if it was itself preempted."""
        while True:
            victim = self._pick_victim(request, scheduled)
            self._preempt(victim, out)
            if victim is request:
                return None
            block_ids = self.kv_cache.allocate_slots(request, num_new)
            if block_ids is not None:
                return block_ids

    def _pick_victim(self, request: Request, scheduled: dict[str, ScheduledChunk]) -> Request:
        """The latest-admitted running request not yet given tokens this step; else the request itself."""
        for candidate in reversed(self.running):
            if candidate is not request and candidate.request_id not in scheduled:
                return candidate
        return request

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        # Keep the block hashes: on re-admission the prefix cache usually gives its own blocks back.
        self.kv_cache.free(request, forget_hashes=False)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0  # a token still in flight is appended when it lands (update)
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self._num_waiting_tokens += request.num_tokens
        self.waiting.appendleft(request)
        out.preempted_ids.append(request.request_id)

    def _hold_back_compiling(self, out: SchedulerOutput) -> list[Request]:
        """Structured-output requests whose grammar is still compiling sit out admission, whichever scheduler
        admits (schedule() puts them back at the head of the queue after it); one whose compile failed or timed
        out ends here, finish reason "error", without a token."""
        if not any(r.grammar is not None and r.grammar.compiling for r in self.waiting):
            return []  # the common case: one pass, nothing compiling
        held, kept = [], deque()
        for request in self.waiting:
            if request.grammar is None or request.grammar.poll():
                kept.append(request)
            elif request.grammar.failed:
                self._num_waiting_tokens -= request.num_tokens
                self._finish(request, RequestStatus.FINISHED_ERROR)
                out.failed.append(request)
            else:
                held.append(request)  # still counted in _num_waiting_tokens: it waits, just not admissible yet
        self.waiting = kept
        return held

    def _admit_waiting(self, budget: int, scheduled: dict[str, ScheduledChunk]) -> int:
        while (self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs
               and self.budget.batch_has_room(self.running, self.waiting)):
            request = self.waiting[0]
            computed, num_cached = self.kv_cache.get_computed_blocks(request)
            num_new = request.num_tokens - num_cached
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            if not self._fits_for_admission(request, num_new, computed):
                break
            block_ids = self.kv_cache.allocate_slots(request, num_new, computed)
            if block_ids is None:
                break
            self._pop_waiting()
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = self.clock()
            request.num_computed_tokens = num_cached
            request.num_cached_tokens = num_cached
            self.running.append(request)
            scheduled[request.request_id] = ScheduledChunk(request, num_cached, num_new, block_ids)
            budget -= num_new
        return budget

    def _pop_waiting(self) -> None:
        self._num_waiting_tokens -= self.waiting.popleft().num_tokens

    def _fits_for_admission(self, request: Request, num_new: int, computed: list) -> bool:
        needed = cdiv(request.num_computed_tokens + num_new, self.kv_cache.block_size) - len(computed)
        free_after = self.kv_cache.num_free_blocks - sum(1 for b in computed if b.ref_count == 0) - needed
        return free_after >= self._watermark_blocks or not self.running

    # ---- results -----------------------------------------------------------------------------------
    def update(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[Request]:
        """Advance progress counters, append sampled tokens, end requests that hit a stop condition.
        Returns the requests that received a token this step (finished ones included)."""
        updated = []
        # Locals: this loop runs for every request of every step (256 of them: ~1 ms of a step's host work).
        running, cache_full_blocks, sampled_of = RequestStatus.RUNNING, self.kv_cache.cache_full_blocks, \
            runner_output.sampled.get
        ahead, max_model_len, block_size = self._ahead, self.max_model_len, self.kv_cache.block_size
        for chunk in scheduler_output.chunks:
            request = chunk.request
            if request.status is not running:
                # Aborted or finished between schedule and update; under async scheduling also preempted by the
                # step scheduled meanwhile, whose token (computed on its own valid cache) is still its next one.
                if ahead and request.status is RequestStatus.PREEMPTED:
                    updated += self._land_on_preempted(request, sampled_of(request.request_id), scheduler_output)
                continue
            if ahead:
                if chunk.samples:
                    request.num_output_placeholders -= 1
            else:
                request.num_computed_tokens += chunk.num_tokens
            # A 1-token chunk fills a block only when it ends on a block boundary (longer chunks: look).
            if chunk.num_tokens > 1 or not (chunk.start + 1) % block_size:
                cache_full_blocks(request)
            token_id = sampled_of(request.request_id)
            if token_id is None:
                continue  # a prefill chunk that did not reach the end of the prompt
            if token_id < 0:  # the sampler's NO_TOKEN: its logits had no finite value (sampler.py)
                self.running.remove(request)
                self._fail(request, scheduler_output)
                continue
            output = request.output_token_ids
            output.append(token_id)
            updated.append(request)
            # The common case in one test, without a call: none of _stop_status's conditions can hold.
            if (request.grammar is None and token_id != request.eos_token_id
                    and token_id not in request.sampling_params.stop_token_ids
                    and len(output) < request.max_tokens
                    and len(request.prompt_token_ids) + len(output) < max_model_len):
                continue
            status = self._status_after(request, token_id)
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
        return updated

    def _land_on_preempted(self, request: Request, token_id: int | None, out: SchedulerOutput) -> list[Request]:
        if token_id is None:
            return []
        if token_id < 0:
            self.waiting.remove(request)
            self._num_waiting_tokens -= request.num_tokens
            self._fail(request, out)
            return []
        request.output_token_ids.append(token_id)
        self._num_waiting_tokens += 1  # it waits with one more token to recompute
        status = self._status_after(request, token_id)
        if status is not None:
            self.waiting.remove(request)
            self._num_waiting_tokens -= request.num_tokens
            self._finish(request, status)
        return [request]

    def _status_after(self, request: Request, token_id: int) -> RequestStatus | None:
        """The request's grammar takes the appended token; the status it ends with, or None to go on."""
        if request.grammar is not None and not request.grammar.accept(token_id):
            return RequestStatus.FINISHED_ERROR  # cannot happen under its mask; never loop on a refusal
        return self._stop_status(request, token_id)

    def _stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        """update() calls this only past its inline test that none of these conditions can hold (no grammar, not
        EOS, no stop token, room left): a condition added here must be added to that test."""
        params = request.sampling_params
        if not params.ignore_eos and token_id == request.eos_token_id:
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if request.grammar is not None and request.grammar.is_terminated():
            return RequestStatus.FINISHED_STOPPED  # the grammar is complete: only EOS could follow
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _enqueue(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self._num_waiting_tokens += request.num_tokens
        self.waiting.append(request)

    def _fail(self, request: Request, out: SchedulerOutput) -> None:
        """End a request that cannot go on, finish reason "error", without a token (the engine reports out.failed
        after update(), as it does a grammar that failed to compile)."""
        self._finish(request, RequestStatus.FINISHED_ERROR)
        out.failed.append(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        if status in _ENDED_BY_ITS_OUTPUT:
            self.budget.observe_finished(len(request.output_token_ids))
        self.kv_cache.free(request)
        self.requests.pop(request.request_id, None)
        self._finished_ids.append(request.request_id)


_ENDED_BY_ITS_OUTPUT = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)


def _commit_ahead(chunk: ScheduledChunk) -> None:
    request = chunk.request
    request.num_computed_tokens += chunk.num_tokens
    if chunk.samples:
        request.num_output_placeholders += 1
