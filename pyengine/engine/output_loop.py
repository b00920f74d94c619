"""The ``pyengine-output`` thread: turns each step's token ids into text and outputs.

Per event (one per step): note when new sequences were first scheduled, append every
accepted token to its sample (incremental detokenization, stop strings -> ``finish`` back
to the scheduler; log-probabilities from the event's :class:`StepResult`), record
finished sequences (embeddings and step errors from the same result), then deliver one
output per touched request to its sink. Each request's work is isolated: an exception
while handling one request's token, its end or its delivery fails that request alone,
and every other request of the event gets its tokens and its end in full. Only an
unexpected error outside that per-request work fails all the requests the event touched.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Callable, Optional

from pyengine._sched import FINISH_REASONS, SchedulerThread
from pyengine.engine.clock import ThreadClock
from pyengine.engine.request_state import RequestState
from pyengine.engine.request_table import RequestTable
from pyengine.engine.step_result import StepResult
from pyengine.engine.thread_names import name_current_thread
from pyengine.errors import EngineDeadError, EngineError
from pyengine.sampling_params import PoolingParams

if TYPE_CHECKING:
    from pyengine.kv_events.publisher import KvEventPublisher

logger = logging.getLogger(__name__)

OUTPUT_THREAD_NAME = "pyengine-output"
_ERROR = FINISH_REASONS.index("error")
_POOLED = FINISH_REASONS.index("pooled")


class OutputLoop:
    def __init__(
        self,
        sched: SchedulerThread,
        requests: RequestTable,
        executor_fatal: Callable[[], Optional[BaseException]],
        after_event: Callable[[], None] = lambda: None,
        kv_events: Optional[KvEventPublisher] = None,
    ) -> None:
        self.sched = sched
        # Where the events' prefix-cache changes go (docs/kv_events.md); None: they are off.
        self.kv_events = kv_events
        # Called once per event, after every sink got its outputs (and after the final
        # fail-all): an engine core in its own process sends the step's outputs as one
        # message then, rather than one message per request.
        self.after_event = after_event
        self.requests = requests
        self.executor_fatal = executor_fatal
        self.clock = ThreadClock()
        self.started = threading.Event()  # set once the thread runs under its OS name
        self.native_id: Optional[int] = None
        self.stopping = threading.Event()
        self.fatal: Optional[BaseException] = None
        self.generated_tokens = 0

    def run(self) -> None:
        name_current_thread(OUTPUT_THREAD_NAME)
        self.clock.start()
        self.native_id = threading.get_native_id()
        self.started.set()
        try:
            while True:
                with self.clock.idle():
                    event = self.sched.next_output(timeout=0.5)
                if event is not None:
                    self._handle(event)
                    self.after_event()
                elif self.stopping.is_set():
                    self._fail_all(EngineDeadError("the engine was shut down"))
                    break
                fatal = self.executor_fatal()
                if fatal is not None:
                    raise EngineDeadError(f"the executor thread died: {fatal!r}")
        except EngineDeadError as e:
            if not self.stopping.is_set():
                self.fatal = e
            self._fail_all(e if not self.stopping.is_set() else EngineDeadError("the engine was shut down"))
        except BaseException as e:  # noqa: BLE001 - reported to every waiting caller
            logger.exception("output thread died")
            self.fatal = e
            self._fail_all(EngineDeadError(f"the output thread died: {e!r}"))
        finally:
            self.after_event()  # what the fail-all delivered
            self.clock.stop()

    def _handle(self, event) -> None:
        touched: dict[str, RequestState] = {}
        result: Optional[StepResult] = event.step_result
        self.requests.settle_adds()
        if self.kv_events is not None and event.kv_events is not None:
            self.kv_events.publish(event.kv_events)  # queued, never waited for
        try:
            if result is not None and len(result.new_seq_ids):
                self._mark_scheduled(result)
            if result is not None and result.row_errors:
                self._fail_rows(result.row_errors)
            if result is not None and result.prompt_logprobs is not None:  # before the tokens they precede
                self._prompt_logprobs(result.prompt_logprobs, event.step_id)
            self._tokens(event, result, touched)
            self._finished(event, result, touched)
        except EngineDeadError:
            raise
        except Exception as e:  # noqa: BLE001 - every request the event names gets the error
            logger.exception("output processing failed for step %s", event.step_id)
            for state in {**touched, **self._named_by(event)}.values():
                self._fail(state, EngineError(f"output processing failed: {e!r}"))
            return
        for state in touched.values():
            if not state.failed:
                self._deliver(state, event.step_id)

    def _named_by(self, event) -> dict[str, RequestState]:
        """The live requests an event names (tokens or ends): what a failure outside the
        per-request work concerns, so that none of them is left waiting."""
        named: dict[str, RequestState] = {}
        for seq in event.seq_ids.tolist() + event.finished_seq_ids.tolist():
            entry = self.requests.seq(seq)
            if entry is not None:
                named[entry[0].request_id] = entry[0]
        return named

    def _deliver(self, state: RequestState, step_id: Optional[int]) -> None:
        """Hands the request its output; a failure here (its sink) fails that request only."""
        try:
            if state.kind != "final" or state.finished:
                state.sink.put(state.output())
            if state.finished:
                self.requests.forget_request(state)
        except Exception as e:  # noqa: BLE001 - the request gets the error
            logger.exception("delivering request %s's output failed in step %s", state.request_id, step_id)
            self._fail(state, EngineError(f"output processing failed: {e!r}"))

    def _fail_rows(self, row_errors: dict[int, str]) -> None:
        """Fails the requests whose own rows failed in the step (the rest of it is good)."""
        for seq, message in row_errors.items():
            entry = self.requests.seq(seq)
            if entry is not None:
                self._fail(entry[0], EngineError(f"the executor could not run this request: {message}"))

    def _mark_scheduled(self, result: StepResult) -> None:
        for seq in result.new_seq_ids.tolist():
            entry = self.requests.seq(seq)
            if entry is not None and entry[0].metrics.first_scheduled_time is None:
                entry[0].metrics.first_scheduled_time = result.started_at

    def _tokens(self, event, result: Optional[StepResult], touched: dict[str, RequestState]) -> None:
        seq_ids = event.seq_ids.tolist()
        tokens = event.token_ids.tolist()
        self.generated_tokens += len(tokens)
        logprobs = result.logprobs if result is not None else None
        # With drafts in the step a sequence may accept several tokens: each token's row of
        # the logprob arrays is its element of the step's `sampled` (`sample_indices`).
        sample_indices = event.sample_indices.tolist() if event.sample_indices.size else None
        index_of = result.logprob_rows() if result is not None and sample_indices is None else None
        # The sequences a token (EOS, stop_token_ids) ends in this step, and that token.
        stopped_by = dict(zip(event.finished_seq_ids.tolist(), event.stop_token_ids.tolist())) \
            if event.finished_seq_ids.size else {}
        # Only a sequence's last token of the step can be the one that ended it (an earlier
        # equal id came before min_tokens).
        last_of = {seq: k for k, seq in enumerate(seq_ids)} if sample_indices is not None and stopped_by else None
        for k, (seq, token) in enumerate(zip(seq_ids, tokens)):
            entry = self.requests.seq(seq)
            if entry is None:
                continue
            state, sample = entry
            if sample.finish_reason is not None or state.failed:
                continue  # ended here (stop string) before the scheduler heard of it
            touched[state.request_id] = state
            try:
                if sample_indices is not None:
                    row = sample_indices[k] if logprobs is not None else -1
                else:
                    row = index_of.get(seq, -1) if index_of is not None else -1
                stops = stopped_by.get(seq) == token and (last_of is None or last_of[seq] == k)
                stop = state.add_token(sample, token, logprobs if row >= 0 else None, row, stops=stops)
                if stop is not None:
                    state.finish_sample(sample, "stop", stop)
                    self.sched.finish(seq, "stop")
            except EngineDeadError:
                raise
            except Exception as e:  # noqa: BLE001 - this request gets the error, the others go on
                self._processing_failed(state, e, event.step_id)

    def _prompt_logprobs(self, plp, step_id: Optional[int]) -> None:
        """Files each sequence's prompt log-probabilities of the step with its request (by
        prompt position: chunks arrive step by step, a recomputed prompt again)."""
        for r, seq in enumerate(plp.seq_ids.tolist()):
            entry = self.requests.seq(seq)
            if entry is None or entry[0].failed or not entry[0].wants_prompt_logprobs:
                continue
            state = entry[0]
            try:
                state.add_prompt_logprobs(plp, r)
            except Exception as e:  # noqa: BLE001 - this request gets the error, the others go on
                self._processing_failed(state, e, step_id)

    def _finished(self, event, result: Optional[StepResult], touched: dict[str, RequestState]) -> None:
        if event.finished_seq_ids.size == 0:
            return
        reasons = event.finish_reasons.tolist()
        stop_tokens = event.stop_token_ids.tolist()
        cached = event.num_cached_tokens.tolist()
        preempted = event.num_preemptions.tolist()
        embeddings = result.embeddings() if result is not None else {}
        for k, seq in enumerate(event.finished_seq_ids.tolist()):
            entry = self.requests.seq(seq)
            if entry is None:
                continue
            state, sample = entry
            self.requests.forget_seq(seq)
            touched[state.request_id] = state
            if state.failed:
                continue
            try:
                self._finish_one(state, sample, seq, reasons[k], stop_tokens[k], cached[k], preempted[k],
                                 result, embeddings)
            except EngineDeadError:
                raise
            except Exception as e:  # noqa: BLE001 - this request gets the error, the others go on
                self._processing_failed(state, e, event.step_id)

    def _processing_failed(self, state: RequestState, error: Exception, step_id: Optional[int]) -> None:
        logger.exception("output processing failed for request %s in step %s", state.request_id, step_id,
                         exc_info=error)
        self._fail(state, EngineError(f"output processing failed: {error!r}"))

    def _finish_one(self, state: RequestState, sample, seq: int, reason: int, stop_token: int, cached: int,
                    preempted: int, result: Optional[StepResult], embeddings: dict[int, list[float]]) -> None:
        """Records one ended sequence: its counters, then its result or its failure."""
        if sample.index == 0:
            state.metrics.num_cached_tokens = cached
        state.metrics.num_preemptions += preempted
        if reason == _ERROR:
            cause = result.error if result is not None and result.error is not None else "unknown"
            self._fail(state, EngineError(f"the executor failed while running this request: {cause}"))
            return
        if isinstance(state.params, PoolingParams) and reason != _POOLED:
            self._fail(state, EngineError(f"the embedding request ended without a result: {FINISH_REASONS[reason]}"))
            return
        if reason == _POOLED:
            state.embedding = embeddings.get(seq)
            if state.embedding is None:
                self._fail(state, EngineError("the executor returned no embedding for this request"))
                return
        state.finish_sample(sample, FINISH_REASONS[reason], stop_token if stop_token >= 0 else None)

    def _fail(self, state: RequestState, error: BaseException) -> None:
        if state.failed:
            return
        state.failed = True
        if any(sample.finish_reason is None for sample in state.samples):
            try:
                self.sched.abort(state.request_id)
            except EngineDeadError:
                pass  # nothing left to abort
        self.requests.forget_request(state)
        state.sink.fail(error)

    def _fail_all(self, error: BaseException) -> None:
        for state in self.requests.requests():
            if not state.failed:
                state.failed = True
                self.requests.forget_request(state)
                state.sink.fail(error)

