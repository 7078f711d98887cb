"""The engine: loads an artifact, owns the KV pool, and runs requests with continuous batching.

Every step packs decode tokens of running requests and prefill chunks of others into one
call of the compiled ``step`` function; a request's tokens are contiguous in the step and
at consecutive positions (what the kernels and the CSR index builder rely on).

With ``speculative="mtp"`` a decoding request also feeds its pending drafts; the step's
logits verify them (``runtime.speculative``), the pool rows of rejected tokens are put back
(``KVPool.position_state``), and one batched call of the MTP layer per draft depth proposes
the next drafts from the streams of every request's accepted positions.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from dsv4c.artifact.directory import open_artifact
from dsv4c.artifact.file_names import PROGRAM, TOKENIZER
from dsv4c.artifact.manifest import Manifest
from dsv4c.artifact.pool import ENVELOPE_TOKENS, PoolGeometry, graph_context_limit
from dsv4c.errors import ArtifactError, UsageError
from dsv4c.runtime.backend import Backend
from dsv4c.runtime.kv_pool import KVPool, PoolExhausted
from dsv4c.runtime.prefix_cache import BLOCK_TOKENS, PrefixCache
from dsv4c.runtime.sampling import Sampler, SamplingParams, TokenLogprob, token_logprob
from dsv4c.runtime.speculative import METHODS, Draft, SpecStats, accept, propose
from dsv4c.runtime.weights import available_memory, check_weights_mode
from dsv4c.targets import target_info

TokenCallback = Callable[[int, int], None]  # (request id, token id)


@dataclass
class Request:
    rid: int
    prompt: list[int]
    params: SamplingParams
    on_token: TokenCallback | None = None
    record_logits: bool = False
    generated: list[int] = field(default_factory=list)
    fed: int = 0  # tokens of prompt + generated already run through the model
    logits: list[np.ndarray] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of generated tokens, when asked for
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=lambda: [None])  # the first has none
    done_sampling: bool = False
    finished: bool = False
    failure: Exception | None = None  # what ended it early (the engine and other requests go on)
    draft: Draft = field(default_factory=Draft)
    spec: SpecStats = field(default_factory=SpecStats)

    def __post_init__(self):
        self.sampler = Sampler(self.params)

    @property
    def decoding(self) -> bool:
        """All but the last token of the sequence are fed: the next step feeds one (and drafts)."""
        return self.fed == len(self.prompt) + len(self.generated) - 1

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def wants_every_row(self) -> bool:
        """Whether the next step returns the logits of every position it feeds this request, not
        only of the one that completes its sequence."""
        return (self.record_logits or bool(self.draft.tokens)
                or (self.params.prompt_logprobs is not None and self.fed < len(self.prompt)))


@dataclass
class Result:
    tokens: list[int]
    logits: np.ndarray | None  # [prompt_len + len(tokens), vocab] when recorded
    speculative: dict | None = None  # SpecStats.to_json() when the engine speculates
    logprobs: list[TokenLogprob] | None = None  # per generated token, when params.logprobs is set
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token, when params.prompt_logprobs is set


class RequestFailed(RuntimeError):
    """A request ended by an error of its own (its ``on_token`` callback raised, ...): the engine
    and its other requests went on."""


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
                 speculative: str | None = None, num_draft_tokens: int = 1, weights: str = "auto",
                 kv_cache_memory: int | None = None, prefix_caching: bool = True,
                 profile: bool = False, tensor_parallel: int | None = None,
                 distributed_timeout: float | None = None):
        """``verify`` hashes every artifact file against the manifest first (reads every byte);
        without it loading checks the manifest, file sizes and weight headers only.
        ``weights``: "map" the weight files, "read" them into memory, or "auto" (read on the CPU
        when they take at most half the available memory; see ``runtime.weights``); compiled
        artifacts only, the reference interpreter maps them.
        ``speculative="mtp"`` drafts ``num_draft_tokens`` tokens per decode step with the model's
        MTP layer (chained on its own output when more than one) and verifies them in the step.
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
        self.spec_stats = SpecStats()  # over every request this engine verified drafts for
        # Rejected drafts' pool rows are saved and put back by the backend's pool functions where
        # its pool lives on a device (the KVPool's arrays are then not the pool), else in those arrays.
        self.device_rows = self.backend.device_rows
        if speculative is not None:
            self._check_speculative(geometry)
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

    def _check_speculative(self, geometry: PoolGeometry) -> None:
        if self.speculative not in METHODS:
            raise UsageError(f"speculative must be one of {', '.join(METHODS)} (or None), got {self.speculative!r}")
        if not self.backend.has_mtp:
            why = ("has no MTP layer (num_nextn_predict_layers is 0)" if not self.config.mtp_layers else
                   f"is a {self.manifest.target} artifact")
            raise UsageError(f"{self.path} {why}; speculative decoding with mtp needs a compiled MTP layer "
                             "(compile a model with num_nextn_predict_layers >= 1)")
        if self.device_rows:
            if self.manifest.tensor_parallel > 1:
                raise UsageError("speculative decoding of a multi-rank artifact puts rejected drafts' pool rows back "
                                 "through the host's pool journal: it runs on llvm (CPU) artifacts for now")
            self.backend.check_pool_functions()
        # Positions of one verify step must own distinct window and ring rows (position_state).
        longest = min([geometry.window] + [s.rows for s in geometry.states])
        if not 1 <= self.num_draft_tokens < longest:
            raise UsageError(f"num_draft_tokens must be in [1, {longest - 1}] for this model (its smallest window "
                             f"or compressor ring holds {longest} positions), got {self.num_draft_tokens}")

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
                del r.draft.tokens[keep:], r.draft.probs[keep:]
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
            # At least one token is fed (its logits are sampled); with MTP, the whole window of
            # the prompt's end, which the MTP layer reads and a cached slot does not hold for it.
            keep = 1 + (self.config.sliding_window if self.speculative else 0)
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
        self.pool.free(r.rid)
        del self._admitted[r.rid]
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
            if r.draft.tokens:  # what each draft's position overwrites, to put back those rejected
                saved[r.rid] = [(p, self._save_rows(self.pool.position_state(r.rid, [p])))
                                for p in range(r.fed + 1, r.fed + n)]
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
        if self.speculative:
            self._draft([(r, fed_before[r.rid], n) for r, n in plan])
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
            self._verify(r, rows, saved)
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

    def _verify(self, r: Request, rows: np.ndarray, saved: list) -> None:
        """Accept drafts, take the tokens, and put back the pool rows of every position the step
        fed that is not part of the sequence now (rejected drafts; accepted ones past a stop)."""
        out, accepted = accept(r.sampler, rows, r.draft)
        stats = SpecStats(1, len(r.draft.tokens), accepted)
        r.spec.add(stats)
        self.spec_stats.add(stats)
        r.draft = Draft()
        for token, row in zip(out, rows):  # out[i] was drawn from rows[i]
            if r.done_sampling:
                break
            self._take(r, token, row)
        r.fed = len(r.sequence) - 1  # as after plain decoding: every token but the last is fed
        for position, state in saved:
            if position >= r.fed:
                self._restore_rows(state)
        if r.done_sampling:
            self._finish(r)

    def _save_rows(self, state: list):
        """A copy of the pool rows a ``KVPool.position_state`` names, for :meth:`_restore_rows`."""
        return self.backend.save_rows(state) if self.device_rows else self.pool.save(state)

    def _restore_rows(self, saved) -> None:
        if self.device_rows:
            self.backend.restore_rows(saved)
        else:
            self.pool.restore(saved)

    def _draft(self, plan: list[tuple[Request, int, int]]) -> None:
        """The MTP layer over the positions each request of the step fed and kept (those its
        window will read), from the step's streams; then drafts for the requests that decode
        next, chained on the MTP layer's own streams up to ``num_draft_tokens``: one batched
        call per draft depth."""
        tokens, positions, seqs, rows, last = [], [], [], [], {}
        step_row = 0
        for r, first, n in plan:
            if r.rid in self.requests and not r.finished:
                # MTP at position p reads the token of p + 1. Its first draft reads the window
                # of the prompt's last position: earlier prompt positions are never needed.
                start = max(first, len(r.prompt) - self.config.sliding_window)
                kept = range(start, r.fed)
                tokens += r.sequence[start + 1:r.fed + 1]
                positions += kept
                seqs += [r.rid] * len(kept)
                rows += range(step_row + start - first, step_row + r.fed - first)
                if r.decoding and len(kept) and self._drafts_wanted(r):
                    last[r.rid] = len(tokens) - 1
            step_row += n
        if not tokens:
            return
        drafting, stream_rows = [self.requests[rid] for rid in last], list(last.values())
        logits = self.backend.draft(np.array(tokens, np.int32), np.array(positions, np.int32),
                                    np.array(seqs, np.int32), np.array(rows, np.int32),
                                    np.array(stream_rows, np.int32))
        for depth in range(self.num_draft_tokens):
            for r, row in zip(drafting, logits):
                self._propose(r, row)
            # Chain: the MTP layer at the next position, from its own streams at the last one.
            stream_rows = [i if depth else stream_rows[i] for i, r in enumerate(drafting) if self._drafts_wanted(r)]
            drafting = [r for r in drafting if self._drafts_wanted(r)]
            if not drafting:
                return
            logits = self.backend.draft(
                np.array([r.draft.tokens[-1] for r in drafting], np.int32),
                np.array([r.fed + depth for r in drafting], np.int32), np.array([r.rid for r in drafting], np.int32),
                np.array(stream_rows, np.int32), np.arange(len(drafting), dtype=np.int32), chain=True)

    @staticmethod
    def _propose(r: Request, logits: np.ndarray) -> None:
        token, q = propose(r.sampler, logits)
        r.draft.tokens.append(token)
        if q is not None:
            r.draft.probs.append(q)

    def _drafts_wanted(self, r: Request) -> bool:
        """Whether a decoding request wants another draft: one fewer than the tokens it may still
        generate (the verify step adds one of its own), at most ``num_draft_tokens``."""
        return len(r.draft.tokens) < min(self.num_draft_tokens, r.params.max_new_tokens - len(r.generated) - 1)

    def _advance(self, r: Request, last_logits: np.ndarray) -> None:
        if not r.done_sampling:
            self._take(r, r.sampler(last_logits), last_logits)
            if r.done_sampling and not r.record_logits:
                self._finish(r)
            return
        # Logits were requested for the last generated token too: it has now been fed.
        self._finish(r)

    def _take(self, r: Request, token: int, logits: np.ndarray) -> None:
        r.generated.append(token)
        if r.params.logprobs is not None:
            r.logprobs.append(token_logprob(logits, token, r.params.logprobs))
        if r.on_token:
            r.on_token(r.rid, token)
        if len(r.generated) >= r.params.max_new_tokens or token in r.params.stop_token_ids:
            r.done_sampling = True

    def _finish(self, r: Request) -> None:
        r.finished = True
        self._leave_pool(r.rid)

    def _leave_pool(self, rid: int) -> None:
        if rid in self.pool.requests:
            self.pool.free(rid)
            del self._admitted[rid]

    def clear_prefix_cache(self) -> None:
        """Drop every cached block no request holds (their rows are free again)."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

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
