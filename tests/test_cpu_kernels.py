"""The CPU matmul kernels (``kernels.matmul.linear`` GEMV / GEMM, ``expert_linear``) against numpy
on edge shapes, in every weight format: rows that fill no register block, outputs that are not
a multiple of 64 (smaller column tiles), inputs that are not a multiple of the k block, groups,
experts with 0, 1, a few and many rows. Decode (GEMV), prefill (GEMM) and the expert kernel give
every row the same bits however many rows run together: the compiled step relies on it."""

import functools
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm.script import tirx as T

from dsv4c.codegen.kernel_factories import KERNELS
from dsv4c.codegen.kernels import attention, codecs, formats, gpu_index, gpu_topk, matmul
from dsv4c.codegen.kernels.cpu import CPU_PASS_CONFIG, cpu_vector
from dsv4c.codegen import step_kernels as S
from dsv4c.artifact import lowbit
from dsv4c.artifact.pool_rows import FP4_PRESHUFFLED, ROW_MAJOR, index_plane_row
from dsv4c.artifact.quant import Fp8Blocks
from dsv4c.targets import target_info

QUANTS = ("fp32", "fp8_b128", "fp8fnuz_b128", "fp8_b32", "fp4_g32", "bf16")  # fp8_b32: V4.1's 32 x 32 blocks


@functools.lru_cache(maxsize=None)
def _kernel(factory: str, *params, cpu: str | None = None):
    """The kernel built for ``cpu`` (an LLVM CPU name; None: this host), which its factory
    reads the vector width and registers of."""
    target = target_info("llvm").for_cpu(cpu).tvm_target()
    with target:
        func = KERNELS[factory](*params)
    return _kernel_of(func, target)


def _kernel_of(func, target=None):
    with tvm.transform.PassContext(config=CPU_PASS_CONFIG):
        return tvm.compile(tvm.IRModule({"k": func.with_attr("global_symbol", "k")}),
                           target=target or target_info("llvm").tvm_target())["k"]


def _call(kernel, *arrays):
    tensors = [tvm.runtime.tensor(np.ascontiguousarray(a)) for a in arrays]
    kernel(*tensors)
    return tensors[-1].numpy()


def _stored(rng, out_dim: int, in_dim: int, quant: str, lead: tuple = ()):
    """Random stored weight parts (``TirFormat.parts``) and the float64 matrix [*lead, O, I] they hold."""
    parts, fmt = [], formats.tir_format(quant).weight
    fp8 = isinstance(fmt, Fp8Blocks)
    for shape, dtype in formats.tir_format(quant).parts(out_dim, in_dim):
        shape = lead + shape
        if dtype == "float32":
            parts.append((rng.uniform(0.5, 2, shape) if parts else rng.standard_normal(shape)).astype(np.float32))
        elif dtype == "uint16":
            parts.append((rng.standard_normal(shape).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16))
        elif dtype == "int32":  # FP4 codes, eight per word
            parts.append(rng.integers(-2**31, 2**31, shape, dtype=np.int64).astype(np.int32))
        elif parts:  # E8M0 scales of FP4 groups
            parts.append(rng.integers(120, 134, shape, dtype=np.uint8))
        else:
            codes = rng.integers(0, 256, shape, dtype=np.uint8)
            if fp8 and fmt.fp8_format == "e4m3fn":
                codes[(codes & 0x7F) == 0x7F] = 0  # the NaN codes
            elif fp8:
                codes[codes == 0x80] = 0
            parts.append(codes)
    w = parts[0]
    if fp8:
        values = lowbit.decode_fp8(w, fmt.fp8_format).astype(np.float32) * \
            np.repeat(parts[1], fmt.group, axis=-2)[..., :in_dim, :]
    elif quant == "fp4_g32":
        codes = np.stack([(w >> (4 * j)) & 15 for j in range(8)], axis=-2).astype(np.uint8)  # input 8i + j
        values = lowbit.decode_e2m1(codes).reshape(w.shape[:-2] + (in_dim, w.shape[-1])) * \
            np.repeat(np.ldexp(np.float32(1), parts[1].astype(np.int32) - 127), 32, axis=-2)
    elif quant == "bf16":
        values = (w.astype(np.uint32) << 16).view(np.float32)
    else:
        values = w
    # [*, O / tile, I, tile] -> [*, O, I]
    values = np.moveaxis(values, -1, -2)
    return parts, values.reshape(lead + (out_dim, in_dim)).astype(np.float64)


