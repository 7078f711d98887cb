"""The engine: loads an artifact, owns the KV pool, and runs requests with continuous batching.

Every step packs decode tokens of running requests and prefill chunks of others into one
call of the compiled ``step`` function; a request's tokens are contiguous in the step and
at consecutive positions (what the kernels and the CSR index builder rely on).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from dsv4c.errors import UsageError
from dsv4c.frontend.config import config_from_dict
from dsv4c.runtime.artifact import ArtifactError, read_manifest
from dsv4c.runtime.kv_pool import ENVELOPE_TOKENS, KVPool, PoolGeometry
from dsv4c.runtime.sampling import Sampler, SamplingParams
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
    done_sampling: bool = False
    finished: bool = False

    def __post_init__(self):
        self.sampler = Sampler(self.params)

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.generated


@dataclass
class Result:
    tokens: list[int]
    logits: np.ndarray | None  # [prompt_len + len(tokens), vocab] when recorded


def load_backend(artifact: Path, manifest: dict, config, pool: KVPool):
    info = target_info(manifest["target"])
    if not info.compiled:
        from dsv4c.ir.serialize import program_from_json
        from dsv4c.runtime.backend_reference import ReferenceBackend

        program = program_from_json(json.loads((artifact / "program.json").read_text()), config)
        return ReferenceBackend(artifact, manifest, program, pool)
    from dsv4c.runtime.backend_tvm import TvmBackend

    device = info.device()
    if device is None:
        raise ArtifactError(f"{artifact}: an artifact for {info.name} needs that GPU and this host has none; run it "
                            "there, or compile with --target llvm for this CPU")
    return TvmBackend(artifact, manifest, pool, device)


class Engine:
    def __init__(self, artifact: str | Path, max_step_tokens: int = 512, prefill_chunk: int | None = None,
                 max_requests: int = 8, max_context: int = 4096, verify: bool = False):
        """``verify`` hashes every artifact file against the manifest first (reads every byte);
        without it loading checks the manifest, file sizes and weight headers only."""
        self.path = Path(artifact)
        manifest = read_manifest(self.path, verify=verify)
        self.manifest = manifest
        self.config = config_from_dict(manifest["model"], manifest["model_name"])
        geometry = PoolGeometry.from_manifest(self.config, manifest)
        envelopes = max_requests * -(-max_context // ENVELOPE_TOKENS)
        self.pool = KVPool(geometry, envelopes * geometry.rows_per_envelope
                           + max_requests * geometry.window_rows_per_request)
        self.max_context = max_context
        if max_step_tokens < 1 or (prefill_chunk is not None and prefill_chunk < 1):
            raise UsageError("max_step_tokens and prefill_chunk must be positive")
        limit = manifest.get("vm", {}).get("max_step_tokens")
        if limit is not None and max_step_tokens > limit:
            raise UsageError(f"max_step_tokens {max_step_tokens} exceeds what {self.path} was compiled for ({limit}); "
                             "lower it")
        self.backend = load_backend(self.path, manifest, self.config, self.pool)
        self.max_step_tokens, self.prefill_chunk, self.max_requests = max_step_tokens, prefill_chunk, max_requests
        self.requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self.tokenizer = None
        if (self.path / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(str(self.path / "tokenizer.json"))

    # ------------------------------------------------------------------ requests
    def submit(self, prompt: list[int], params: SamplingParams, on_token: TokenCallback | None = None,
               record_logits: bool = False) -> int:
        vocab = self.config.vocab_size
        if not prompt:
            raise UsageError("the prompt is empty; give at least one token")
        bad = [t for t in prompt if not 0 <= int(t) < vocab]
        if bad:
            raise UsageError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(prompt) + params.max_new_tokens > self.max_context:
            raise UsageError(f"prompt ({len(prompt)}) + max_new_tokens ({params.max_new_tokens}) exceeds the "
                             f"engine's max_context ({self.max_context})")
        rid = next(self._ids)
        self.requests[rid] = Request(rid, [int(t) for t in prompt], params, on_token, record_logits)
        if params.max_new_tokens == 0 and not record_logits:
            self.requests[rid].done_sampling = self.requests[rid].finished = True
        return rid

    def _schedule(self) -> list[tuple[Request, int]]:
        """(request, number of tokens to feed) for the next step: decodes first, then prefill."""
        budget, plan = self.max_step_tokens, []
        live = [r for r in self.requests.values() if not r.finished]
        live.sort(key=lambda r: (r.fed < len(r.prompt), r.rid))  # running decodes before prefills
        for r in live:
            pending = len(r.sequence) - r.fed
            if pending == 0 or budget == 0:
                continue
            if r.rid not in self.pool.requests:
                if len(self.pool.requests) >= self.max_requests:
                    continue
                self.pool.admit(r.rid, reserve_tokens=len(r.prompt))
            n = min(pending, budget, self.prefill_chunk or pending)
            plan.append((r, n))
            budget -= n
        return plan

    def step(self) -> bool:
        plan = self._schedule()
        if not plan:
            return False
        tokens, positions, seqs, logit_rows = [], [], [], []
        for r, n in plan:
            self.pool.ensure(r.rid, r.fed + n)
            start = len(tokens)
            tokens += r.sequence[r.fed:r.fed + n]
            positions += range(r.fed, r.fed + n)
            seqs += [r.rid] * n
            # Only the logits the engine uses come back: every row when recorded, else the last
            # row of a request whose sequence this step completes (it samples from it).
            if r.record_logits:
                logit_rows += range(start, start + n)
            elif r.fed + n == len(r.sequence):
                logit_rows.append(start + n - 1)
        logits = self.backend.step(np.array(tokens, np.int32), np.array(positions, np.int32),
                                   np.array(seqs, np.int32), np.array(logit_rows, np.int32))
        offset = 0
        for r, n in plan:
            got = n if r.record_logits else int(r.fed + n == len(r.sequence))
            rows = logits[offset:offset + got]
            offset += got
            r.fed += n
            if r.record_logits:
                r.logits.extend(rows)
            if r.fed == len(r.sequence):
                self._advance(r, rows[-1])
        return True

    def _advance(self, r: Request, last_logits: np.ndarray) -> None:
        if not r.done_sampling:
            token = r.sampler(last_logits)
            r.generated.append(token)
            if r.on_token:
                r.on_token(r.rid, token)
            if len(r.generated) >= r.params.max_new_tokens or token in r.params.stop_token_ids:
                r.done_sampling = True
            if not (r.done_sampling and r.record_logits):
                r.finished = r.done_sampling
                if r.finished:
                    self.pool.free(r.rid)
            return
        # Logits were requested for the last generated token too: it has now been fed.
        r.finished = True
        self.pool.free(r.rid)

    def run(self) -> None:
        while self.step():
            pass

    def _request(self, rid: int) -> Request:
        if rid not in self.requests:
            raise UsageError(f"no request {rid} in this engine (already collected, or never submitted)")
        return self.requests[rid]

    def result(self, rid: int) -> Result:
        r = self._request(rid)
        del self.requests[rid]
        return Result(r.generated, np.stack(r.logits).astype(np.float32) if r.record_logits else None)

    def is_finished(self, rid: int) -> bool:
        """Whether the request is complete, so that ``result(rid)`` returns all of it."""
        return self._request(rid).finished

    def cancel(self, rid: int) -> None:
        """Stop a request wherever it is (waiting, prefilling, decoding) and forget it: its pool rows are
        freed at once, and the steps that follow no longer include it."""
        self._request(rid)
        del self.requests[rid]
        if rid in self.pool.requests:
            self.pool.free(rid)

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
