"""The engine: loads an artifact, owns the KV pool, and runs requests with continuous batching.

Every step packs decode tokens of running requests and prefill chunks of others into one
call of the compiled ``step`` function; a request's tokens are contiguous in the step and
at consecutive positions (what the kernels and the CSR index builder rely on).
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from dsv4c.errors import UsageError
from dsv4c.frontend.config import config_from_dict
from dsv4c.ir.serialize import program_from_json
from dsv4c.passes.quant_plan import plan_for
from dsv4c.runtime.artifact import ArtifactError, read_manifest
from dsv4c.runtime.kv_pool import ENVELOPE_TOKENS, KVPool, PoolGeometry
from dsv4c.runtime.sampling import Sampler, SamplingParams

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


def gpu_device(target: str):
    """The GPU this host has for a GPU target, or None (no such GPU, or another architecture)."""
    import tvm

    if target == "sm90":
        device = tvm.cuda(0)
        return device if device.exist and device.compute_version == "9.0" else None
    device = tvm.rocm(0)
    if not device.exist:
        return None
    # ROCm reports the ISA (gfx942) in the name or the compute version depending on the driver;
    # refuse a named other ISA, accept when none is named.
    arch = re.search(r"gfx\d+", f"{device.device_name} {device.compute_version}")
    return device if arch is None or arch[0] == target else None


def load_backend(artifact: Path, manifest: dict, program, pool: KVPool):
    target = manifest["target"]
    if target == "reference":
        from dsv4c.runtime.backend_reference import ReferenceBackend

        return ReferenceBackend(artifact, manifest, program, pool)
    from dsv4c.runtime.backend_tvm import TvmBackend

    if target == "llvm":
        return TvmBackend(artifact, manifest, program, pool)
    device = gpu_device(target)
    if device is None:
        raise ArtifactError(f"{artifact}: an artifact for {target} needs that GPU and this host has none; run it "
                            "there, or compile with --target llvm for this CPU")
    return TvmBackend(artifact, manifest, program, pool, device)


class Engine:
    def __init__(self, artifact: str | Path, max_step_tokens: int = 512, prefill_chunk: int | None = None,
                 max_requests: int = 8, max_context: int = 4096, verify: bool = False):
        """``verify`` hashes every artifact file against the manifest first (reads every byte);
        without it loading checks the manifest, file sizes and weight headers only."""
        self.path = Path(artifact)
        manifest = read_manifest(self.path, verify=verify)
        self.manifest = manifest
        self.config = config_from_dict(manifest["model"], manifest["model_name"])
        self.program = program_from_json(json.loads((self.path / "program.json").read_text()), self.config)
        plan = plan_for(self.config, manifest["target"], self.program.numerics, manifest.get("kv_cache_dtype", "auto"))
        geometry = PoolGeometry.build(self.config, plan)
        envelopes = max_requests * -(-max_context // ENVELOPE_TOKENS)
        self.pool = KVPool(geometry, envelopes * geometry.rows_per_envelope
                           + max_requests * geometry.window_rows_per_request)
        self.max_context = max_context
        self.backend = load_backend(self.path, manifest, self.program, self.pool)
        if max_step_tokens < 1 or (prefill_chunk is not None and prefill_chunk < 1):
            raise UsageError("max_step_tokens and prefill_chunk must be positive")
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
        tokens, positions, seqs = [], [], []
        for r, n in plan:
            self.pool.ensure(r.rid, r.fed + n)
            tokens += r.sequence[r.fed:r.fed + n]
            positions += range(r.fed, r.fed + n)
            seqs += [r.rid] * n
        logits = self.backend.step(np.array(tokens, np.int32), np.array(positions, np.int32),
                                   np.array(seqs, np.int32))
        offset = 0
        for r, n in plan:
            rows = logits[offset:offset + n]
            offset += n
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

    def result(self, rid: int) -> Result:
        if rid not in self.requests:
            raise UsageError(f"no request {rid} in this engine (already collected, or never submitted)")
        r = self.requests.pop(rid)
        return Result(r.generated, np.stack(r.logits).astype(np.float32) if r.record_logits else None)

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