def _close(got, want):
    scale = np.abs(want).max() + 1e-30
    assert np.abs(got - want).max() <= 1e-5 * scale


def _gemm(out_dim, in_dim, quant, x, parts, groups=0, cpu=None):
    """GEMM over x [n, (G,) I] zero-padded to blocks of GEMM_ROWS, groups one after another, as
    the prefill function calls it (its pad_rows)."""
    n, lead = x.shape[0], x.shape[1:-1]
    blocks = -(-n // matmul.GEMM_ROWS)
    padded = np.zeros(lead + (blocks * matmul.GEMM_ROWS, in_dim), np.float32)
    padded[..., :n, :] = np.moveaxis(x, 0, -2)
    y = np.zeros((blocks, matmul.GEMM_ROWS) + lead + (out_dim,), np.float32)
    kernel = _kernel("linear", out_dim, in_dim, quant, False, groups, cpu=cpu)
    return _call(kernel, padded.reshape(lead + (blocks, matmul.GEMM_ROWS, in_dim)), *parts, y).reshape(
        (-1,) + lead + (out_dim,))[:n]


def _gemv(out_dim, in_dim, quant, x, parts, groups=0, cpu=None):
    kernel = _kernel("linear", out_dim, in_dim, quant, True, groups, cpu=cpu)
    return _call(kernel, x, *parts, np.zeros(x.shape[:-1] + (out_dim,), np.float32))


# Kernels built for this host and for any AVX2 CPU: an AVX-512 host runs both loop shapes (an
# AVX2 host builds the same code twice; test_matmul_kernels_build_for_avx512 covers AVX-512 there).
CPUS = [None, "x86-64-v3"]


@pytest.mark.parametrize("cpu", CPUS)
@pytest.mark.parametrize("quant, out_dim, in_dim", [
    (quant, out_dim, in_dim) for quant in QUANTS
    for out_dim, in_dim in [(192, 4 * 128 + 64), (64, 1024), (80, 96), (24, 160), (12, 64)]
    if quant != "fp4_g32" or in_dim % 32 == 0])  # FP4 groups are 32 inputs
def test_linear_gemv_and_gemm_match_numpy_and_each_other(quant, out_dim, in_dim, cpu):
    """Tiles of 64, 16, 8 and 1 column(s), narrower than a vector; k not a multiple of the scale block or of the panel's k
    block, or several k blocks of several scale groups each (1024); 1 to 4 decode rows; prefill
    rows in a half register block (3), a half block and single rows (5), whole blocks and one
    row (13 on blocks of 6: AVX2's, and every scaled format's) or many (37)."""
    rng = np.random.default_rng(out_dim + in_dim)
    parts, w = _stored(rng, out_dim, in_dim, quant)
    x = rng.standard_normal((37, in_dim)).astype(np.float32)
    want = x.astype(np.float64) @ w.T
    prefill = _gemm(out_dim, in_dim, quant, x, parts, cpu=cpu)
    _close(prefill, want)
    for n in (3, 5, 13):
        assert np.array_equal(_gemm(out_dim, in_dim, quant, x[:n], parts, cpu=cpu), prefill[:n])
    for n in (1, 2, 3, 4):
        decode = _gemv(out_dim, in_dim, quant, x[:n], parts, cpu=cpu)
        _close(decode, want[:n])
        assert np.array_equal(decode, prefill[:n])  # decode and prefill give the same bits
    # The GEMV kernel takes any row count (GEMV_ROWS at a time).
    assert np.array_equal(_gemv(out_dim, in_dim, quant, x[:9], parts, cpu=cpu), prefill[:9])


@pytest.mark.parametrize("cpu", CPUS)
@pytest.mark.parametrize("quant", QUANTS)
def test_gemm_over_several_chunks_of_rows(quant, cpu):
    """1100 rows: more than one chunk of rows whose x k block fits X_CHUNK_BYTES (1024 rows of
    the unscaled formats' 64-input k blocks, 252 of the scaled formats' 256) and a partial last
    one. The chunked GEMM gives the GEMV's bits."""
    rng = np.random.default_rng(11)
    out_dim, in_dim, n = 64, 256, 1100
    assert n > matmul.X_CHUNK_BYTES // (4 * 64)
    parts, w = _stored(rng, out_dim, in_dim, quant)
    x = rng.standard_normal((n, in_dim)).astype(np.float32)
    prefill = _gemm(out_dim, in_dim, quant, x, parts, cpu=cpu)
    _close(prefill, x.astype(np.float64) @ w.T)
    assert np.array_equal(prefill, _gemv(out_dim, in_dim, quant, x, parts, cpu=cpu))


@pytest.mark.parametrize("quant", QUANTS)
def test_small_inputs_keep_full_precision(quant):
    """Tiny activations times small weights: each output within 1e-5 of the sum of its terms'
    magnitudes, so no product or partial sum loses bits in float32's subnormal range (the
    low-bit kernels sum raw codes, whose float32 values are tiny, see ``kernels.formats.X_BOOST``)."""
    rng = np.random.default_rng(3)
    out_dim, in_dim = 64, 256
    parts, w = _stored(rng, out_dim, in_dim, quant)
    x = (rng.standard_normal((5, in_dim)) * 1e-8).astype(np.float32)
    want, magnitude = x.astype(np.float64) @ w.T, np.abs(x.astype(np.float64)) @ np.abs(w).T
    for got in (_gemv(out_dim, in_dim, quant, x[:1], parts), _gemm(out_dim, in_dim, quant, x, parts)):
        assert np.all(np.abs(got - want[:len(got)]) <= 1e-5 * magnitude[:len(got)])


@pytest.mark.parametrize("quant", ["fp32", "fp8_b128"])
def test_grouped_linear(quant):
    rng = np.random.default_rng(5)
    groups, out_dim, in_dim = 3, 64, 256
    parts, w = _stored(rng, out_dim, in_dim, quant, (groups,))
    x = rng.standard_normal((11, groups, in_dim)).astype(np.float32)
    want = np.einsum("ngi,goi->ngo", x.astype(np.float64), w)
    prefill = _gemm(out_dim, in_dim, quant, x, parts, groups)
    _close(prefill, want)
    decode = _gemv(out_dim, in_dim, quant, x[:2], parts, groups)
    assert np.array_equal(decode, prefill[:2])


@pytest.mark.parametrize("cpu", CPUS)
@pytest.mark.parametrize("quant", ["fp32", "fp4_g32", "fp8_b128"])
def test_expert_linear_groups_of_every_size(quant, cpu):
    """Experts with 0, 1, 4 (the decode loop), 5, 13 and 30 rows (the panel loop, with a partial
    register block); each row equals the dense GEMV of its expert bit for bit."""
    rng = np.random.default_rng(9)
    experts, out_dim, in_dim = 6, 80, 256
    parts, w = _stored(rng, out_dim, in_dim, quant, (experts,))
    sizes = [5, 0, 1, 13, 4, 30]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    x = rng.standard_normal((offsets[-1], in_dim)).astype(np.float32)
    kernel = _kernel("expert_linear", out_dim, in_dim, quant, experts, cpu=cpu)
    y = _call(kernel, x, offsets, *parts, np.zeros((offsets[-1], out_dim), np.float32))
    for e in np.flatnonzero(sizes):
        rows = slice(offsets[e], offsets[e + 1])
        _close(y[rows], x[rows].astype(np.float64) @ w[e].T)
        assert np.array_equal(y[rows], _gemv(out_dim, in_dim, quant, x[rows], [p[e] for p in parts], cpu=cpu))


def test_register_tile_fits_the_vector_registers():
    """AVX2 (16 registers of 8 floats) and AVX-512 (32 of 16): the accumulators take 3/8 of the
    registers; a column tile narrower than two vectors is one block of its own width. Scaled
    formats take 6 rows of their 16-column panel: on AVX-512 one vector each, whose totals fit
    beside them (6 + 6 of 32 registers)."""
    for mcpu, lanes, tile in (("haswell", 8, (6, 16)), ("znver3", 8, (6, 16)), ("skylake-avx512", 16, (12, 32))):
        with tvm.target.Target({"kind": "llvm", "mcpu": mcpu}):
            assert cpu_vector()[0] == lanes
            assert matmul.register_tile(64, False) == tile
            assert matmul.register_tile(8, False) == (tile[0], 8)
            assert matmul.register_tile(matmul.SCALED_PANEL_COLUMNS, True) == (6, 16)


def _cross_built_asm(mcpu: str, factory: str, *params) -> str:
    """The assembly of a kernel built for ``mcpu``, which this machine may lack."""
    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "mtriple": "x86_64-linux-gnu"})
    with target:
        func = KERNELS[factory](*params)
    with tvm.transform.PassContext(config=CPU_PASS_CONFIG):
        lib = tvm.compile(tvm.IRModule({"k": func.with_attr("global_symbol", "k")}), target=target)
    return lib.mod.inspect_source("asm") if hasattr(lib, "mod") else lib.inspect_source("asm")


