"""Low-bit KV pool kernels against runtime.kv_pool's numpy codecs: the TIR encoders reproduce
frontend.lowbit bit for bit, the store kernels write the codecs' bytes, the readers decode to
the codecs' values, the bytes are in the format and layout the plan (and `inspect`) declares,
and the GPU versions still build."""

import dataclasses
import functools
import json

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm.script import tirx as T

from dsv4c.cli import main as cli
from dsv4c.codegen.kernel_factories import KERNELS
from dsv4c.codegen.kernels import codecs, gpu_attention
from dsv4c.codegen.lowering import kernel_table
from dsv4c.targets import target_info
from dsv4c.artifact import lowbit
from dsv4c.errors import UsageError
from dsv4c.frontend.config import config_from_dict, preset, resolve_model
from dsv4c.frontend.trace import trace
from dsv4c.passes.pipeline import run_pipeline
from dsv4c.passes.quant_plan import plan_for
from dsv4c.artifact.pool import PoolGeometry
from dsv4c.runtime.kv_pool import KVPool, aligned_zeros
from dsv4c.artifact.pool_rows import PRESHUFFLE_TILE_ROWS, fp4_code_offset, fp4_scale_offset, index_plane_row

from parity_configs import PARITY_CONFIGS

F32 = np.float32


@functools.lru_cache(maxsize=None)
def _kernel(factory: str, *params):
    func = KERNELS[factory](*params)
    return tvm.compile(tvm.IRModule({"k": func.with_attr("global_symbol", "k")}), target=target_info("llvm").tvm_target())["k"]


def _run(kernel, *arrays):
    """Run a kernel on copies of ``arrays``; returns them all, as the kernel left them."""
    return _kernel_on(kernel, list(arrays), {})


def _kernel_on(kernel, arrays: list, shared: dict[int, np.ndarray]) -> list[np.ndarray | None]:
    """Run ``kernel`` on copies of ``arrays``, but on the ``shared`` ones (by argument place)
    themselves (no copy: a lazily allocated plane stays so); returns the copies as the kernel
    left them (None for the shared)."""
    tensors = [tvm.runtime.from_dlpack(shared[i]) if i in shared else tvm.runtime.tensor(np.ascontiguousarray(a))
               for i, a in enumerate(arrays)]
    kernel(*tensors)
    return [None if i in shared else t.numpy() for i, t in enumerate(tensors)]


# --------------------------------------------------------------------------- encoders


@T.prim_func
def _encoders(x: T.handle, out: T.handle):
    n = T.int32()
    X = T.match_buffer(x, (n,), "float32")
    OUT = T.match_buffer(out, (n, 7), "int32")
    for i in T.parallel(n):
        amax = T.reinterpret("float32", codecs.abs_bits(X[i]))
        OUT[i, 0] = codecs.encode_e4m3fn(X[i])
        OUT[i, 1] = codecs.encode_e2m1(X[i])
        OUT[i, 2] = T.reinterpret("int32", codecs.pow2_ceil_scale(amax, lowbit.FP8_AMAX_FLOOR, lowbit.E4M3_MAX))
        OUT[i, 3] = T.reinterpret("int32", codecs.pow2_ceil_scale(amax, lowbit.FP4_AMAX_FLOOR, lowbit.E2M1_MAX))
        OUT[i, 4] = codecs.encode_e8m0(X[i])
        OUT[i, 5] = T.Cast("int32", codecs.bf16_bits(X[i]))
        OUT[i, 6] = codecs.encode_fp8(X[i], "e4m3fnuz")


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
    _, out = _run(tvm.compile(module, target=target_info("llvm").tvm_target())["k"], x, np.zeros((len(x), 7), np.int32))
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
    # gfx942's codes: the e4m3fn bits re-encoded (-0 and the NaNs are among the inputs)
    assert np.array_equal(out[:, 6], lowbit.e4m3fn_to_fnuz(lowbit.encode_e4m3fn(x)))
    assert {0x80, 0x00} <= set(lowbit.encode_e4m3fn(x)) and 0x80 in set(out[:, 6])


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
@pytest.mark.parametrize("target", ["sm90", "gfx942"])  # e4m3fn / e4m3fnuz codes
def test_store_main_fp8_writes_the_codec_bytes(model, target):
    pool, mirror = _pool(model, target), _pool(model, target)
    g = pool.geometry
    rng = np.random.default_rng(2)
    rows = _written_rows(rng, pool.total_rows, 24)
    values = _hard_rows(rng, len(rows), g.head_dim, 64, E4M3_GRID, lowbit.E4M3_MAX)
    values[6, : g.head_dim - g.rope_dim] = values[5, : g.head_dim - g.rope_dim]  # ties in the NoPE part too
    values[5, g.head_dim - g.rope_dim:] = values[6, g.head_dim - g.rope_dim:]  # bf16 ties in the rope part
    pool.write_main(rows, values)
    nope, rope, _, _ = _run(_kernel("store_main_fp8", g.head_dim - g.rope_dim, g.rope_dim, g.fp8_format),
                            mirror.planes["nope"], mirror.planes["rope"], rows, values)
    assert np.array_equal(nope, pool.planes["nope"])  # padding bytes and other rows untouched too
    assert np.array_equal(rope, pool.planes["rope"])


