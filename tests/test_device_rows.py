"""Speculative decoding's pool rows saved and put back on the artifact's device: the pool
functions every artifact compiles (``pool_save`` / ``pool_restore``,
``codegen.relax_step.emit_pool_functions``) and the engine's use of them
(``TvmBackend.device_rows``). No GPU here: the functions run on the CPU target, for the pool
formats of the GPU targets too, and the engine's device path is forced on a CPU artifact."""

import json
import shutil

import numpy as np
import pytest
import tvm
from tvm import relax

from dsv4c.artifact.manifest import ArtifactError
from dsv4c.artifact.pool import PoolGeometry
from dsv4c.artifact.pool_rows import FP4_PRESHUFFLED, IndexRowCodec
from dsv4c.codegen.build import relax_pipeline
from dsv4c.codegen.kernel_factories import KERNELS
from dsv4c.codegen.lowering import pool_row_kernels
from dsv4c.codegen.relax_step import POOL_FUNCTIONS, emit_pool_functions
from dsv4c.frontend.config import preset
from dsv4c.passes.quant_plan import plan_for
from dsv4c.runtime import tvm_runtime as rt
from dsv4c.runtime.backend_tvm import TvmBackend, pool_function_rows
from dsv4c.runtime.engine import Engine
from dsv4c.runtime.kv_pool import KVPool
from dsv4c.runtime.sampling import SamplingParams
from dsv4c.targets import target_info


def _pool_functions_vm(geometry: PoolGeometry):
    """The pool functions of ``geometry`` alone, built for this CPU, in a VM."""
    target = target_info("llvm").tvm_target()
    bb = relax.BlockBuilder()
    with target:
        specs = {spec.symbol: spec for t in geometry.tensors() for spec in pool_row_kernels(t.dtype).values()}
        gvars = {symbol: bb.add_func(KERNELS[spec.factory](*spec.params), symbol)
                 for symbol, spec in specs.items()}
    emit_pool_functions(bb, gvars, geometry)
    executable = tvm.compile(relax_pipeline(target, False)(bb.get()), target=target, relax_pipeline=None)
    return relax.VirtualMachine(executable, tvm.cpu())


def _random_bytes(pool: KVPool, rng) -> None:
    for a in pool.tensors.values():
        a.view(np.uint8).reshape(-1)[:] = rng.integers(0, 256, a.nbytes, dtype=np.uint8)


def _copies(pool: KVPool) -> dict[str, np.ndarray]:
    return {name: a.copy() for name, a in pool.tensors.items()}


# The pool formats of the targets: fp32 planes (llvm); FP8 NoPE + BF16 rope planes and FP8 index
# rows (sm90); FP4 index rows in gfx950's tiles of 64, whose bytes are scattered over the plane.
@pytest.mark.parametrize("target", ["llvm", "sm90", "gfx950"])
def test_pool_functions_put_back_exactly_the_saved_rows(target):
    cfg = preset("tiny")
    geometry = PoolGeometry.build(cfg, plan_for(cfg, target))
    assert (geometry.index_layout == FP4_PRESHUFFLED) == (target == "gfx950")
    assert {t.dtype for t in geometry.tensors()} == ({"float32"} if target == "llvm" else
                                                       {"float32", "uint8", "uint16"})
    vm = _pool_functions_vm(geometry)
    pool = KVPool(geometry, 4 * geometry.rows_per_envelope + 2 * geometry.window_rows_per_request)
    pool.admit(0)
    pool.admit(1, reserve_tokens=3 * 256)
    names = [t.name for t in geometry.tensors()]
    tensors = rt.tvm_ffi.convert([rt.from_numpy(pool.tensors[name]) for name in names])
    rng = np.random.default_rng(0)
    last = 2 * 256 - 1  # closes a window of every compress ratio (entries and index entries)
    for position in (2, last):  # 2 closes none: the entry planes' row lists are empty
        _random_bytes(pool, rng)
        state = pool.position_state(1, [position])
        flat = pool_function_rows(pool, names, state)
        rows = rt.tvm_ffi.convert([rt.to_device(r, rt.CPU) for r in flat])
        saved = vm[POOL_FUNCTIONS["save"]](tensors, rows)
        before = _copies(pool)
        _random_bytes(pool, rng)
        scribbled = _copies(pool)
        expected = _copies(pool)
        for array, index in state:
            name = next(n for n, a in pool.tensors.items() if a is array)
            if name == "index" and target == "gfx950":  # a row is its bytes, scattered over the tiles
                at = IndexRowCodec(geometry).fp4_offsets(array, np.asarray(index[0]))
                expected[name].reshape(-1)[at] = before[name].reshape(-1)[at]
            else:
                expected[name][index] = before[name][index]
        vm[POOL_FUNCTIONS["restore"]](tensors, rows, saved)
        for name in names:
            assert np.array_equal(pool.tensors[name].view(np.uint8), expected[name].view(np.uint8)), (position, name)
        # Every tensor the state names rows of got them back (the check above is not vacuous);
        # the index plane only where the position closes a window.
        named = [name for name, r in zip(names, flat) if r[0] >= 0]
        assert ("index" in named) == (position == last) and len(named) > len(names) // 2
        for name in named:
            assert not np.array_equal(expected[name].view(np.uint8), scribbled[name].view(np.uint8)), name