@pytest.mark.parametrize("factory, params", [("expert_linear", (2048, 4096, "fp4_g32", 16)),
                                             ("linear", (4096, 4096, "fp8_b128", False)),
                                             ("linear", (4096, 4096, "fp8_b128", True))])
def test_matmul_kernels_build_for_avx512(factory, params):
    """This machine may lack AVX-512, so the 16-lane loops and the micro-kernels are cross-built
    for znver4 (running them is the bench's job there, and the other tests' on such a machine):
    512-bit FMAs come out, FP4 codes go through the vpermps table, and the decode loops
    prefetch the weights they stream."""
    asm = _cross_built_asm("znver4", factory, *params)
    assert any("vfmadd" in line and "zmm" in line for line in asm.splitlines())
    if "fp4_g32" in params:
        assert any("vperm" in line and "zmm" in line for line in asm.splitlines())
    if factory == "expert_linear" or params[-1] is True:  # a kernel that runs decode steps
        assert "prefetcht0" in asm


@pytest.mark.parametrize("mcpu", ["znver4", "x86-64-v3"])
def test_bf16_gemv_prefetches_where_it_was_measured_to_help(mcpu):
    """PREFETCH_BYTES_BY_CPU reaches the built code: Zen 4 streams BF16 weights fastest without
    software prefetch; other CPUs (Zen 3's measurement) prefetch them, and FP8 everywhere."""
    asm = {quant: _cross_built_asm(mcpu, "linear", 1024, 1024, quant, True) for quant in ("bf16", "fp8_b128")}
    assert ("prefetcht0" in asm["bf16"]) == (mcpu != "znver4")
    assert "prefetcht0" in asm["fp8_b128"]


