"""The engine: loads an artifact, owns the KV pool, and runs requests with continuous batching.

Every step packs decode tokens of running requests and prefill chunks of others into one
call of the compiled ``step`` function; a request's tokens are contiguous in the step and
at consecutive positions (what the kernels and the CSR index builder rely on).

With speculative decoding a decoding request also feeds its pending drafts, which a drafter
proposed after the step before (the MTP layer, or one's own); the step's logits verify them
and the pool rows of rejected tokens are put back (``runtime.speculative``).
"""

from __future__ import annotations

import contextlib
import itertools
import json
from pathlib import Path

import numpy as np

from dsv4c.artifact.directory import open_artifact
from dsv4c.artifact.file_names import PROGRAM, TOKENIZER
from dsv4c.artifact.manifest import Manifest
from dsv4c.artifact.pool import ENVELOPE_TOKENS, PoolGeometry, graph_context_limit
from dsv4c.errors import ArtifactError, UsageError
from dsv4c.runtime.backend import Backend
from dsv4c.runtime.kv_pool import KVPool, PoolExhausted
from dsv4c.runtime.prefix_cache import BLOCK_TOKENS, PrefixCache
from dsv4c.runtime.drafter import Draft, Drafter
from dsv4c.runtime.request import Request, RequestFailed, Result, TokenCallback
from dsv4c.runtime.sampling import SamplingParams, token_logprob
from dsv4c.runtime.speculative import SpecStats, SpeculativeDecoding
from dsv4c.runtime.weights import available_memory, check_weights_mode
from dsv4c.targets import target_info

def load_backend(artifact: Path, manifest: Manifest, config, pool: KVPool, weights_mode: str = "auto",
                 distributed_timeout: float | None = None) -> Backend:
    info = target_info(manifest.target)
    if not info.compiled:
        from dsv4c.ir.serialize import program_from_json
        from dsv4c.runtime.backend_reference import ReferenceBackend

        program = program_from_json(json.loads((artifact / PROGRAM).read_text()), config)
        return ReferenceBackend(artifact, manifest, program, pool)
    from dsv4c.runtime.backend_tvm import TvmBackend
    from dsv4c.runtime.tvm_runtime import device as tvm_device

    device = tvm_device(info)
    if device is None:
        raise ArtifactError(f"{artifact}: an artifact for {info.name} needs that GPU and this host has none; run it "
                            "there, or compile with --target llvm for this CPU")
    if manifest.tensor_parallel > 1:
        from dsv4c.runtime.tensor_parallel import DEFAULT_TIMEOUT_S, TensorParallelBackend

        return TensorParallelBackend(artifact, manifest, pool, device, weights_mode,
                                     DEFAULT_TIMEOUT_S if distributed_timeout is None else distributed_timeout)
    return TvmBackend(artifact, manifest, pool, device, weights_mode)


