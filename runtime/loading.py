"""Loading an artifact for the engine: the checks of the engine's settings against it, the KV
pool's size, and the backend that runs its step."""

from __future__ import annotations

import json
from pathlib import Path

from dsv4c.artifact.engram import EngramTables
from dsv4c.artifact.file_names import ENGRAM_HASH, PROGRAM
from dsv4c.artifact.manifest import Manifest
from dsv4c.artifact.model_config import ModelConfig
from dsv4c.artifact.pool import ENVELOPE_TOKENS, PoolGeometry, graph_context_limit
from dsv4c.errors import ArtifactError, UsageError
from dsv4c.runtime.backend import Backend
from dsv4c.runtime.kv_pool import KVPool
from dsv4c.runtime.weights import available_memory
from dsv4c.targets import target_info


def check_settings(path: Path, manifest: Manifest, config: ModelConfig, max_context: int,
                   tensor_parallel: int | None, distributed_timeout: float | None) -> None:
    """Refuse a rank count, a timeout or a context the artifact cannot run with."""
    ranks = manifest.tensor_parallel
    if tensor_parallel is not None and tensor_parallel != ranks:
        raise UsageError(f"--tensor-parallel {tensor_parallel}: {path} is compiled for {ranks} rank(s); "
                         f"run it with --tensor-parallel {ranks}, or compile it again with --tensor-parallel "
                         f"{tensor_parallel}")
    if distributed_timeout is not None and not distributed_timeout > 0:
        raise UsageError(f"--distributed-timeout must be positive, got {distributed_timeout}")
    if manifest.vm is not None and manifest.vm.cuda_graph and max_context > graph_context_limit(config):
        raise UsageError(f"max_context {max_context} exceeds the {graph_context_limit(config)} "
                         f"positions {path}'s CUDA graphs are built for (the model's max_position_embeddings, "
                         "rounded up to a power of two); lower it")


def check_step_tokens(path: Path, manifest: Manifest, max_step_tokens: int, prefill_chunk: int | None) -> None:
    """Refuse a step budget the artifact was not compiled for."""
    if max_step_tokens < 1 or (prefill_chunk is not None and prefill_chunk < 1):
        raise UsageError("max_step_tokens and prefill_chunk must be positive")
    limit = manifest.vm.max_step_tokens if manifest.vm else None
    if limit is not None and max_step_tokens > limit:
        raise UsageError(f"max_step_tokens {max_step_tokens} exceeds what {path} was compiled for ({limit}); "
                         "lower it")


def pool_rows(manifest: Manifest, g: PoolGeometry, max_context: int, max_requests: int,
              kv_cache_memory: int | None) -> int:
    """The KV pool's rows: ``kv_cache_memory`` bytes' worth, at least one request of
    ``max_context``; by default room for ``max_requests`` requests and as much again for cached
    prefixes, at most half the host's available memory when the pool lives there."""
    one = -(-max_context // ENVELOPE_TOKENS) * g.rows_per_envelope + g.window_rows_per_request
    if kv_cache_memory is None:
        rows = 2 * max_requests * one
        # Ranks this engine starts share the host: each holds a whole pool (runtime.tensor_parallel).
        host = available_memory() // manifest.tensor_parallel
        if target_info(manifest.target).kind in ("reference", "cpu") and host:  # 0: not reported
            rows = max(min(rows, KVPool.rows_for_bytes(g, host // 2)), one)
    else:
        rows = KVPool.rows_for_bytes(g, kv_cache_memory)
        if rows < one:
            raise UsageError(f"kv_cache_memory {kv_cache_memory} B holds {rows} pool rows, fewer than one request "
                             f"of max_context {max_context} needs ({one} rows, "
                             f"{KVPool.nbytes_for(g, one)} B); give it more or lower max_context")
    return rows


def load_backend(artifact: Path, manifest: Manifest, config, pool: KVPool, weights_mode: str = "auto",
                 distributed_timeout: float | None = None, engram_memory: str = "map") -> Backend:
    """``engram_memory``: "map" or "read" the Engram tables (``runtime.weights.open_engram_tables``)."""
    info = target_info(manifest.target)
    if not info.compiled:
        from dsv4c.ir.serialize import program_from_json
        from dsv4c.runtime.backend_reference import ReferenceBackend

        program = program_from_json(json.loads((artifact / PROGRAM).read_text()), config)
        return ReferenceBackend(artifact, manifest, program, pool, engram_memory)
    from dsv4c.runtime.backend_tvm import TvmBackend
    from dsv4c.runtime.tvm_runtime import device as tvm_device

    device = tvm_device(info)
    if device is None:
        raise ArtifactError(f"{artifact}: an artifact for {info.name} needs that GPU and this host has none; run it "
                            "there, or compile with --target llvm for this CPU")
    if manifest.tensor_parallel > 1:
        from dsv4c.runtime.tensor_parallel.backend import TensorParallelBackend
        from dsv4c.runtime.tensor_parallel.collectives import DEFAULT_TIMEOUT_S

        return TensorParallelBackend(artifact, manifest, pool, device, weights_mode,
                                     DEFAULT_TIMEOUT_S if distributed_timeout is None else distributed_timeout,
                                     engram_memory=engram_memory)
    return TvmBackend(artifact, manifest, pool, device, weights_mode, engram_memory=engram_memory)


def load_engram_hash(artifact: Path, manifest: Manifest, config: ModelConfig) -> EngramTables | None:
    """The Engram hash constants of a model with Engram layers (None for others)."""
    if config.engram is None:
        return None
    if manifest.engram is None:
        raise ArtifactError(f"{artifact}: the model has Engram layers but the manifest has no 'engram' section "
                            "(compiled by an older dsv4c, which kept the tables among the weights); recompile")
    hash_file = manifest.engram.hash
    if hash_file is None:
        raise ArtifactError(f"{artifact}: the model has Engram layers but the artifact has no {ENGRAM_HASH}; "
                            "compile it from a model directory that holds its tokenizer")
    return EngramTables.load(artifact / hash_file)
