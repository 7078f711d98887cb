"""One thread owns the engine and runs continuous batching for every HTTP request.

HTTP handlers run on the asyncio event loop and never touch the engine: they post submissions
and cancellations to the engine thread's inbox, which it takes between steps (so requests join
and leave the batch between steps), and it hands back each step's new tokens in one callback on
the event loop. When the pool already holds ``max_requests`` requests, submitted ones wait inside
the engine, in arrival order; beyond ``max_waiting`` of them the server answers 503.
"""

from __future__ import annotations

import asyncio
import collections
import sys
import threading
import time
import traceback
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dsv4c.errors import UsageError
from dsv4c.runtime.engine import Engine, RequestFailed
from dsv4c.runtime.kv_pool import KVPool
from dsv4c.runtime.request import ImageSpan
from dsv4c.runtime.sampling import SamplingParams, TokenLogprob


def pool_usage_ratio(pool: KVPool) -> float:
    """Rows held by requests (their envelopes, shared ones once, and window slots) over the pool's rows."""
    g = pool.geometry
    envelopes = {b for r in pool.requests.values() for b in r.blocks}
    return (len(envelopes) * g.rows_per_envelope + len(pool.requests) * g.window_rows_per_request) / pool.total_rows


class ServerMetrics:
    """The Prometheus metrics of one server (names are a contract with dashboards), in their own registry."""

    def __init__(self, draft_tokens: int = 0):
        """``draft_tokens``: the most drafts a verify step carries (speculative decoding; 0 without)."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("dsv4c_requests_running", "Requests holding pool rows (prefilling or decoding)",
                             registry=r)
        self.waiting = Gauge("dsv4c_requests_waiting", "Requests accepted and waiting for room in the pool",
                             registry=r)
        self.pool_usage = Gauge(
            "dsv4c_kv_pool_usage_ratio", "KV pool rows held by running requests / all pool rows (cached prefix blocks "
            "that no running request shares are not counted: they are given up when rows run out; see "
            "dsv4c_kv_pool_cached_ratio)", registry=r)
        self.pool_cached = Gauge("dsv4c_kv_pool_cached_ratio", "KV pool rows held only by the prefix cache / all "
                                 "pool rows", registry=r)
        self.prefix_queries = Counter("dsv4c_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("dsv4c_prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=r)
        self.preemptions = Counter("dsv4c_preemptions", "Requests preempted (rows given back, recomputed later) "
                                   "because the KV pool ran out of rows", registry=r)
        self.prompt_tokens = Counter("dsv4c_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter("dsv4c_generation_tokens", "Generated tokens", registry=r)
        self.time_to_first_token = Histogram(
            "dsv4c_time_to_first_token_seconds", "From a request's arrival to its first generated token",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.inter_token_latency = Histogram(
            "dsv4c_inter_token_latency_seconds", "Between consecutive generated tokens of a request",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5), registry=r)
        self.engine_up = Gauge("dsv4c_engine_up", "1 while the engine thread runs; 0 once it has failed or stopped",
                               registry=r)
        self.requests = Counter("dsv4c_http_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.draft_tokens = Counter("dsv4c_spec_draft_tokens", "Draft tokens verified (speculative decoding)",
                                    registry=r)
        self.accepted_tokens = Counter("dsv4c_spec_accepted_tokens", "Draft tokens accepted (speculative decoding)",
                                       registry=r)
        self.accepted_length = Histogram(
            "dsv4c_spec_accepted_length", "Drafts a verify step accepted, of those it carried (speculative decoding)",
            buckets=tuple(range(draft_tokens + 1)), registry=r)
        self.finished = Counter("dsv4c_choices_finished", "Choices generated to their end, by finish reason "
                                "(stop: EOS or a stop string; length: max_tokens or the context)",
                                ["finish_reason"], registry=r)
        self.unfinished = Counter("dsv4c_choices_unfinished", "Choices that ended without a finish reason (client "
                                  "gone, request failed, server shutting down)", registry=r)
        self.weights_verified = Gauge("dsv4c_weights_verified", "1 once every artifact file matched its sha256 "
                                      "(serve --verify, or the background check); 0 before and after a mismatch",
                                      registry=r)


class QueueFull(Exception):
    """Every running and waiting place is taken."""


class EngineStopped(Exception):
    """The engine thread is not running (stopped, or failed: see its ``failure``)."""


@dataclass
class Update:
    tokens: list[int]  # new since the last update
    done: bool  # no more tokens will come
    failure: BaseException | None = None  # the request failed (or the engine did); it is over
    logprobs: list[TokenLogprob] | None = None  # of ``tokens``, when the request asked for them
    prompt_logprobs: list[TokenLogprob | None] | None = None  # once, in the first update, when asked for
    cached_tokens: int = 0  # prompt tokens its admission found in the prefix cache


class Generation:
    """One request, shared by its HTTP handler (event loop) and the engine thread."""

    def __init__(self, prompt: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop,
                 images: tuple[ImageSpan, ...] = ()):
        self.prompt, self.params, self.images = prompt, params, images
        self.arrival = time.perf_counter()
        self.submitted = loop.create_future()  # None once in the engine, or the UsageError that refused it
        self.updates: asyncio.Queue[Update] = asyncio.Queue()
        self.done = False  # the last update was delivered (event loop)
        self.closed = False  # the handler let go of it (event loop)
        self.rid: int | None = None  # engine thread
        self.last_token_at: float | None = None  # engine thread
        self.prompt_scored = params.prompt_logprobs is None  # its prompt_logprobs went out (engine thread)


class EngineLoop:
    """``on_failure`` is called (on the event loop) if the engine thread dies of an error: the
    server then has no engine, and stops so that a supervisor restarts it."""

    def __init__(self, engine: Engine, metrics: ServerMetrics, max_waiting: int, on_failure=lambda: None):
        self.engine, self.metrics = engine, metrics
        self.capacity = engine.max_requests + max_waiting
        self.open_count = 0  # generations opened and not closed (event loop)
        self.failure: BaseException | None = None
        self.on_failure = on_failure
        self._inbox: collections.deque[tuple[str, Generation]] = collections.deque()
        self._wake = threading.Event()
        self._stopping = False
        self._live: dict[int, Generation] = {}  # by engine request id (engine thread)
        self._fresh: dict[Generation, Update] = {}  # what the current step produced (engine thread)
        self._published: dict = {}  # engine totals the counters have counted (engine thread)
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="dsv4c-engine", daemon=True)

    # ------------------------------------------------------------------ event loop side
    def start(self, event_loop: asyncio.AbstractEventLoop) -> None:
        self._event_loop = event_loop
        self._thread.start()
        self.metrics.engine_up.set(1)

    def abort(self) -> None:
        """Have the engine thread end every request (each gets ``EngineStopped``) and stop, at its
        next step; returns at once."""
        self._stopping = True
        self._wake.set()

    def stop(self) -> None:
        """Cancel what is left and end the thread (blocks until it has)."""
        self.abort()
        self._thread.join()
        self._fail_all(EngineStopped("the server shut down before this request finished"))  # posted since

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def open(self, prompt: list[int], params: SamplingParams, images: tuple[ImageSpan, ...] = ()) -> Generation:
        if not self.alive:
            raise EngineStopped(f"the engine is not running ({self.failure!r})" if self.failure
                                else "the server is shutting down")
        if self.open_count >= self.capacity:
            raise QueueFull(f"{self.open_count} requests are running or waiting, the most this server queues")
        gen = Generation(prompt, params, self._event_loop, images)
        self.open_count += 1
        self._post("submit", gen)
        return gen

    def close(self, gen: Generation) -> None:
        """The handler is done with ``gen`` (finished, failed or its client left); cancels it if it still runs."""
        if gen.closed:
            return
        gen.closed = True
        self.open_count -= 1
        # Its handler awaits ``submitted`` no more: a refusal that comes (or came) there is read
        # here, so that asyncio does not log it as a "Future exception was never retrieved".
        gen.submitted.add_done_callback(lambda f: f.cancelled() or f.exception())
        if not gen.done:
            self._post("cancel", gen)

    def _post(self, what: str, gen: Generation) -> None:
        self._inbox.append((what, gen))
        self._wake.set()

    def _deliver(self, batch: list[tuple[Generation, Update]]) -> None:
        for gen, update in batch:
            gen.done = update.done
            gen.updates.put_nowait(update)

    @staticmethod
    def _resolve(future: asyncio.Future, error: Exception | None) -> None:
        if future.done():  # its handler was cancelled while waiting
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while True:
                # Cleared before the inbox is read: a post after this line sets it again, so none is missed.
                self._wake.clear()
                self._take_inbox()
                if self._stopping:
                    break
                stepped = self.engine.step() if self._live else False
                self._publish()
                if not stepped:
                    self._wake.wait()
        except BaseException as e:  # a bug, not a bad request: those are refused before they reach a step
            self.failure = e
            self.metrics.engine_up.set(0)
            print(f"dsv4c serve: the engine failed: {e!r}; stopping the server", file=sys.stderr, flush=True)
            traceback.print_exc(file=sys.stderr)
            self._fail_all(e)
            self._event_loop.call_soon_threadsafe(self.on_failure)
            return
        self.metrics.engine_up.set(0)
        for rid in self._live:
            self.engine.cancel(rid)
        self._fail_all(EngineStopped("the server shut down before this request finished"))

    def _take_inbox(self) -> None:
        while self._inbox:
            what, gen = self._inbox.popleft()
            if what == "cancel":
                if gen.rid in self._live:
                    self.engine.cancel(gen.rid)
                    del self._live[gen.rid]
                    self._fresh.pop(gen, None)
            elif not gen.closed:
                try:
                    gen.rid = self.engine.submit(gen.prompt, gen.params, on_token=self._on_token, images=gen.images)
                except UsageError as e:
                    self._event_loop.call_soon_threadsafe(self._resolve, gen.submitted, e)
                    continue
                self._live[gen.rid] = gen
                self.metrics.prompt_tokens.inc(len(gen.prompt))
                self._event_loop.call_soon_threadsafe(self._resolve, gen.submitted, None)

    def _update(self, gen: Generation) -> Update:
        """This step's update of ``gen``, with the prompt's log-probabilities if they have not gone out."""
        if gen not in self._fresh:
            self._fresh[gen] = Update([], done=False, logprobs=[] if gen.params.logprobs is not None else None,
                                      cached_tokens=self.engine.requests[gen.rid].cached_tokens or 0)
            if not gen.prompt_scored:
                self._fresh[gen].prompt_logprobs = self.engine.requests[gen.rid].prompt_logprobs
                gen.prompt_scored = True
        return self._fresh[gen]

    def _on_token(self, rid: int, token: int) -> None:
        gen, now = self._live[rid], time.perf_counter()
        if gen.last_token_at is None:
            self.metrics.time_to_first_token.observe(now - gen.arrival)
        else:
            self.metrics.inter_token_latency.observe(now - gen.last_token_at)
        gen.last_token_at = now
        self.metrics.generation_tokens.inc()
        update = self._update(gen)
        update.tokens.append(token)
        if update.logprobs is not None:
            update.logprobs.append(self.engine.requests[rid].logprobs[-1])

    def _publish(self) -> None:
        """Hand this step's tokens and finished requests to the event loop, in one callback."""
        for rid in [rid for rid in self._live if self.engine.is_finished(rid)]:
            gen = self._live[rid]
            update = self._update(gen)
            update.done = True
            del self._live[rid]
            try:
                self.engine.result(rid)  # the tokens went out through on_token; this forgets the request
            except RequestFailed as e:
                update.failure = e
        updates, self._fresh = list(self._fresh.items()), {}
        if updates:
            self._event_loop.call_soon_threadsafe(self._deliver, updates)
        self._publish_engine()

    def _publish_engine(self) -> None:
        """The gauges and counters of the engine's state after a step: its pool, prefix cache,
        preemptions and speculative decoding."""
        engine, m = self.engine, self.metrics
        pool, cache = engine.pool, engine.prefix_cache
        m.running.set(len(pool.requests))
        m.waiting.set(len(self._live) - len(pool.requests))
        m.pool_usage.set(pool_usage_ratio(pool))
        # The counters follow the engine's totals.
        spec = engine.spec_stats
        totals = {m.preemptions: engine.preemptions, m.draft_tokens: spec.drafted, m.accepted_tokens: spec.accepted}
        if cache is not None:
            m.pool_cached.set(cache.cached_rows / pool.total_rows)
            totals |= {m.prefix_queries: cache.queried_tokens, m.prefix_hits: cache.hit_tokens}
        for counter, total in totals.items():
            if total > self._published.get(counter, 0):
                counter.inc(total - self._published.get(counter, 0))
                self._published[counter] = total
        # The histogram observes each verify step the engine counted since the last step.
        for accepted, steps in enumerate(spec.accepted_lengths):
            for _ in range(steps - self._published.get(("accepted_length", accepted), 0)):
                m.accepted_length.observe(accepted)
            self._published[("accepted_length", accepted)] = steps

    def _fail_all(self, error: BaseException) -> None:
        """End every request still here with ``error``: running ones through their updates, those not
        yet submitted through their ``submitted`` future."""
        for gen in self._live.values():
            self._event_loop.call_soon_threadsafe(self._deliver, [(gen, Update([], done=True, failure=error))])
        self._live.clear()
        while self._inbox:
            what, gen = self._inbox.popleft()
            if what == "submit":
                self._event_loop.call_soon_threadsafe(self._resolve, gen.submitted, EngineStopped(str(error)))
        self.metrics.running.set(0)
        self.metrics.waiting.set(0)