def test_decoders_match_lowbit_on_every_code():
    """The float16-based decoders give lowbit's values for all 256 FP8 codes of both formats
    (subnormals included) and all 16 e2m1 codes of an FP4 word, at its bottom (codes 0, 1) and
    its top (codes 6, 7, the word's sign bit)."""
    from tvm.script import tirx as T

    @T.prim_func
    def decode(codes: T.handle, out: T.handle):
        C = T.match_buffer(codes, (256,), "uint8")
        OUT = T.match_buffer(out, (256, 6), "float32")
        for i in T.serial(256):
            OUT[i, 0] = codecs.decode_e4m3fn(C[i])
            OUT[i, 1] = codecs.decode_e4m3fnuz(C[i])
            OUT[i, 2] = codecs.decode_fp4_word(T.Cast("int32", C[i]), 0)
            OUT[i, 3] = codecs.decode_fp4_word(T.Cast("int32", C[i]), 1)
            OUT[i, 4] = codecs.decode_fp4_word(T.shift_left(T.Cast("int32", C[i]), 24), 6)
            OUT[i, 5] = codecs.decode_fp4_word(T.shift_left(T.Cast("int32", C[i]), 24), 7)

    kernel = tvm.compile(tvm.IRModule({"k": decode.with_attr("global_symbol", "k")}),
                         target=target_info("llvm").tvm_target())["k"]
    codes = np.arange(256, dtype=np.uint8)
    out = _call(kernel, codes, np.zeros((256, 6), np.float32))
    fn = lowbit.decode_e4m3fn(codes)
    finite = (codes & 0x7F) != 0x7F
    np.testing.assert_array_equal(out[finite, 0], fn[finite])
    np.testing.assert_array_equal(np.signbit(out[:, 0]), codes >= 128)
    fnuz = lowbit.decode_e4m3fnuz(codes)
    np.testing.assert_array_equal(out[codes != 0x80, 1], fnuz[codes != 0x80])
    for column in (2, 4):
        np.testing.assert_array_equal(out[:, column], lowbit.decode_e2m1(codes & 15))
        np.testing.assert_array_equal(out[:, column + 1], lowbit.decode_e2m1(codes >> 4))
        np.testing.assert_array_equal(np.signbit(out[:, column]), (codes & 8) > 0)
        np.testing.assert_array_equal(np.signbit(out[:, column + 1]), codes >= 128)


