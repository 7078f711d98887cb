"""The engine: loads an artifact, owns the KV pool, and runs requests with continuous batching.

Every step packs decode tokens of running requests and prefill chunks of others into one
call of the compiled ``step`` function; a request's tokens are contiguous in the step and
at consecutive positions (what the kernels and the CSR index builder rely on).

With speculative decoding a decoding request also feeds its pending drafts, which a drafter
proposed after the step before (the MTP layer, or one's own); the step's logits verify them
and the pool rows of rejected tokens are put back (``runtime.speculative``).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np

from dsv4c.artifact.directory import open_artifact
from dsv4c.artifact.file_names import TOKENIZER
from dsv4c.artifact.manifest import Manifest
from dsv4c.errors import UsageError
from dsv4c.runtime.drafter import Drafter
from dsv4c.runtime.image_spans import ImageRows, check_spans, dead_spans, step_images
from dsv4c.runtime.kv_pool import KVPool
from dsv4c.runtime.loading import check_settings, check_step_tokens, load_backend, load_engram_hash, pool_rows
from dsv4c.runtime.prefix_cache import PrefixCache
from dsv4c.runtime.request import ImageSpan, Request, RequestFailed, Result, TokenCallback
from dsv4c.runtime.sampling import SamplingParams, token_logprob
from dsv4c.runtime.scheduler import Scheduler
from dsv4c.runtime.speculative import SpecStats, SpeculativeDecoding
from dsv4c.runtime.weights import check_engram_memory, check_weights_mode


class Engine:
    def __init__(self, artifact: str | Path, max_step_tokens: int = 512, prefill_chunk: int | None = None,
                 max_requests: int = 8, max_context: int = 4096, verify: bool = False,
                 speculative: str | Drafter | None = None, num_draft_tokens: int | None = None, weights: str = "auto",
                 kv_cache_memory: int | None = None, prefix_caching: bool = True,
                 profile: bool = False, tensor_parallel: int | None = None,
                 distributed_timeout: float | None = None, draft_confidence: float = 0.0,
                 engram_memory: str = "map"):
        """``verify`` hashes every artifact file against the manifest first (reads every byte);
        without it loading checks the manifest, file sizes and weight headers only.
        ``weights``: "map" the weight files, "read" them into memory, or "auto" (read on the CPU
        when they take at most half the available memory; see ``runtime.weights``); compiled
        artifacts only, the reference interpreter maps them.
        ``speculative="mtp"`` drafts ``num_draft_tokens`` tokens per decode step with the model's
        MTP layer (chained on its own output when more than one; default 1) and verifies them in
        the step; ``speculative="dspark"`` drafts them as one block with the model's DSpark drafter
        (at most its block size; default the block size, within the pool's ring limit) and, with
        ``draft_confidence`` T in (0, 1], stops a request's drafts at the first its confidence head
        rates below T; a :class:`~dsv4c.runtime.drafter.Drafter` of one's own drafts them instead
        (default 1).
        ``kv_cache_memory``: bytes of the KV pool that all requests share (rows are taken 256
        tokens at a time as requests grow; admission waits for free rows, and when decoding runs
        out of them the most recently admitted request is preempted and later recomputed). By
        default: room for ``max_requests`` requests of ``max_context`` tokens and as much again for
        cached prefixes, at most half the host's available memory when the pool lives there.
        ``prefix_caching``: requests share the pool rows of whole 256-token blocks their prompts
        start with (``runtime.prefix_cache``); CPU pools only for now.
        ``profile`` times every step's kernels by op family (``self.profiler``, ``runtime.profile``).
        An artifact compiled with ``--tensor-parallel N`` runs as N processes, one per rank, that
        this engine starts (or joins, under torchrun) and stops (:meth:`close`, or at exit);
        ``tensor_parallel``, when given, must be that N; ``distributed_timeout`` (seconds, default
        60) bounds a collective's wait for a rank.
        ``engram_memory``: "map" a V4.1 model's Engram table files (the default: a step reads the
        few rows its n-grams hash to) or "read" them into memory; no effect on other models."""
        check_weights_mode(weights)
        check_engram_memory(engram_memory)
        if draft_confidence and speculative != "dspark":
            raise UsageError("draft_confidence goes with speculative='dspark' (its confidence head rates the drafts)")
        self.path = Path(artifact)
        opened = open_artifact(self.path, verify=verify)
        manifest: Manifest = opened.manifest
        self.manifest = manifest
        # The model and the pool as the compiler recorded them (read, not re-derived).
        self.config, geometry = opened.config, opened.geometry
        check_settings(self.path, manifest, self.config, max_context, tensor_parallel, distributed_timeout)
        self.max_context = max_context
        self.pool = KVPool(geometry, pool_rows(manifest, geometry, max_context, max_requests, kv_cache_memory))
        check_step_tokens(self.path, manifest, max_step_tokens, prefill_chunk)
        self.engram = load_engram_hash(self.path, manifest, self.config)
        self.backend = load_backend(self.path, manifest, self.config, self.pool, weights, distributed_timeout,
                                    engram_memory)
        self.image_rows = ImageRows(self.backend.encode_image, self.config.hidden_size)
        self.profiler = None
        if profile:
            from dsv4c.runtime.profile import StepProfiler

            self.profiler = StepProfiler(self.backend, manifest, self.path)
        self.speculative = speculative
        self.speculation = None if speculative is None else SpeculativeDecoding(
            speculative, num_draft_tokens, self.backend, self.pool, self.config, self.path, manifest.target,
            manifest.tensor_parallel, draft_confidence)
        self.prefix_cache = PrefixCache(self.pool) if prefix_caching and self.backend.on_host else None
        self.requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self.scheduler = Scheduler(self.pool, self.requests, self.prefix_cache, max_step_tokens, prefill_chunk,
                                   max_requests, self.speculation.drafter if self.speculation is not None else None)
        self.tokenizer = None
        if (self.path / TOKENIZER).is_file():
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(str(self.path / TOKENIZER))

    # ------------------------------------------------------------------ requests
    def submit(self, prompt: list[int], params: SamplingParams, on_token: TokenCallback | None = None,
               record_logits: bool = False, images: list[ImageSpan] | None = None) -> int:
        """``images``: the prompt's image spans (a model that sees images; docs/vision_text.md):
        their positions hold the image token and take the rows of the image."""
        self.check(prompt, params, record_logits, images)
        rid = next(self._ids)
        r = self.requests[rid] = Request(rid, [int(t) for t in prompt], params, on_token, record_logits,
                                         images=check_spans(images, prompt, self.config))
        r.done_sampling = params.max_new_tokens == 0
        # With nothing to sample and no logits to return, there is nothing to run.
        r.finished = r.done_sampling and not record_logits and params.prompt_logprobs is None
        return rid

    def check(self, prompt: list[int], params: SamplingParams, record_logits: bool = False,
              images: list[ImageSpan] | None = None) -> None:
        """The ``UsageError`` ``submit`` would raise for this request, if any; reads no state that
        steps change, so a server can ask from another thread before it queues the request."""
        vocab = self.config.vocab_size
        if not prompt:
            raise UsageError("the prompt is empty; give at least one token")
        bad = [t for t in prompt if not 0 <= int(t) < vocab]
        if bad:
            raise UsageError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if params.logits_processor is not None and self.speculative:
            raise UsageError("constrained decoding is not available with speculative decoding (drafts are "
                             "verified without the request's token mask); run without speculative")
        if record_logits and self.speculative:
            raise UsageError("record_logits is not available with speculative decoding (rejected drafts have "
                             "logits that are not the sequence's); run without speculative")
        if len(prompt) + params.max_new_tokens > self.max_context:
            raise UsageError(f"prompt ({len(prompt)}) + max_new_tokens ({params.max_new_tokens}) exceeds the "
                             f"engine's max_context ({self.max_context})")
        if any(s.rows is None for s in check_spans(images, prompt, self.config)) and not self.backend.has_vision:
            raise UsageError("this artifact has no vision tower (encode_image) to encode the images with; compile "
                             "the model with its vision_config for a compiled target")

    def step(self) -> bool:
        plan = self.scheduler.plan()
        if not plan:
            return False
        plan = self._encode_images(plan)
        tokens, positions, seqs, logit_rows, saved, engram_rows = [], [], [], [], {}, []
        every_row = {r.rid: r.wants_every_row for r, _ in plan}
        images = step_images([(r, r.fed, n) for r, n in plan], self.image_rows, sum(n for _, n in plan))
        for r, n in plan:
            start = len(tokens)
            sequence = r.sequence + r.draft.tokens
            tokens += sequence[r.fed:r.fed + n]
            if self.engram is not None:  # hashed from the request's tokens: exact however it got here
                engram_rows.append(self.engram.request_rows(sequence, r.fed, r.fed + n, dead_spans(r)))
            positions += range(r.fed, r.fed + n)
            seqs += [r.rid] * n
            # Only the logits the engine uses come back: every row when recorded, verifying drafts
            # or scoring the prompt, else the last row of a request whose sequence this step completes.
            if every_row[r.rid]:
                logit_rows += range(start, start + n)
            elif r.fed + n == len(r.sequence):
                logit_rows.append(start + n - 1)
            if r.draft.tokens:
                saved[r.rid] = self.speculation.save(r, n)
        extra = {"engram_rows": np.concatenate(engram_rows).astype(np.int32)} if engram_rows else {}
        if images is not None:
            extra["images"] = images
        logits = self.backend.step(np.array(tokens, np.int32), np.array(positions, np.int32),
                                   np.array(seqs, np.int32), np.array(logit_rows, np.int32), **extra)
        offset, fed_before = 0, {r.rid: r.fed for r, _ in plan}
        for r, n in plan:
            got = n if every_row[r.rid] else int(r.fed + n == len(r.sequence))
            rows = logits[offset:offset + got]
            offset += got
            try:
                self._take_rows(r, n, rows, saved.get(r.rid))
            except Exception as e:  # this request's own failure (a callback, ...): it alone ends
                r.failure = e
                if not r.finished:
                    self._finish(r)
        if images is not None:
            self.image_rows.keep_only({s.digest for r in self.requests.values() for s in r.images if r.fed < s.end})
        if self.prefix_cache is not None:
            self.scheduler.cache_blocks(plan)
        if self.speculation is not None:
            self.speculation.propose([(r, fed_before[r.rid], n) for r, n in plan],
                                     lambda r: r.rid in self.requests and not r.finished)
        return True

    def _encode_images(self, plan: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
        """``plan`` without the requests whose image spans in the step could not be encoded (each
        fails alone, as a callback's error does); the others' rows are encoded from here on."""
        kept = []
        for r, n in plan:
            try:
                for s in r.images:
                    if s.start < r.fed + n and s.end > r.fed:
                        self.image_rows.of(s)
                kept.append((r, n))
            except Exception as e:  # the tower refused its pixels
                r.failure = e
                self._finish(r)
        return kept

    def _take_rows(self, r: Request, n: int, rows: np.ndarray, saved: list | None) -> None:
        """What the step computed for ``r``'s ``n`` fed positions: ``rows`` of logits."""
        if r.draft.tokens:
            self.speculation.verify(r, rows, saved)
            if r.done_sampling:
                self._finish(r)
            return
        if r.params.prompt_logprobs is not None and len(rows) == n:
            # The row at position p scores the prompt's token at p + 1.
            for p, row in zip(range(r.fed, r.fed + n), rows):
                if p + 1 < len(r.prompt):
                    r.prompt_logprobs.append(token_logprob(row, r.prompt[p + 1], r.params.prompt_logprobs))
        r.fed += n
        if r.record_logits:
            r.logits.extend(rows)
        if r.fed == len(r.sequence):
            self._advance(r, rows[-1])

    def _advance(self, r: Request, last_logits: np.ndarray) -> None:
        if not r.done_sampling:
            r.take(r.sampler(last_logits), last_logits)
            if r.done_sampling and not r.record_logits:
                self._finish(r)
            return
        # Logits were requested for the last generated token too: it has now been fed.
        self._finish(r)

    def _finish(self, r: Request) -> None:
        r.finished = True
        self.scheduler.leave(r.rid)

    def clear_prefix_cache(self) -> None:
        """Drop every cached block no request holds (their rows are free again)."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    @property
    def max_requests(self) -> int:
        return self.scheduler.max_requests

    @property
    def prefill_chunk(self) -> int | None:
        return self.scheduler.prefill_chunk

    @prefill_chunk.setter
    def prefill_chunk(self, tokens: int | None) -> None:
        self.scheduler.prefill_chunk = tokens

    @property
    def preemptions(self) -> int:
        """Requests this engine preempted (their rows were needed) to recompute later."""
        return self.scheduler.preemptions

    @property
    def spec_stats(self) -> SpecStats:
        """Over every request this engine verified drafts for."""
        return self.speculation.stats if self.speculation is not None else SpecStats()

    def run(self) -> None:
        while self.step():
            pass

    def close(self) -> None:
        """Stop the other ranks of a multi-rank artifact (they also stop when this process ends)."""
        self.backend.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _request(self, rid: int) -> Request:
        if rid not in self.requests:
            raise UsageError(f"no request {rid} in this engine (already collected, or never submitted)")
        return self.requests[rid]

    def result(self, rid: int) -> Result:
        """The request's output, once it is finished; raises :class:`RequestFailed` if it failed."""
        r = self._request(rid)
        del self.requests[rid]
        if r.failure is not None:
            raise RequestFailed(f"request {rid} failed: {r.failure!r}") from r.failure
        p = r.params
        return Result(r.generated, np.stack(r.logits).astype(np.float32) if r.record_logits else None,
                      r.spec.to_json() if self.speculative else None,
                      r.logprobs if p.logprobs is not None else None,
                      r.prompt_logprobs if p.prompt_logprobs is not None else None, r.cached_tokens or 0)

    def is_finished(self, rid: int) -> bool:
        """Whether the request is complete, so that ``result(rid)`` returns all of it."""
        return self._request(rid).finished

    def cancel(self, rid: int) -> None:
        """Stop a request wherever it is (waiting, prefilling, decoding) and forget it: its pool rows are
        freed at once, and the steps that follow no longer include it."""
        self._request(rid)
        del self.requests[rid]
        self.scheduler.leave(rid)

    def generate(self, prompt: list[int], params: SamplingParams, on_token: TokenCallback | None = None,
                 record_logits: bool = False, images: list[ImageSpan] | None = None) -> Result:
        rid = self.submit(prompt, params, on_token, record_logits, images)
        self.run()
        return self.result(rid)

    # ------------------------------------------------------------------ text
    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise UsageError(f"{self.path} has no tokenizer.json; pass token ids instead (--token-ids)")
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            raise UsageError(f"{self.path} has no tokenizer.json")
        return self.tokenizer.decode(ids)