class Engine:
    def __init__(self, artifact: str | Path, max_step_tokens: int = 512, prefill_chunk: int | None = None,
                 max_requests: int = 8, max_context: int = 4096, verify: bool = False,
                 speculative: str | Drafter | None = None, num_draft_tokens: int = 1, weights: str = "auto",
                 kv_cache_memory: int | None = None, prefix_caching: bool = True,
                 profile: bool = False, tensor_parallel: int | None = None,
                 distributed_timeout: float | None = None):
        """``verify`` hashes every artifact file against the manifest first (reads every byte);
        without it loading checks the manifest, file sizes and weight headers only.
        ``weights``: "map" the weight files, "read" them into memory, or "auto" (read on the CPU
        when they take at most half the available memory; see ``runtime.weights``); compiled
        artifacts only, the reference interpreter maps them.
        ``speculative="mtp"`` drafts ``num_draft_tokens`` tokens per decode step with the model's
        MTP layer (chained on its own output when more than one) and verifies them in the step;
        a :class:`~dsv4c.runtime.drafter.Drafter` of one's own drafts them instead.
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
        60) bounds a collective's wait for a rank."""
        check_weights_mode(weights)
        self.path = Path(artifact)
        opened = open_artifact(self.path, verify=verify)
        manifest = self.manifest = opened.manifest
        # The model and the pool as the compiler recorded them (read, not re-derived).
        self.config, geometry = opened.config, opened.geometry
        ranks = manifest.tensor_parallel
        if tensor_parallel is not None and tensor_parallel != ranks:
            raise UsageError(f"--tensor-parallel {tensor_parallel}: {self.path} is compiled for {ranks} rank(s); "
                             f"run it with --tensor-parallel {ranks}, or compile it again with --tensor-parallel "
                             f"{tensor_parallel}")
        if distributed_timeout is not None and not distributed_timeout > 0:
            raise UsageError(f"--distributed-timeout must be positive, got {distributed_timeout}")
        if manifest.vm is not None and manifest.vm.cuda_graph and max_context > graph_context_limit(self.config):
            raise UsageError(f"max_context {max_context} exceeds the {graph_context_limit(self.config)} "
                             f"positions {self.path}'s CUDA graphs are built for (the model's max_position_embeddings, "
                             "rounded up to a power of two); lower it")
        self.max_context = max_context
        self.pool = KVPool(geometry, self._pool_rows(geometry, max_requests, kv_cache_memory))
        if max_step_tokens < 1 or (prefill_chunk is not None and prefill_chunk < 1):
            raise UsageError("max_step_tokens and prefill_chunk must be positive")
        limit = manifest.vm.max_step_tokens if manifest.vm else None
        if limit is not None and max_step_tokens > limit:
            raise UsageError(f"max_step_tokens {max_step_tokens} exceeds what {self.path} was compiled for ({limit}); "
                             "lower it")
        self.backend = load_backend(self.path, manifest, self.config, self.pool, weights, distributed_timeout)
        self.profiler = None
        if profile:
            from dsv4c.runtime.profile import StepProfiler

            self.profiler = StepProfiler(self.backend, manifest, self.path)
        self.max_step_tokens, self.prefill_chunk, self.max_requests = max_step_tokens, prefill_chunk, max_requests
        self.speculative, self.num_draft_tokens = speculative, num_draft_tokens
        self.speculation = None if speculative is None else SpeculativeDecoding(
            speculative, num_draft_tokens, self.backend, self.pool, self.config, self.path, manifest.target,
            manifest.tensor_parallel)
        self.prefix_cache = PrefixCache(self.pool) if prefix_caching and self.backend.on_host else None
        self.preemptions = 0
        self.requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self._admitted: dict[int, int] = {}  # request in the pool -> admission number (preempt the newest first)
        self._admissions = itertools.count()
        self._preempted_now: set[int] = set()
        self.tokenizer = None
        if (self.path / TOKENIZER).is_file():
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(str(self.path / TOKENIZER))

    def _pool_rows(self, g: PoolGeometry, max_requests: int, kv_cache_memory: int | None) -> int:
        one = -(-self.max_context // ENVELOPE_TOKENS) * g.rows_per_envelope + g.window_rows_per_request
        if kv_cache_memory is None:
            rows = 2 * max_requests * one
            # Ranks this engine starts share the host: each holds a whole pool (runtime.tensor_parallel).
            host = available_memory() // self.manifest.tensor_parallel
            if target_info(self.manifest.target).kind in ("reference", "cpu") and host:  # 0: not reported
                rows = max(min(rows, KVPool.rows_for_bytes(g, host // 2)), one)
        else:
            rows = KVPool.rows_for_bytes(g, kv_cache_memory)
            if rows < one:
                raise UsageError(f"kv_cache_memory {kv_cache_memory} B holds {rows} pool rows, fewer than one request "
                                 f"of max_context {self.max_context} needs ({one} rows, "
                                 f"{KVPool.nbytes_for(g, one)} B); give it more or lower max_context")
        return rows

    # ------------------------------------------------------------------ requests
    def submit(self, prompt: list[int], params: SamplingParams, on_token: TokenCallback | None = None,
               record_logits: bool = False) -> int:
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
        rid = next(self._ids)
        r = self.requests[rid] = Request(rid, [int(t) for t in prompt], params, on_token, record_logits)
        r.done_sampling = params.max_new_tokens == 0
        # With nothing to sample and no logits to return, there is nothing to run.
        r.finished = r.done_sampling and not record_logits and params.prompt_logprobs is None
        return rid

    def _schedule(self) -> list[tuple[Request, int]]:
        """(request, number of tokens to feed) for the next step: decodes first, then prefill."""
        budget, plan = self.max_step_tokens, []
        live = [r for r in self.requests.values() if not r.finished]
        live.sort(key=lambda r: (r.fed < len(r.prompt), r.rid))  # running decodes before prefills
        for r in live:
            if len(r.sequence) == r.fed or budget == 0 or r.rid in self._preempted_now:
                continue
            if r.rid not in self.pool.requests and (len(self.pool.requests) >= self.max_requests
                                                    or not self._admit(r)):
                continue  # it waits for a place, or for rows
            # With the prefix cache, a step ends at the next block boundary, whose state it keeps.
            boundary = (r.fed // BLOCK_TOKENS + 1) * BLOCK_TOKENS if self.prefix_cache else len(r.sequence) + 1
            if r.decoding:  # its last token, and the drafts the budget leaves room for
                keep = min(budget, boundary - r.fed) - 1
                r.draft.truncate(keep)
                n = 1 + len(r.draft.tokens)
            else:
                pending = len(r.sequence) - r.fed
                n = min(pending, budget, self.prefill_chunk or pending, boundary - r.fed)
            if not self._grow(r, r.fed + n, plan):
                continue
            plan.append((r, n))
            budget = self.max_step_tokens - sum(k for _, k in plan)
        self._preempted_now.clear()
        return plan

    def _admit(self, r: Request) -> bool:
        """Take pool rows for ``r``'s whole sequence, its cached prefix shared; False when they are
        not free (it waits)."""
        hit = []
        looked_up = self.prefix_cache is not None and not r.wants_every_row
        if looked_up:
            # At least one token is fed (its logits are sampled), and the prompt's end that the
            # drafter reads from the step (a cached slot does not hold the step's output for it).
            keep = 1 + (self.speculation.drafter.prompt_tail if self.speculation else 0)
            hit = self.prefix_cache.lookup(r.sequence, max(len(r.sequence) - keep, 0) // BLOCK_TOKENS)
        shared = [b.envelope for b in hit if b.envelope is not None]
        try:
            with self.prefix_cache.pinned(hit) if hit else contextlib.nullcontext():
                rows = self.pool.admit(r.rid, reserve_tokens=len(r.sequence), shared=shared)
        except PoolExhausted:
            return False
        if hit:
            self.pool.copy_slot(hit[-1].slot, rows.slot, at_block_boundary=True)
            r.fed = len(hit) * BLOCK_TOKENS
        if looked_up:
            self.prefix_cache.count(len(r.sequence), len(hit) * BLOCK_TOKENS)
        self._admitted[r.rid] = next(self._admissions)
        return True

    def _grow(self, r: Request, tokens: int, plan: list[tuple[Request, int]]) -> bool:
        """Envelopes for ``r``'s positions below ``tokens``; when the pool has none left, the most
        recently admitted request is preempted (taken out of ``plan`` if it was in it). False when
        that is ``r`` itself."""
        while True:
            try:
                self.pool.ensure(r.rid, tokens)
                return True
            except PoolExhausted:
                victim = self.requests[max(self._admitted, key=self._admitted.get)]
                if victim is r and len(self._admitted) == 1:
                    raise  # cannot happen: the pool holds one request of max_context (_pool_rows)
                self._preempt(victim)
                plan[:] = [(q, n) for q, n in plan if q is not victim]
                if victim is r:
                    return False

    def _preempt(self, r: Request) -> None:
        """Give back ``r``'s rows; it is admitted again later and recomputes its sequence (what of
        it the prefix cache still holds, it shares)."""
        self._leave_pool(r.rid)
        self._preempted_now.add(r.rid)  # not admitted again in the step that preempted it
        self.preemptions += 1
        r.fed, r.draft = 0, Draft()
        r.logits.clear()  # every row is computed again
        del r.prompt_logprobs[1:]

    def step(self) -> bool:
        plan = self._schedule()
        if not plan:
            return False
        tokens, positions, seqs, logit_rows, saved = [], [], [], [], {}
        every_row = {r.rid: r.wants_every_row for r, _ in plan}
        for r, n in plan:
            start = len(tokens)
            tokens += (r.sequence + r.draft.tokens)[r.fed:r.fed + n]
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
        logits = self.backend.step(np.array(tokens, np.int32), np.array(positions, np.int32),
                                   np.array(seqs, np.int32), np.array(logit_rows, np.int32))
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
        if self.prefix_cache is not None:
            self._cache_blocks(plan)
        if self.speculation is not None:
            self.speculation.propose([(r, fed_before[r.rid], n) for r, n in plan],
                                     lambda r: r.rid in self.requests and not r.finished)
        return True

    def _cache_blocks(self, plan: list[tuple[Request, int]]) -> None:
        """Cache the block each request of the step has just fed to its end (steps end at block
        boundaries): its envelope, and its slot as it is now."""
        for r, _ in plan:
            if r.rid in self.pool.requests and r.fed and r.fed % BLOCK_TOKENS == 0 and not r.draft.tokens:
                rows = self.pool.requests[r.rid]
                index = r.fed // BLOCK_TOKENS - 1
                envelope = rows.blocks[index] if rows.blocks else None
                self.prefix_cache.insert(r.sequence, index, envelope, rows.slot)

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
        self._leave_pool(r.rid)

    def _leave_pool(self, rid: int) -> None:
        if rid in self.pool.requests:
            self.pool.free(rid)
            del self._admitted[rid]
            if self.speculation is not None:
                self.speculation.drafter.release(rid)

    def clear_prefix_cache(self) -> None:
        """Drop every cached block no request holds (their rows are free again)."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

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
                      r.prompt_logprobs if p.prompt_logprobs is not None else None)

    def is_finished(self, rid: int) -> bool:
        """Whether the request is complete, so that ``result(rid)`` returns all of it."""
        return self._request(rid).finished

    def cancel(self, rid: int) -> None:
        """Stop a request wherever it is (waiting, prefilling, decoding) and forget it: its pool rows are
        freed at once, and the steps that follow no longer include it."""
        self._request(rid)
        del self.requests[rid]
        self._leave_pool(rid)

    def generate(self, prompt: list[int], params: SamplingParams, on_token: TokenCallback | None = None,
                 record_logits: bool = False) -> Result:
        rid = self.submit(prompt, params, on_token, record_logits)
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
