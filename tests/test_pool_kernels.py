"""Low-bit KV pool kernels against runtime.kv_pool's numpy codecs: the TIR encoders reproduce
frontend.lowbit bit for bit, the store kernels write the codecs' bytes, the readers decode to
the codecs' values, and the GPU versions still build."""

import functools

import numpy as np
import pytest
import tvm
from tvm.script import tirx as T

from dsv4c.codegen import llvm_kernels as K
from dsv4c.targets import target_info
from dsv4c.frontend import lowbit
from dsv4c.frontend.config import resolve_model
from dsv4c.passes.quant_plan import plan_for
from dsv4c.runtime.kv_pool import KVPool, PoolGeometry

F32 = np.float32


@functools.lru_cache(maxsize=None)
def _kernel(factory: str, *params):
    func = getattr(K, factory)(*params)
    return tvm.compile(tvm.IRModule({"k": func.with_attr("global_symbol", "k")}), target=target_info("llvm").tvm_target())["k"]


def _run(kernel, *arrays):
    """Run a kernel on copies of ``arrays``; returns them all, as the kernel left them."""
    tensors = [tvm.runtime.tensor(np.ascontiguousarray(a)) for a in arrays]
    kernel(*tensors)
    return [t.numpy() for t in tensors]


# --------------------------------------------------------------------------- encoders


@T.prim_func
def _encoders(x: T.handle, out: T.handle):
    n = T.int32()
    X = T.match_buffer(x, (n,), "float32")
    OUT = T.match_buffer(out, (n, 6), "int32")
    for i in T.parallel(n):
        amax = T.reinterpret("float32", K.abs_bits(X[i]))
        OUT[i, 0] = K.encode_e4m3fn(X[i])
        OUT[i, 1] = K.encode_e2m1(X[i])
        OUT[i, 2] = T.reinterpret("int32", K.pow2_ceil_scale(amax, lowbit.FP8_AMAX_FLOOR, lowbit.E4M3_MAX))
        OUT[i, 3] = T.reinterpret("int32", K.pow2_ceil_scale(amax, lowbit.FP4_AMAX_FLOOR, lowbit.E2M1_MAX))
        OUT[i, 4] = K.encode_e8m0(X[i])
        OUT[i, 5] = T.Cast("int32", K.bf16_bits(X[i]))


def _grid_and_midpoints(values: np.ndarray) -> np.ndarray:
    """A format's finite values, the midpoints between neighbours (ties) and the float32 just
    either side of every one of them, with both signs."""
    mags = np.unique(np.abs(values[np.isfinite(values)])).astype(F32)
    points = np.concatenate([mags, ((mags[:-1] + mags[1:]) / 2).astype(F32)])  # midpoints are exact
    points = np.concatenate([points, np.nextafter(points, F32(np.inf)), np.nextafter(points, F32(0))])
    return np.concatenate([points, -points]).astype(F32)


def _encoder_inputs() -> np.ndarray:
    rng = np.random.default_rng(0)
    e4m3 = lowbit.decode_e4m3fn(np.arange(256, dtype=np.uint8))
    e2m1 = lowbit.decode_e2m1(np.arange(16, dtype=np.uint8))
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 448.0, 464.0, 480.0, 1e10, 6.0, 7.0, 1e-4,
                         lowbit.FP4_AMAX_FLOOR, 2.0 ** -126, 2.0 ** -149, 3.4028235e38], F32)
    subnormals = (rng.integers(1, 1 << 23, 2000, dtype=np.uint32)).view(F32)
    # Quotients near the scale rounding edges: exact and just-off multiples of qmax * 2**k.
    edges = np.concatenate([np.ldexp(F32(q), np.arange(-140, 120)).astype(F32) for q in (448.0, 6.0, 1.0)])
    edges = np.concatenate([edges, np.nextafter(edges, F32(np.inf)), np.nextafter(edges, F32(0))])
    scaled = [rng.standard_normal(4000).astype(F32) * F32(10.0) ** F32(k) for k in range(-44, 38, 3)]
    random_bits = rng.integers(0, 1 << 32, 20000, dtype=np.uint64).astype(np.uint32).view(F32)  # NaN payloads too
    powers = np.ldexp(F32(1), np.arange(-127, 128)).astype(F32)
    return np.concatenate([_grid_and_midpoints(e4m3), _grid_and_midpoints(e2m1), specials, subnormals,
                           -subnormals, edges, *scaled, random_bits, powers]).astype(F32)