def test_a_process_that_flushes_subnormals_is_refused():
    """The low-bit kernels decode codes through float32 subnormals; a thread with MXCSR's DAZ / FTZ
    set (here by torch, as -ffast-math libraries do when they load) would drop small weights, so
    loading refuses it with a one-line error instead."""
    import torch

    from dsv4c.errors import UsageError
    from dsv4c.runtime.backend_tvm import check_subnormals

    check_subnormals(Path("model"))  # this process keeps subnormals
    torch.set_flush_denormal(True)
    try:
        with pytest.raises(UsageError, match="flushes float32 subnormals to zero"):
            check_subnormals(Path("model"))
    finally:
        torch.set_flush_denormal(False)


def test_vector_exp_is_within_two_ulp_of_exp():
    """The vectorizable exp (softmax weights, SiLU) against float64 exp over float32's range."""
    n = 1 << 16

    @T.prim_func
    def f(x: T.Buffer((n,), "float32"), y: T.Buffer((n,), "float32")):
        for i in range(n // 8):
            for j in T.vectorized(8):
                y[i * 8 + j] = codecs.vector_exp(x[i * 8 + j])

    x = np.concatenate([np.linspace(-87.3, 88.3, n - 4), [-1e4, -100.0, 0.0, 100.0]]).astype(np.float32)
    y = _call(_kernel_of(f), x, np.zeros(n, np.float32))
    want = np.exp(x.astype(np.float64))
    inside = slice(0, n - 4)
    assert np.all(np.abs(y[inside] - want[inside]) <= 2.5e-7 * want[inside])
    assert y[-4] < 1e-37 and y[-3] < 1e-37 and y[-2] == 1.0 and 2e38 < y[-1] < np.inf  # clamped, finite


def test_swiglu_matches_numpy():
    """SiLU of the clamped gate times the clipped up projection, in vectors (``vector_exp``)."""
    rng = np.random.default_rng(2)
    g, u = (rng.standard_normal((2, 3, 512)) * 8).astype(np.float32)
    got = _call(_kernel("swiglu", 512, 10.0), g, u, np.zeros_like(g))
    gate = np.minimum(g.astype(np.float64), 10.0)
    want = gate / (1 + np.exp(-gate)) * np.clip(u, -10.0, 10.0)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("cpu", CPUS)
def test_sparse_attn_matches_numpy_however_many_heads_at_once(cpu):
    """Softmax attention over each query's row list, the sink in the denominator only: pool rows,
    this step's fresh rows (>= the pool's), -1 gaps and a whole block of them, a list that is
    not a multiple of the row block. Two heads at once (the default), one or all eight of a
    block give the same bits, and so do the decode steps' blocks of 8 heads and prefill's of
    all 16, built for this host and for any AVX2 CPU (whose 16 registers split the block's
    rows and the head dim between two heads: other loops)."""
    rng = np.random.default_rng(9)
    heads, dim, n, pool_rows, step_rows, m = 16, 64, 3, 40, 5, 21
    q = rng.standard_normal((n, heads, dim)).astype(np.float32)
    pool = rng.standard_normal((pool_rows, dim)).astype(np.float32)
    step = rng.standard_normal((step_rows, dim)).astype(np.float32)
    sink = rng.standard_normal(heads).astype(np.float32)
    rows = rng.integers(0, pool_rows + step_rows, (n, m)).astype(np.int32)
    rows[0, 8:16] = -1  # a block without rows
    rows[1, ::3] = -1
    rows[2, 17:] = -1
    blocks = [(attention.ATTN_HEAD_BLOCK, 1), (attention.ATTN_HEAD_BLOCK, 2), (attention.ATTN_HEAD_BLOCK, 8), (attention.ATTN_PREFILL_HEAD_BLOCK, 0)]
    got = [_call(_kernel("sparse_attn", heads, dim, 0.125, "fp32", 0, None, block, h, cpu=cpu), q, pool, step, sink,
                 rows, np.zeros((n, heads, dim), np.float32)) for block, h in blocks]
    assert all(np.array_equal(got[0], other) for other in got[1:])
    kv = np.concatenate([pool, step]).astype(np.float64)
    for t in range(n):
        picked = kv[rows[t][rows[t] >= 0]]
        scores = q[t].astype(np.float64) @ picked.T * 0.125  # [heads, rows]
        top = np.maximum(scores.max(1), sink)[:, None]
        weights = np.exp(scores - top)
        want = weights @ picked / (weights.sum(1, keepdims=True) + np.exp(sink[:, None] - top))
        np.testing.assert_allclose(got[0][t], want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("heads", [12, 3])
def test_index_score_matches_numpy_on_every_cpu_level(heads):
    """Index scores of each query's entries: 70 entries (two whole blocks of 32 and a partial
    one), -1 rows scored -inf. 12 heads run 4 at a time built for an AVX-512 host (8 heads' 2
    vectors of accumulators; gcd 4), 2 at a time for AVX2; 3 heads one at a time. Every build
    sums each dot product in input order and adds the heads in order: the same bits."""
    rng = np.random.default_rng(heads)
    dim, n, pool_rows, entries = 64, 3, 50, 70
    q = rng.standard_normal((n, heads, dim)).astype(np.float32)
    w = rng.standard_normal((n, heads)).astype(np.float32)
    pool = rng.standard_normal((pool_rows, dim)).astype(np.float32)
    rows = rng.integers(0, pool_rows, (n, entries)).astype(np.int32)
    rows[1, ::4] = -1
    got = [_call(_kernel("index_score", heads, dim, cpu=cpu), q, w, pool, rows, np.zeros((n, entries), np.float32))
           for cpu in CPUS]
    assert np.array_equal(got[0], got[1])
    dots = np.einsum("thd,ted->the", q.astype(np.float64), pool[np.maximum(rows, 0)].astype(np.float64))
    want = np.einsum("th,the->te", w.astype(np.float64), np.maximum(dots, 0)) * (heads * dim) ** -0.5
    want[rows < 0] = codecs.NEG_INF
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("storage, layout", [("fp32", None), ("fp8", ROW_MAJOR), ("fp4", ROW_MAJOR),
                                             ("fp4", FP4_PRESHUFFLED)])
def test_gpu_index_score_gives_the_panel_kernels_bits(storage, layout):
    """GPU targets score a block of entries per block of threads (``kernels.gpu_index``, its
    phases run in turn here); the sums run in the same order, so the same bits as the CPU's
    panel kernel, on every index row format (random bytes: every code, NaN included), with
    more entries than a block and a last block part full."""
    rng = np.random.default_rng(7)
    heads, dim, n, pool_rows, entries = 6, 64, 3, 64, 45  # whole tiles of preshuffled rows
    width, dtype = index_plane_row(dim, storage)
    pool = rng.standard_normal((pool_rows, width)).astype(np.float32) if dtype == "float32" else \
        rng.integers(0, 256, (pool_rows, width), dtype=np.uint8)
    q = rng.standard_normal((n, heads, dim)).astype(np.float32)
    w = rng.standard_normal((n, heads)).astype(np.float32)
    rows = rng.integers(0, pool_rows, (n, entries)).astype(np.int32)
    rows[2, ::3] = -1
    fmt = None if storage == "fp32" else "e4m3fn"
    got = [_call(kernel, q, w, pool, rows, np.zeros((n, entries), np.float32)) for kernel in (
        _kernel("index_score", heads, dim, storage, fmt, layout),
        _kernel_of(gpu_index.index_score_blocked(heads, dim, storage, fmt, layout, emulate=True)))]
    np.testing.assert_array_equal(got[1], got[0])
    assert np.isfinite(got[0][rows >= 0]).any() and (got[0][rows < 0] == codecs.NEG_INF).all()


@pytest.mark.parametrize("k, columns, blocked", [(6, 16, False), (8, 3, False), (512, 100, False), (512, 512, False),
                                                 (512, 1500, False), (6, 16, True), (8, 3, True), (512, 1500, True),
                                                 (16, 5000, True)])
def test_topk_rows_matches_a_stable_sort(k, columns, blocked):
    """The k largest of each row, best first, lower columns first among equal values (-0 equal
    to +0); NEG_INF, -inf and NaN never picked, -1 where fewer than k columns can be: fewer
    columns than k, a row of ties, masked halves, rows that need the threshold search. Also the
    GPU targets' kernel (``kernels.gpu_topk``, ``blocked``: a block of threads per row) with its
    phases run in turn here: fewer columns than threads, uneven chunks, ties across chunks."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((8, columns)).astype(np.float32)
    x[:, ::5] = np.round(x[:, ::5])  # ties
    x[0, :columns // 2] = codecs.NEG_INF
    x[1, 1::3] = -np.inf
    x[2, ::7] = np.nan
    x[3, ::4], x[3, 1::4] = 0.0, -0.0
    x[4] = 1.0
    x[5, 2::3] = np.inf
    kernel = _kernel_of(gpu_topk.topk_rows_blocked(k, emulate=True)) if blocked else _kernel("topk_rows", k)
    got = _call(kernel, x, np.zeros((8, k), np.int32))
    for row, ids in zip(x, got):
        pickable = np.flatnonzero(row > np.float32(codecs.NEG_INF))  # NaN compares false
        best = pickable[np.argsort(-row[pickable].astype(np.float64) + 0.0, kind="stable")][:k]
        np.testing.assert_array_equal(ids, np.concatenate([best, np.full(k - len(best), -1)]))


@pytest.mark.parametrize("dim, rope_dim, weighted", [(512, 64, True), (512, 64, False), (12, 4, True), (6, 2, False)])
def test_rmsnorm_rope_matches_numpy(dim, rope_dim, weighted):
    """Each head's rmsnorm (its sum of squares in vector lanes: 8, 4 or 2 of them by the head
    dim) then the GPT-J rotation of the trailing rope_dim channels, against float64 numpy."""
    rng = np.random.default_rng(3)
    heads, n = 3, 5
    x = (rng.standard_normal((n, heads, dim)) * 4).astype(np.float32)
    w = rng.uniform(0.5, 2, dim).astype(np.float32)
    pos = rng.integers(0, 5000, n).astype(np.int32)
    inv = (10000.0 ** -(np.arange(rope_dim // 2) / (rope_dim // 2))).astype(np.float32)
    args = (x, w) if weighted else (x, np.ones(dim, np.float32))  # an unweighted kernel ignores w
    got = _call(_kernel("rmsnorm_rope", heads, dim, rope_dim, 1e-6, weighted), *args, pos, inv, np.zeros_like(x))
    x64 = x.astype(np.float64)
    normed = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6) * (w if weighted else 1)
    angle = pos[:, None].astype(np.float32) * inv  # float32 angles, as the kernel takes them
    cos, sin = np.cos(angle.astype(np.float64))[:, None], np.sin(angle.astype(np.float64))[:, None]
    a, b = normed[..., dim - rope_dim::2], normed[..., dim - rope_dim + 1::2]
    want = normed.copy()
    want[..., dim - rope_dim::2], want[..., dim - rope_dim + 1::2] = a * cos - b * sin, b * cos + a * sin
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("factory, params", [
    ("rope", (64, 512, 64, False)), ("rmsnorm_rope", (64, 512, 64, 1e-6, True)),
    ("mhc", (4, 256, 20, 1e-6, 1e-6, True, False)), ("sparse_attn", (8, 64, 0.125)), ("swiglu", (256, 10.0)),
    ("linear", (256, 512, "fp8_b128", True)), ("expert_linear", (256, 512, "fp4_g32", 4)),
    ("index_score", (8, 64)), ("compress_pool", (128, 64, 4, True)), ("ring_update", (128, 4, True)),
    ("store_rows", (64, "fp32")), ("topk_rows", (512,)), ("rmsnorm", (64, 1e-6, True)),
    ("step_kernels.window_rows", (128, 128)), ("step_kernels.compress_windows", (4, True)),
    ("step_kernels.attention_rows", (128, 128, 4, "topk")), ("step_kernels.moe_combine", (64, 6))])
def test_kernels_allocate_nothing_from_the_workspace_pool(factory, params):
    """TVM lowers a named TIR index (``h = ...``) and a local buffer without the on-stack
    annotation to TVMBackendAllocWorkspace / FreeWorkspace calls, which cost rmsnorm_rope 7x its
    arithmetic when they ran per head. These kernels' loops (per head, per token, per row) make none."""
    module, _, name = factory.rpartition(".")
    func = (getattr(S, name) if module else KERNELS[name])(*params)
    with tvm.transform.PassContext(config=CPU_PASS_CONFIG):
        lib = tvm.tirx.build(tvm.IRModule({"k": func.with_attr("global_symbol", "k")}),
                             target=target_info("llvm").tvm_target())
    assert "TVMBackendAllocWorkspace" not in lib.inspect_source("asm")