@pytest.mark.parametrize("model", ["tiny", "flash"])
@pytest.mark.parametrize("target", ["sm90", "gfx942", "gfx950"])  # index fp8 e4m3fn / e4m3fnuz / fp4 preshuffled
def test_store_rows_writes_the_codec_bytes(model, target):
    pool, mirror = _pool(model, target), _pool(model, target)
    g = pool.geometry
    rng = np.random.default_rng(3)
    rows = _written_rows(rng, len(pool.index_plane), 24)
    values = _index_rows(rng, len(rows), g)
    if g.index_storage == "fp8":  # the quotient at row 7's amax is really above 448, and saturates to 0x7E
        assert F32(1.9127556) / (F32(1.9127556) / F32(448)) > 448
    pool.write_index(rows, values)
    kernel = _kernel("store_rows", g.index_head_dim, g.index_storage, g.fp8_format, g.index_layout)
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
@pytest.mark.parametrize("target", ["sm90", "gfx942", "gfx950"])
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
    got = _run(_kernel("index_score", heads, dim, g.index_storage, g.fp8_format, g.index_layout), q, w,
               pool.index_plane, entries, out)[-1]
    want = _run(_kernel("index_score", heads, dim), q, w, decoded, entries, out)[-1]
    assert np.array_equal(got, want, equal_nan=True)  # rows of huge values overflow alike


def _blocked_attention(*params):
    func = gpu_attention.sparse_attn_blocked(*params, emulate=True)
    return tvm.compile(tvm.IRModule({"k": func.with_attr("global_symbol", "k")}), target=target_info("llvm").tvm_target())["k"]


@pytest.mark.parametrize("model", ["tiny", "flash"])
@pytest.mark.parametrize("target", ["sm90", "gfx942"])
@pytest.mark.parametrize("blocked", [False, True])
def test_sparse_attn_on_fp8_rows_equals_fp32_on_decoded_rows(model, target, blocked):
    """Values decoded as they are read (NoPE codes by their group's scale, rope values from BF16;
    e4m3fn for sm90, e4m3fnuz for gfx942): bit for bit the kernel's outputs on the decoded rows,
    the CPU's kernel and the GPU targets' blocked one (``kernels.gpu_attention``, its phases run
    in turn here; 8 heads, a group of them) alike."""
    pool = _pool(model, target)
    g = pool.geometry
    heads, dim = (8 if blocked else 4), g.head_dim
    build = _blocked_attention if blocked else functools.partial(_kernel, "sparse_attn")
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
    got = _run(build(heads, dim, scale, "fp8", g.rope_dim, g.fp8_format), q, pool.planes["nope"],
               pool.planes["rope"], step, sink, rows, out)[-1]
    want = _run(build(heads, dim, scale), q, decoded, step, sink, rows, out)[-1]
    assert np.array_equal(got, want)


# --------------------------------------------------------------------------- planes past 2 GiB
#
# A pool plane passes 2**31 elements in ordinary use (Flash's fp8 NoPE plane at 8 x 128K tokens,
# its fp32 main plane at 1M): every offset into one must be computed in 64 bits.