def test_encoders_match_lowbit_bit_for_bit():
    x = _encoder_inputs()
    module = tvm.IRModule({"k": _encoders.with_attr("global_symbol", "k")})
    _, out = _run(tvm.compile(module, target=target_info("llvm").tvm_target())["k"], x, np.zeros((len(x), 6), np.int32))
    assert np.array_equal(out[:, 0], lowbit.encode_e4m3fn(x))
    assert np.array_equal(out[:, 1], lowbit.encode_e2m1(x))
    with np.errstate(invalid="ignore", over="ignore"):
        for col, floor, qmax in ((2, lowbit.FP8_AMAX_FLOOR, lowbit.E4M3_MAX),
                                 (3, lowbit.FP4_AMAX_FLOOR, lowbit.E2M1_MAX)):
            want = lowbit.pow2_ceil_scale(np.maximum(np.abs(x), F32(floor)), qmax)
            assert np.array_equal(out[:, col], want.view(np.int32)), col
    # e8m0 is defined on powers of two 2**-127..2**127 and NaN only.
    pow2 = np.isnan(x) | (np.frexp(x)[0] == 0.5) & (x >= 2.0 ** -127) & (x <= 2.0 ** 127)
    assert np.array_equal(out[pow2, 4], lowbit.encode_e8m0(x[pow2]))
    assert np.array_equal(out[:, 5], lowbit.bf16_bits_from_f32(x))


# --------------------------------------------------------------------------- pool stores and reads


def _pool(model: str, target: str, seed: int = 1) -> KVPool:
    """A pool of the model's geometry with two envelopes, its planes filled with random bytes
    (so that bytes a writer must leave alone are visible)."""
    cfg = resolve_model(model)
    g = PoolGeometry.build(cfg, plan_for(cfg, target))
    pool = KVPool(g, g.window_rows_per_request + 2 * g.rows_per_envelope)
    rng = np.random.default_rng(seed)
    for plane in [*pool.planes.values(), pool.index_plane]:
        plane.view(np.uint8)[...] = rng.integers(0, 256, plane.view(np.uint8).shape)
    return pool