def _generate(artifact, monkeypatch, speculative=None, device_rows=False):
    """A ragged batch, greedy, through an engine (``device_rows``: its backend's forced on)."""
    with monkeypatch.context() as patch:
        patch.setattr(TvmBackend, "device_rows", device_rows)
        engine = Engine(artifact, prefill_chunk=13, max_step_tokens=96, max_requests=3, max_context=512,
                        speculative=speculative, num_draft_tokens=2)
    rng = np.random.default_rng(1)
    rids = [engine.submit(list(rng.integers(0, engine.config.vocab_size, n)), SamplingParams(max_new_tokens=24))
            for n in (30, 5, 70)]
    engine.run()
    return engine, [engine.result(r).tokens for r in rids]


def test_device_rows_give_the_host_path_tokens_and_pool(tiny_llvm, monkeypatch):
    """Speculative greedy decoding with the rows saved and put back by the compiled pool
    functions gives plain decoding's tokens, and leaves the pool the host path leaves, bit for bit."""
    _, plain = _generate(tiny_llvm, monkeypatch)
    host_engine, host = _generate(tiny_llvm, monkeypatch, "mtp")
    device_engine, device = _generate(tiny_llvm, monkeypatch, "mtp", device_rows=True)
    assert not host_engine.backend.device_rows and device_engine.backend.device_rows
    assert plain == host == device and all(len(t) == 24 for t in plain)
    # Random MTP weights: drafts are rejected, so rows were put back, on the device path alone.
    stats = device_engine.spec_stats
    assert stats.drafted > stats.accepted and stats.drafted == host_engine.spec_stats.drafted
    for name, array in host_engine.pool.tensors.items():
        assert np.array_equal(array.view(np.uint8), device_engine.pool.tensors[name].view(np.uint8)), name


def test_device_rows_use_the_pool_functions_not_the_host_arrays(tiny_llvm, monkeypatch):
    calls = []
    monkeypatch.setattr(KVPool, "save", lambda *_: pytest.fail("the host path saved rows"))
    monkeypatch.setattr(KVPool, "restore", lambda *_: pytest.fail("the host path restored rows"))
    restore = TvmBackend.restore_rows
    monkeypatch.setattr(TvmBackend, "restore_rows", lambda self, saved: calls.append(1) or restore(self, saved))
    monkeypatch.setattr(TvmBackend, "device_rows", True)
    engine = Engine(tiny_llvm, max_requests=1, max_context=256, speculative="mtp")
    rid = engine.submit([1, 2, 3], SamplingParams(max_new_tokens=6))
    engine.run()
    assert len(engine.result(rid).tokens) == 6 and calls


def test_artifact_without_pool_functions_is_refused_on_a_device(tiny_llvm, tmp_path, monkeypatch):
    """An artifact compiled before the pool functions existed: a one-line ArtifactError that says
    to recompile, where the rows would be saved on the device (forced here: no GPU)."""
    old = shutil.copytree(tiny_llvm, tmp_path / "old")
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["vm"]["pool_functions"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    Engine(old, max_requests=1, speculative="mtp")  # the host path needs none
    monkeypatch.setattr(TvmBackend, "device_rows", True)
    Engine(old, max_requests=1)  # nor plain decoding
    with pytest.raises(ArtifactError, match="recompile it$") as e:
        Engine(old, max_requests=1, speculative="mtp")
    assert "\n" not in str(e.value) and "pool save / restore" in str(e.value)