def _plane_past_2_gib(width: int, dtype, tile_rows: int) -> np.ndarray:
    """A plane of more than 2**31 elements in whole tiles of rows, lazily zeroed: only the pages a
    kernel touches are ever allocated."""
    rows = -(-(2 ** 31 // width + 1) // tile_rows) * tile_rows
    return aligned_zeros((rows, width), dtype)


@pytest.mark.parametrize("target", ["llvm", "sm90", "gfx950"])  # fp32 rows / fp8 rows / fp4 preshuffled index rows
def test_kernels_reach_pool_rows_past_2_gib(target):
    """The last rows of planes past 2**31 elements (8 GiB of address space for fp32 planes, lazily
    allocated) are stored where the codec puts them and read from there: the same bytes, scores
    and attention as the same rows of a small plane."""
    small = _pool("flash", target)
    for plane in [*small.planes.values(), small.index_plane]:
        plane[...] = 0  # as the big planes: the padding bytes no writer touches compare equal
    g, cfg = small.geometry, resolve_model("flash")
    dim, rng = g.index_head_dim, np.random.default_rng(6)

    # Index rows: store, compare the bytes, score.
    width, dtype = index_plane_row(dim, g.index_storage)
    big = _plane_past_2_gib(width, dtype, PRESHUFFLE_TILE_ROWS)
    shift = len(big) - len(small.index_plane)  # whole tiles: row r of the small plane is row r + shift
    rows = np.append(_written_rows(rng, len(small.index_plane) - 1, 15), len(small.index_plane) - 1).astype(np.int32)
    store = _kernel("store_rows", dim, g.index_storage, g.fp8_format, g.index_layout)
    args = [small.index_plane, rows, _index_rows(rng, len(rows), g)]
    plane = _run(store, *args)[0]
    _kernel_on(store, [big, rows + shift, args[2]], {0: big})
    if g.index_storage == "fp4":
        for offset, count in ((fp4_code_offset, dim // 2), (fp4_scale_offset, dim // 32)):
            def at(r, n):
                return offset(g.index_layout, r.astype(np.int64)[:, None], np.arange(count)[None], n, dim)
            assert np.array_equal(big.reshape(-1)[at(rows + shift, len(big))], plane.reshape(-1)[at(rows, len(plane))])
    else:
        assert np.array_equal(big[rows + shift], plane[rows])
    heads, entries = cfg.index_n_heads, rng.choice(rows, (2, 6)).astype(np.int32)
    score = _kernel("index_score", heads, dim, g.index_storage, g.fp8_format, g.index_layout)
    q, w, out = rng.standard_normal((2, heads, dim)).astype(F32), rng.standard_normal((2, heads)).astype(F32), np.zeros((2, 6), F32)
    got = _kernel_on(score, [q, w, big, entries + shift, out], {2: big})[-1]
    assert np.array_equal(got, _run(score, q, w, plane, entries, out)[-1])
    del big

    # Main rows: store, compare, attend (this step's rows follow the pool's in the row lists).
    names = list(g.plane_bytes_per_row())  # ["kv"] (fp32) or ["nope", "rope"] (fp8)
    if g.main_storage == "fp8":
        store = _kernel("store_main_fp8", g.head_dim - g.rope_dim, g.rope_dim, g.fp8_format)
        attn = _kernel("sparse_attn", 4, g.head_dim, g.head_dim ** -0.5, "fp8", g.rope_dim, g.fp8_format)
        first = _plane_past_2_gib(g.plane_bytes_per_row()["nope"], np.uint8, 1)
        bigs = [first, aligned_zeros((len(first), g.rope_dim), np.uint16)]
    else:
        store = _kernel("store_rows", g.head_dim, "fp32")
        attn = _kernel("sparse_attn", 4, g.head_dim, g.head_dim ** -0.5)
        bigs = [_plane_past_2_gib(g.head_dim, F32, 1)]
    shift = len(bigs[0]) - small.total_rows
    rows = np.append(_written_rows(rng, small.total_rows - 1, 15), small.total_rows - 1).astype(np.int32)
    values = (rng.standard_normal((len(rows), g.head_dim)) * 10.0 ** rng.uniform(-4, 1, (len(rows), g.head_dim))).astype(F32)
    planes = _run(store, *[small.planes[n] for n in names], rows, values)[:len(names)]
    _kernel_on(store, [*bigs, rows + shift, values], dict(enumerate(bigs)))
    for b, p in zip(bigs, planes):
        assert np.array_equal(b[rows + shift], p[rows])
    q = (rng.standard_normal((2, 4, g.head_dim)) * 0.1).astype(F32)
    step, sink = rng.standard_normal((3, g.head_dim)).astype(F32), rng.standard_normal(4).astype(F32)
    lists = _row_lists(rng, 2, rows, small.total_rows, 3, 8)
    out = np.zeros((2, 4, g.head_dim), F32)
    got = _kernel_on(attn, [q, *bigs, step, sink, np.where(lists >= 0, lists + shift, -1), out],
                     {1 + i: b for i, b in enumerate(bigs)})[-1]
    assert np.array_equal(got, _run(attn, q, *planes, step, sink, lists, out)[-1])


# --------------------------------------------------------------------------- the declared format


def _signed_zero_rows(rng, n: int, width: int) -> np.ndarray:
    """Rows whose codes include -0: negative zeros, and negatives far below their group's amax."""
    v = rng.standard_normal((n, width)).astype(F32) * F32(10.0) ** rng.uniform(-6, 6, (n, 1)).astype(F32)
    v[0] = -0.0
    v[1, ::2] = -v[1, ::2] * F32(1e-9)  # rounds to -0 next to values of ordinary size
    return v


def test_fnuz_pool_holds_the_fn_pool_values():
    """gfx942 keeps the e4m3fn bits and doubles the scales: the pool decodes to the same values
    as an e4m3fn pool of the same rows, and never holds 0x80 (NaN in fnuz) for a -0."""
    cfg = resolve_model("flash")
    fn, fnuz = (KVPool(g, g.window_rows_per_request + 2 * g.rows_per_envelope)
                for g in (PoolGeometry.build(cfg, plan_for(cfg, "llvm", kv_cache_dtype="fp8")),
                          PoolGeometry.build(cfg, plan_for(cfg, "gfx942"))))
    assert (fn.geometry.fp8_format, fnuz.geometry.fp8_format) == ("e4m3fn", "e4m3fnuz")
    assert fn.geometry.index_storage == fnuz.geometry.index_storage == "fp8"
    rng = np.random.default_rng(6)
    g = fn.geometry
    nope = g.head_dim - g.rope_dim
    main = np.concatenate([_signed_zero_rows(rng, 4, g.head_dim),
                           _hard_rows(rng, 12, g.head_dim, 64, E4M3_GRID, lowbit.E4M3_MAX)])
    index = np.concatenate([_signed_zero_rows(rng, 4, g.index_head_dim),
                            _hard_rows(rng, 12, g.index_head_dim, g.index_head_dim, E4M3_GRID, lowbit.E4M3_MAX)])
    main_rows, index_rows = np.arange(16) * 7, np.arange(16) * 5
    for pool in (fn, fnuz):
        pool.write_main(main_rows, main)
        pool.write_index(index_rows, index)
    assert np.array_equal(fnuz.read_main(main_rows), fn.read_main(main_rows))
    assert np.array_equal(fnuz.read_index(index_rows), fn.read_index(index_rows))
    fn_codes = fn.planes["nope"][main_rows, :nope]
    assert (fn_codes == 0x80).any() and not (fnuz.planes["nope"][main_rows, :nope] == 0x80).any()
    assert np.array_equal(fnuz.planes["nope"][main_rows, :nope], lowbit.e4m3fn_to_fnuz(fn_codes))
    scales = slice(nope, nope + nope // 64)
    assert np.array_equal(fnuz.planes["nope"][main_rows, scales], fn.planes["nope"][main_rows, scales] + 1)
    d = g.index_head_dim
    assert (fn.index_plane[index_rows, :d] == 0x80).any() and not (fnuz.index_plane[index_rows, :d] == 0x80).any()
    doubled = 2 * np.ascontiguousarray(fn.index_plane[index_rows, d:]).view(F32)
    assert np.array_equal(np.ascontiguousarray(fnuz.index_plane[index_rows, d:]).view(F32), doubled)


FP8_DTYPES = {"e4m3fn": ml_dtypes.float8_e4m3fn, "e4m3fnuz": ml_dtypes.float8_e4m3fnuz}


def _fp8_values(codes, fp8_format: str) -> np.ndarray:
    return np.ascontiguousarray(codes).view(FP8_DTYPES[fp8_format]).astype(F32)


def _e8m0_values(codes) -> np.ndarray:
    return np.ascontiguousarray(codes).view(ml_dtypes.float8_e8m0fnu).astype(F32)


def _fp4_rows(plane: np.ndarray, layout: str, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(packed codes [R, dim / 2], E8M0 scales [R, dim / 32]) of every row of an FP4 index plane.
    gfx950's layout is undone as AITER's op test builds it for pa_mqa_logits_fp4
    (create_paged_preshuffle_kv_fp4): kv_cache [NB, k_tiles, 4, 64, 16] and kv_scale
    [NB, k_tiles, 4, 64] with the 64 rows interleaved as 4 x 16 -> 16 x 4, back to back."""
    if layout == "row-major":
        return plane[:, :dim // 2], plane[:, dim // 2:]
    assert layout == "gfx950_fp4_preshuffled"
    blocks, k_tiles = len(plane) // 64, dim // 128
    flat = plane.reshape(-1)
    kv_cache = flat[:len(plane) * dim // 2].reshape(blocks, k_tiles, 4, 64, 16)
    kv_scale = flat[len(plane) * dim // 2:].reshape(blocks, k_tiles, 4, 16, 4).swapaxes(-1, -2)
    codes = kv_cache.transpose(0, 3, 1, 2, 4).reshape(len(plane), dim // 2)
    return codes, kv_scale.reshape(blocks, k_tiles, 4, 64).transpose(0, 3, 1, 2).reshape(len(plane), dim // 32)


def _declared_format(target: str, numerics: str, kv_cache_dtype: str, capsys) -> dict:
    assert cli(["inspect", "flash", "--target", target, "--numerics", numerics, "--kv-cache-dtype",
                kv_cache_dtype, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _store_kernels(target: str, numerics: str, kv_cache_dtype: str) -> dict:
    """The store kernels the compiler picks for flash under the target's plan (the program's
    pool formats come from the plan alone, so the exact-numerics program serves every plan)."""
    cfg = resolve_model("flash")
    specs, _ = kernel_table(run_pipeline(trace(cfg, "exact")), plan_for(cfg, target, numerics, kv_cache_dtype))
    return {spec.factory: spec for spec in specs.values() if spec.factory in ("store_main_fp8", "store_rows")
            and (spec.factory != "store_rows" or spec.params.dim == cfg.index_head_dim)}


@pytest.mark.parametrize("target, numerics, kv_cache_dtype", [
    ("sm90", "exact", "auto"), ("gfx942", "exact", "auto"), ("gfx950", "exact", "auto"),
    ("llvm", "exact", "fp8"), ("llvm", "qat", "auto")])  # llvm: FP8 index rows, or (qat) FP4 row-major
def test_store_kernels_write_what_inspect_declares(target, numerics, kv_cache_dtype, capsys):
    """The target's store kernels, run on the CPU, write bytes that decode with the FP8 format and
    index layout `inspect --json` names (ml_dtypes and AITER's layout as the decoders) to the
    values the official round trips give."""
    declared = _declared_format(target, numerics, kv_cache_dtype, capsys)
    fp8_format, layout = declared["pool_fp8_format"], declared["index_layout"]
    assert fp8_format == ("e4m3fnuz" if target == "gfx942" else "e4m3fn")
    assert layout == ("gfx950_fp4_preshuffled" if target == "gfx950" else "row-major")
    stores = _store_kernels(target, numerics, kv_cache_dtype)
    cfg = resolve_model("flash")
    g = PoolGeometry.build(cfg, plan_for(cfg, target, numerics, kv_cache_dtype))
    pool = KVPool(g, g.window_rows_per_request + 2 * g.rows_per_envelope)
    assert declared["index_storage"] == g.index_storage and declared["main_storage"] == "fp8"
    rng = np.random.default_rng(7)
    nope, d = g.head_dim - g.rope_dim, g.index_head_dim

    spec = stores["store_main_fp8"]
    rows = _written_rows(rng, pool.total_rows, 16)
    values = _signed_zero_rows(rng, len(rows), g.head_dim)
    main = _run(_kernel(spec.factory, *spec.params), pool.planes["nope"], pool.planes["rope"], rows, values)
    codes, scales = main[0][rows, :nope], main[0][rows, nope:nope + nope // 64]
    got = _fp8_values(codes, fp8_format) * np.repeat(_e8m0_values(scales), 64, axis=1)
    assert np.array_equal(got, lowbit.fp8_roundtrip(values[:, :nope], 64))
    assert np.array_equal(main[1][rows].view(ml_dtypes.bfloat16).astype(F32),
                          lowbit.bf16_roundtrip(values[:, nope:]))
    assert not np.isnan(got).any()  # no -0 written as fnuz NaN

    spec = stores["store_rows"]
    assert spec.params.storage == g.index_storage
    rows = _written_rows(rng, len(pool.index_plane), 70)  # more than one 64-row tile
    values = _signed_zero_rows(rng, len(rows), d)
    plane = _run(_kernel(spec.factory, *spec.params), pool.index_plane, rows, values)[0]
    if g.index_storage == "fp8":
        scale = np.ascontiguousarray(plane[rows, d:]).view(F32)
        got = _fp8_values(plane[rows, :d], fp8_format) * scale
        fn_scale = np.maximum(np.abs(values).max(axis=1, keepdims=True), F32(1e-4)) / F32(448)
        want = lowbit.decode_e4m3fn(lowbit.encode_e4m3fn(values / fn_scale)) * fn_scale
    else:
        codes, scales = _fp4_rows(plane, layout, d)
        nibbles = lowbit.unpack_fp4(codes[rows]).view(ml_dtypes.float4_e2m1fn).astype(F32)
        got = nibbles * np.repeat(_e8m0_values(scales[rows]), 32, axis=1)
        want = lowbit.fp4_roundtrip(values, 32)
    assert np.array_equal(got, want)
    unwritten = np.setdiff1d(np.arange(len(pool.index_plane)), rows)
    if g.index_storage == "fp4":  # the layout put every byte of the written rows where the decoder looked
        assert not np.any(np.concatenate(_fp4_rows(plane, layout, d), axis=1)[unwritten])


def test_fp4_tiles_are_one_layers_envelope_rows():
    """gfx950's tiles hold 64 rows of one layer's envelope (AITER's block): a CSA ratio that gives
    another count is refused with the way out, and a layout the codec does not know is an error
    rather than another layout's bytes."""
    cfg = config_from_dict({**PARITY_CONFIGS["mixed_hc4"],
                            "compress_rates": {"compressed_sparse_attention": 8, "heavily_compressed_attention": 16}},
                           "csa8")
    with pytest.raises(UsageError, match="ratio 8 gives 32; use --kv-cache-dtype fp32"):
        PoolGeometry.build(cfg, plan_for(cfg, "gfx950"))
    g = PoolGeometry.build(preset("tiny"), plan_for(preset("tiny"), "gfx950"))
    assert g.index_layout == "gfx950_fp4_preshuffled" and g.index_rows_per_envelope % 64 == 0
    stale = KVPool(dataclasses.replace(g, index_layout="rowmajor"), g.window_rows_per_request + g.rows_per_envelope)
    with pytest.raises(UsageError, match="unknown FP4 index layout 'rowmajor'.*recompile"):
        stale.write_index(np.arange(3), np.ones((3, g.index_head_dim), F32))


# --------------------------------------------------------------------------- GPU builds


@pytest.mark.parametrize("target_name", ["sm90", "gfx942", "gfx950"])
def test_gpu_versions_build(target_name, monkeypatch):
    from dsv4c.codegen import gpu

    if target_name != "sm90":  # CUDA source needs no toolchain; AMDGPU code objects need ld.lld
        try:
            for key, value in gpu.rocm_environment().items():
                monkeypatch.setenv(key, value)
        except gpu.ToolchainError as e:
            pytest.skip(f"toolchain missing for {target_name}: {e}")
    target = tvm.target.Target(target_info(target_name).tvm)
    cfg = resolve_model("flash")  # the flash / pro pool shapes, in the target's pool format
    all_specs, _ = kernel_table(run_pipeline(trace(cfg, "exact")), plan_for(cfg, target_name))
    specs = {spec.symbol: spec for spec in all_specs.values()
             if spec.factory in ("store_main_fp8", "store_rows", "index_score", "sparse_attn")}
    assert {spec.factory for spec in specs.values()} == {"store_main_fp8", "store_rows", "index_score", "sparse_attn"}
    funcs = {name: gpu.gpu_kernel(spec, target).with_attr("global_symbol", name) for name, spec in specs.items()}
    device_module = tvm.compile(tvm.IRModule(funcs), target=target).mod.imports[0]
    source = device_module.inspect_source("cuda" if target_name == "sm90" else "asm")
    for name in specs:
        assert f"{name}_kernel" in source