def _hard_rows(rng, n: int, width: int, group: int, grid: np.ndarray, qmax: float) -> np.ndarray:
    """[n, width] float32 rows over the codecs' corner cases, then random rows of random scale."""
    v = rng.standard_normal((n, width)).astype(F32) * F32(10.0) ** rng.uniform(-8, 8, (n, 1)).astype(F32)
    v[0] = 0  # all-zero: the amax floor sets the scale
    v[1] = -0.0
    v[2] = rng.choice(np.array([-3.0e38, 3.0e38, 1e30, -2.5e36], F32), width)  # huge magnitudes
    v[3] = rng.standard_normal(width).astype(F32) * F32(1e-41)  # float32 subnormals, below the floor
    # wide range inside each group: many subnormal codes and zeros
    v[4] = rng.standard_normal(width).astype(F32) * F32(10.0) ** rng.uniform(-7, 0, width).astype(F32)
    # ties: each group's amax is qmax * 2**k (scale 2**k exactly), the rest midpoints of the grid
    mids = ((grid[:-1] + grid[1:]) / 2).astype(F32)
    v[5] = rng.choice(mids, width) * rng.choice(np.array([-1, 1], F32), width)
    v[5, ::group] = F32(qmax)
    v[5] *= F32(2.0 ** -3)
    # BF16 ties: low 16 bits exactly half an ulp
    v[6] = ((rng.integers(0x3F000000, 0x43000000, width, dtype=np.uint32) & 0xFFFF0000) | 0x8000).view(F32)
    # An amax whose float32 quotient amax / (amax / 448) is above 448 (the fp8 index codec does not clip).
    v[7] = rng.uniform(-1.0, 1.0, width).astype(F32)
    v[7, 0] = F32(1.9127556)
    v[8, : width // 2] = 0  # one half of the row zero, the other large
    v[8, width // 2:] *= F32(1e6)
    return v


def _positive_grid(decode, n_codes: int) -> np.ndarray:
    values = decode(np.arange(n_codes, dtype=np.uint8))
    return np.unique(values[np.isfinite(values) & (values >= 0)]).astype(F32)


E4M3_GRID = _positive_grid(lowbit.decode_e4m3fn, 128)
E2M1_GRID = _positive_grid(lowbit.decode_e2m1, 8)


def _index_rows(rng, n: int, g: PoolGeometry) -> np.ndarray:
    if g.index_storage == "fp4":
        return _hard_rows(rng, n, g.index_head_dim, 32, E2M1_GRID, lowbit.E2M1_MAX)
    return _hard_rows(rng, n, g.index_head_dim, g.index_head_dim, E4M3_GRID, lowbit.E4M3_MAX)


def _written_rows(rng, available: int, n: int) -> np.ndarray:
    return np.sort(rng.choice(available, n, replace=False)).astype(np.int32)


@pytest.mark.parametrize("model", ["tiny", "flash"])
def test_store_main_fp8_writes_the_codec_bytes(model):
    pool, mirror = _pool(model, "sm90"), _pool(model, "sm90")
    g = pool.geometry
    rng = np.random.default_rng(2)
    rows = _written_rows(rng, pool.total_rows, 24)
    values = _hard_rows(rng, len(rows), g.head_dim, 64, E4M3_GRID, lowbit.E4M3_MAX)
    values[6, : g.head_dim - g.rope_dim] = values[5, : g.head_dim - g.rope_dim]  # ties in the NoPE part too
    values[5, g.head_dim - g.rope_dim:] = values[6, g.head_dim - g.rope_dim:]  # bf16 ties in the rope part
    pool.write_main(rows, values)
    nope, rope, _, _ = _run(_kernel("store_main_fp8", g.head_dim - g.rope_dim, g.rope_dim),
                            mirror.planes["nope"], mirror.planes["rope"], rows, values)
    assert np.array_equal(nope, pool.planes["nope"])  # padding bytes and other rows untouched too
    assert np.array_equal(rope, pool.planes["rope"])


@pytest.mark.parametrize("model", ["tiny", "flash"])
@pytest.mark.parametrize("target", ["sm90", "gfx950"])  # index fp8 / fp4
def test_store_rows_writes_the_codec_bytes(model, target):
    pool, mirror = _pool(model, target), _pool(model, target)
    g = pool.geometry
    rng = np.random.default_rng(3)
    rows = _written_rows(rng, len(pool.index_plane), 24)
    values = _index_rows(rng, len(rows), g)
    if g.index_storage == "fp8":  # the quotient at row 7's amax is really above 448, and saturates to 0x7E
        assert F32(1.9127556) / (F32(1.9127556) / F32(448)) > 448
    pool.write_index(rows, values)
    kernel = _kernel("store_rows", g.index_head_dim, g.index_storage)
    plane, _, _ = _run(kernel, mirror.index_plane, rows, values)
    assert np.array_equal(plane, pool.index_plane)


def _row_lists(rng, n: int, pool_rows: np.ndarray, total_rows: int, step_rows: int, per_query: int):
    """Row lists [n, m] of n queries mixing written pool rows and this step's rows (R + i), with
    -1 (no row) between and after them, as step_kernels.attention_rows makes them."""
    lists = [np.concatenate([rng.choice(pool_rows, c), total_rows + rng.integers(0, step_rows, c // 2), [-1] * 3])
             for c in rng.integers(1, per_query + 1, n)]
    rows = np.full((n, max(len(x) for x in lists) + 2), -1, np.int32)
    for i, x in enumerate(lists):
        rows[i, 1:1 + len(x)] = rng.permutation(x)
    return rows


@pytest.mark.parametrize("model", ["tiny", "flash"])  # one / four fp4 scale groups per row
@pytest.mark.parametrize("target", ["sm90", "gfx950"])
def test_index_score_on_lowbit_rows_equals_fp32_on_decoded_rows(model, target):
    pool = _pool(model, target)
    g, cfg = pool.geometry, resolve_model(model)
    heads, dim = cfg.index_n_heads, g.index_head_dim
    rng = np.random.default_rng(4)
    written = _written_rows(rng, len(pool.index_plane), 40)
    pool.write_index(written, _index_rows(rng, len(written), g))
    n, e = 5, 30
    q = rng.standard_normal((n, heads, dim)).astype(F32)
    w = rng.standard_normal((n, heads)).astype(F32)
    entries = rng.choice(written, (n, e)).astype(np.int32)
    entries[:, -3:] = -1
    out = np.zeros((n, e), F32)
    decoded = np.zeros((len(pool.index_plane), dim), F32)  # unwritten rows hold random bytes: leave them out
    with np.errstate(over="ignore"):  # fp4 rows of +-3e38 decode to inf: 6 * 2**126 is out of float32 range
        decoded[written] = pool.read_index(written)
    got = _run(_kernel("index_score", heads, dim, g.index_storage), q, w, pool.index_plane, entries, out)[-1]
    want = _run(_kernel("index_score", heads, dim), q, w, decoded, entries, out)[-1]
    assert np.array_equal(got, want, equal_nan=True)  # rows of huge values overflow alike


@pytest.mark.parametrize("model", ["tiny", "flash"])
def test_sparse_attn_on_fp8_rows_equals_fp32_on_decoded_rows(model):
    pool = _pool(model, "sm90")
    g = pool.geometry
    heads, dim = 4, g.head_dim
    rng = np.random.default_rng(5)
    written = _written_rows(rng, pool.total_rows, 48)
    # values over five decades within each 64-group: subnormal and zero codes among them
    values = rng.standard_normal((len(written), dim)) * 10.0 ** rng.uniform(-4, 1, (len(written), dim))
    values[0] = 0
    pool.write_main(written, values.astype(F32))
    n, m = 3, 4
    q = (rng.standard_normal((n, heads, dim)) * 0.1).astype(F32)
    step = rng.standard_normal((m, dim)).astype(F32)
    sink = rng.standard_normal(heads).astype(F32)
    rows = _row_lists(rng, n, written, pool.total_rows, m, 20)
    out = np.zeros((n, heads, dim), F32)
    scale = dim ** -0.5
    decoded = np.zeros((pool.total_rows, dim), F32)
    decoded[written] = pool.read_main(written)
    got = _run(_kernel("sparse_attn", heads, dim, scale, "fp8", g.rope_dim), q, pool.planes["nope"],
               pool.planes["rope"], step, sink, rows, out)[-1]
    want = _run(_kernel("sparse_attn", heads, dim, scale), q, decoded, step, sink, rows, out)[-1]
    assert np.array_equal(got, want)


# --------------------------------------------------------------------------- GPU builds


@pytest.mark.parametrize("target_name", ["sm90", "gfx942", "gfx950"])
def test_gpu_versions_build(target_name, monkeypatch):
    from dsv4c.codegen import gpu
    from dsv4c.codegen.lowering import KernelSpec

    if target_name != "sm90":  # CUDA source needs no toolchain; AMDGPU code objects need ld.lld
        try:
            for key, value in gpu.rocm_environment().items():
                monkeypatch.setenv(key, value)
        except gpu.ToolchainError as e:
            pytest.skip(f"toolchain missing for {target_name}: {e}")
    target = tvm.target.Target(target_info(target_name).tvm)
    specs = {  # the flash / pro pool shapes
        "store_main_fp8": KernelSpec("store_main_fp8", (448, 64)),
        "store_rows_fp8": KernelSpec("store_rows", (128, "fp8")),
        "store_rows_fp4": KernelSpec("store_rows", (128, "fp4")),
        "index_score_fp8": KernelSpec("index_score", (64, 128, "fp8")),
        "index_score_fp4": KernelSpec("index_score", (64, 128, "fp4")),
        "sparse_attn_fp8": KernelSpec("sparse_attn", (64, 512, 512 ** -0.5, "fp8", 64)),
    }
    funcs = {name: gpu.gpu_kernel(spec, target).with_attr("global_symbol", name) for name, spec in specs.items()}
    device_module = tvm.compile(tvm.IRModule(funcs), target=target).mod.imports[0]
    source = device_module.inspect_source("cuda" if target_name == "sm90" else "asm")
    for name in specs:
        assert f"{name}_kernel" in source
