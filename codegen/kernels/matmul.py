"""The matmul kernels: ``linear`` (GEMV and GEMM over column-tiled weights) and ``expert_linear``
(each routed expert's rows), in any weight format of ``kernels.formats``."""

from __future__ import annotations

import functools
import math

from tvm import te
from tvm.script import tirx as T

from dsv4c.codegen.kernels.bf16 import (AMX_ROWS, DOT_IR, DOT_LANES, dot, has_amx_bf16, has_bf16_dot, pair, rounded,
                                        rounded_pairs, tile_ir, tile_products)
from dsv4c.codegen.kernels.codecs import F32, raw_e4m3_slot
from dsv4c.codegen.kernels.cpu import ON_STACK, cpu_target, cpu_vector
from dsv4c.codegen.kernels.formats import TirFp8Blocks, boosted, column_tile, tir_format

GEMM_ROWS = 8  # the prefill function pads a matmul's rows to blocks of 8 (see relax_step.matmul)
GEMV_ROWS = 4  # rows the decode loop accumulates together, each weight decoded once for all of them
# The GEMM takes its rows in chunks whose x k block (rows x k block of fp32) fits in this many
# bytes, so that the block stays in L2 while each of the tile's panels runs over it. All rows at
# once, a long prefill's k block (2048 rows of FP8: 2 MiB) spilled to L3; chunks of 256 KiB ran
# fastest of 128, 256 and 512 KiB (bench/RESULTS.md).
X_CHUNK_BYTES = 256 * 1024
PANEL_FLOATS = 4096  # a decoded weight panel (columns x k block): 16 KiB, L1-resident
SCALED_PANEL_COLUMNS = 16  # a scaled format's panel: 16 columns by 256 inputs (see _matmul_loops)
SCALED_ROWS = 6  # rows of a scaled format's register tile (see register_tile)
DOT_SCALED_PANEL_COLUMNS = 32  # a scaled format's panel in the bf16 mode on AVX512-BF16 (see _matmul_loops)
# How far ahead (bytes) the decode loop prefetches the weight tile it streams, where a CPU (an
# LLVM CPU name: what the kernels are built for) was measured to differ from its format's
# distance (``TirFormat.prefetch_bytes``). Zen 4 streams BF16 at the rate of a plain streaming
# sum over the same bytes without the prefetch, faster than with it; its FP8 and FP4 rates did
# not change with it. Zen 5 (znver5) keeps the formats' distances: each was the best or within
# noise of it there (bench/RESULTS.md).
PREFETCH_BYTES_BY_CPU = {"znver4": {"bf16": 0}}
ACC_VECTORS = 8  # vector registers of the direct loop's accumulators: half of AVX2's


def prefetch_bytes(quant: str) -> int:
    """How far ahead the decode loop prefetches a ``quant`` weight tile on the CPU the kernels are
    built for (the format's, or PREFETCH_BYTES_BY_CPU's); 0: not at all."""
    by_cpu = PREFETCH_BYTES_BY_CPU.get(str(cpu_target().attrs.get("mcpu", "")), {})
    return by_cpu.get(quant, tir_format(quant).prefetch_bytes)


def register_tile(tile: int, scaled: bool) -> tuple[int, int]:
    """(rows, columns) of the GEMM micro-kernel's accumulators, which stay in vector registers:
    two vectors of columns (at most the weight tile) by as many rows as fill 3/8 of the
    registers (AVX2: 6 x 16, 12 accumulators; AVX-512: 12 x 32, 24), leaving the rest to the two
    weight vectors and a broadcast. More independent FMA chains than the 8 that two FMA pipes
    of latency 4 need: 4 rows ran 3-13% slower on Zen 3 (bench/RESULTS.md).

    Scaled formats (FP8, FP4) keep each output's running total beside its group sum, so they
    take SCALED_ROWS rows: on AVX-512 the 6 accumulators and 6 totals of a 16-column panel stay
    in registers (12 rows, which spill the totals, ran 1.25x slower on Zen 4); AVX2 spills its
    totals to the stack either way, and 6 rows beat 3 or 4 there (x86-64-v3 code on Zen 4)."""
    lanes, registers = cpu_vector()
    return SCALED_ROWS if scaled else registers * 3 // 8, math.gcd(tile, 2 * lanes)


def _matmul_loops(out_dim: int, in_dim: int, quant: str, grouped_rows: bool, columns=T.vectorized, cpu: bool = True,
                  group_major_x: bool = False, compute: str = "fp32"):
    """The CPU matmul's loops over a range of rows of x [P, (G,) I] (``group_major_x``: x [G, P, I])
    -> y [P, (G,) O] for one column
    tile ``a`` of weight ``w`` (a group or an expert: the parts' leading index), shared by
    ``linear`` and ``expert_linear``. Every output is summed in input order the same way, whichever
    loop runs it and however many rows there are, so results do not depend on the step's size
    (the decode and prefill functions agree bit for bit): from zero with one accumulator; for
    scaled formats (FP8, FP4), the boosted raw products (``weight_raw``, ``boosted``) of each
    group of ``group`` inputs (within one scale group) are summed from zero, and each group's
    sum, scaled (``group_scale``), is added to the output's total in group order.

    ``direct``: up to GEMV_ROWS rows at a time, the weight tile streamed once in memory order
    and decoded in registers (decode steps). For each group, the tile's columns go in chunks
    whose accumulators (rows x chunk) fill ``ACC_VECTORS`` vector registers (FP4: half; FP8
    chunks of four vectors or more sum in slot order, see ``slotted``); the group's codes are
    re-read from L1 by the later chunks, and (scaled formats) its x, boosted once into a stack
    buffer, is broadcast from there.
    ``panel``: for each chunk of rows (X_CHUNK_BYTES), each k block of whole groups and each
    panel of columns, the weights are decoded once into an L1 panel (fp32 weights are read in
    place), then a register-tiled micro-kernel (``register_tile``) runs every block of rows over it: unscaled, its running
    sums go to y; scaled, each group's sum is added to the output's total, which it keeps beside
    the sums over the k block's groups (from y, zero in the first block) and then writes to y.

    ``compute`` "bf16" (FP8, FP4 and BF16 weights): the panel loop multiplies x rounded to BF16
    by the weights (exactly BF16 values), summed in fp32 the same way (``kernels.bf16``): with
    vdpbf16ps where the CPU has AVX512-BF16 and the panel is whole vectors (``pairs``: the panel
    and x held as BF16 pairs of consecutive inputs, x rounded once for all column tiles by
    ``round_row``, which the kernels run first), else with fp32 FMAs on the rounded x. The
    direct loop (decode steps) stays exact. Where the CPU also has AMX-BF16
    (``amx``), the micro-kernel takes blocks of up to AMX_ROWS rows (the last one the rows left)
    and runs their products on AMX tiles (``bf16.tile_ir``): every group's sums (scaled), or the
    k block's running sums, come from one call of the tile function; the scaling into the
    totals stays the same.

    GPU builds (not ``cpu``) run the direct loop on weight values (``TirFormat.value``): their
    float32 arithmetic may flush the raw codes' subnormals."""
    fmt = tir_format(quant)
    if compute not in ("fp32", "bf16") or (compute == "bf16" and not (cpu and fmt.decoded)):
        raise ValueError(f"matmul: no {compute} compute for {quant} weights on this target")
    tile = column_tile(out_dim)
    scaled = cpu and fmt.scaled
    packed = fmt.inputs_per_word > 1  # FP4: a word of eight codes
    # Groups: FP8 blocks (128 or 32 inputs), FP4 scale groups of 32. The CPU's direct loop unrolls k by up
    # to 4 inside a group, FP4 by a word's 8 codes with half the accumulators (with 8, LLVM keeps
    # the words of all chunks live at once and spills them). GPU builds take one input at a
    # time: unrolled, LLVM's AMDGPU backend spent ~27 s on each FP4 expert kernel of Flash (2 s
    # rolled), for a thread whose tile of accumulators does not fit in registers anyway.
    group = math.gcd(in_dim, fmt.group if scaled or packed else 4)
    unroll = math.gcd(group, fmt.inputs_per_word if packed else 4) if cpu else 1
    acc_vectors = ACC_VECTORS // 2 if packed else ACC_VECTORS
    # The panel: kc inputs (whole groups when scaled) x pw columns, at most PANEL_FLOATS floats.
    # Scaled formats take narrow panels of many inputs: the micro-kernel writes its totals to y
    # once per k block, and 16 x 256 ran 1.1-1.4x faster than 32 x 128 for FP8 and FP4 on Zen 4
    # (AVX-512 and x86-64-v3 code alike, except FP8 on AVX2: even), single-threaded A/Bs.
    lanes = cpu_vector()[0] if cpu and columns is T.vectorized else tile
    bf16 = compute == "bf16"
    # bf16 by vdpbf16ps: its panel holds BF16 pairs, half the bytes of fp32, so twice the values
    # fit; scaled formats take panels of DOT_SCALED_PANEL_COLUMNS.
    dot_pairs = bf16 and columns is T.vectorized and lanes == DOT_LANES and group % 2 == 0 and has_bf16_dot()
    pw = math.gcd(tile, DOT_SCALED_PANEL_COLUMNS if dot_pairs else SCALED_PANEL_COLUMNS) if scaled else tile
    panel_values = PANEL_FLOATS * (2 if dot_pairs else 1)
    kc = next(b for b in (512, 256, 128, 64, 32, 16, 8, 4, 2, 1)
              if in_dim % b == 0 and b * pw <= max(panel_values, pw * group) and (not scaled or b % group == 0))
    pairs = dot_pairs and pw % DOT_LANES == 0 and kc % 2 == 0
    amx = pairs and has_amx_bf16()
    summed = group if scaled else kc  # inputs the micro-kernel sums before it scales or writes them
    # AMX: a tile step takes k_pairs pairs (16: a 64-byte row of x, where the group or k block
    # allows); one call sums every group of the k block (sum_blocks).
    k_pairs = math.gcd(summed // 2, 16) if amx else 0
    sum_blocks = kc // group if amx and scaled else 1
    rb, cols = register_tile(pw, scaled) if columns is T.vectorized else (1, 1)
    rb = AMX_ROWS if amx else rb
    chunk_rows = max(rb, X_CHUNK_BYTES // (4 * kc) // rb * rb)  # see X_CHUNK_BYTES
    half = rb // 2
    x_value = rounded if bf16 else (lambda x: x)  # noqa: E731  (the FMA micro-kernel's x)
    x_vector = math.gcd(in_dim, 32)  # inputs of x rounded into pairs at once
    x_copy = math.gcd(kc // 2, 16) if amx else 1  # AMX: pairs of x copied at once
    # FP4 codes by table where every vector holds 16 columns (AVX-512; see raw_e2m1_by_table):
    # a little faster, streamed and in cache (bench/RESULTS.md; the decode shares the vector
    # pipes with the FMAs, which the table does not remove).
    avx512_vectors = cpu and columns is T.vectorized and lanes == 16 and tile % 16 == 0
    decode = functools.partial(fmt.raw, avx512_vectors=avx512_vectors) if cpu else fmt.value
    at = (lambda r, g, i: (r, g, i)) if grouped_rows else (lambda r, g, i: (r, i))  # noqa: E731
    x_index = (lambda r, g, i: (g, r, i)) if group_major_x else at  # noqa: E731

    panel_value = boosted if scaled else (lambda w: w)  # noqa: E731  (the panel's decoded weights)

    def chunk(R):  # the direct loop's columns per chunk for R rows: a power-of-two count of vectors
        vectors = max(1, acc_vectors // R)
        return math.gcd(tile, (1 << (vectors.bit_length() - 1)) * lanes)

    def vector(R):  # the columns of one vector of a chunk (the whole chunk if narrower)
        return math.gcd(chunk(R), lanes)

    # Software prefetch of the streamed FP8 / BF16 / FP4 tile, prefetch_bytes ahead: each unrolled
    # step of the direct loop's first chunk touches the cache lines the reads will need that far
    # on. It brought the FP8 and BF16 GEMVs (Zen 3) and the FP4 experts (Zen 4, where the table
    # decodes fast enough for memory to matter) nearer the read bandwidth; fp32 streams near it
    # without and lost with it, four lines a row (bench/RESULTS.md). A stored row of the tile
    # (``parts[0]``'s second-to-last index) holds one input of FP8 / BF16, a word of eight of FP4.
    ahead_bytes = prefetch_bytes(quant) if cpu else 0
    prefetched = ahead_bytes > 0
    inputs_per_row = fmt.inputs_per_word
    row_bytes = tile * fmt.word_bytes
    step_lines = max(1, unroll // inputs_per_row * row_bytes // 64)
    ahead = max(1, ahead_bytes // row_bytes)

    @T.macro
    def prefetch(parts, w, a, k):  # k: the input the step starts at
        for line in T.unroll(step_lines):
            T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(parts[0][
                w, a, k // inputs_per_row + ahead + line * 64 // row_bytes, line * 64 % row_bytes * tile // row_bytes]),
                0, 3, 1))

    def x_at(X, xs, g, first, r, kg, i):  # the direct loop's x: input i of group kg, boosted when scaled
        return xs[r, i] if scaled else X[x_index(first + r, g, kg * group + i)]

    def total(previous, raw_sum, scale):  # a group's sum added to the total
        return previous + raw_sum * scale if scaled else raw_sum

    # FP8 chunks of at least four vectors go in slot order: each input's codes for the chunk's C
    # columns are read as C / 4 int32 words, and accumulator vector j (of C / 4) sums byte j of
    # every word, columns j, j + 4, ... (raw_e4m3_slot). Each group's sums are shuffled back to
    # column order before they are scaled; each column is still summed in input order, so the
    # bits do not change. The in-cache GEMV ran faster so at both code levels (bench/RESULTS.md).
    def slotted(R):
        return cpu and isinstance(fmt, TirFp8Blocks) and chunk(R) >= 4 * lanes

    def quarter(R):  # columns per slot vector
        return chunk(R) // 4

    @T.macro
    def slot_fma(X, xs, parts, part, w, g, a, first, kg, i, cc, R, j):  # input i of group kg, slot j
        for r in T.unroll(R):
            part[r, T.Ramp(j * quarter(R), 1, quarter(R))] = part[r, T.Ramp(j * quarter(R), 1, quarter(R))] + \
                T.Broadcast(x_at(X, xs, g, first, r, kg, i), quarter(R)) * raw_e4m3_slot(
                    parts[0][w, a, kg * group + i, T.Ramp(cc * chunk(R), 1, chunk(R))], j, quarter(R))

    @T.macro
    def slot_total(parts, acc, part, w, a, kg, cc, R, q):  # the group's sums of columns q * C / 4 ..
        for r in T.unroll(R):
            acc[r, T.Ramp(cc * chunk(R) + q * quarter(R), 1, quarter(R))] = total(
                acc[r, T.Ramp(cc * chunk(R) + q * quarter(R), 1, quarter(R))],
                T.Shuffle([part[r, T.Ramp(j * quarter(R), 1, quarter(R))] for j in range(4)],
                          [n % 4 * quarter(R) + n // 4 for n in range(q * quarter(R), (q + 1) * quarter(R))]),
                fmt.group_scale(parts, (w,), a, kg * group, T.Ramp(cc * chunk(R) + q * quarter(R), 1, quarter(R))))

    @T.macro
    def direct(X, parts, Y, w, g, a, first, R):
        acc = T.alloc_buffer((R, tile), F32, scope="local", annotations=ON_STACK)
        for r in T.unroll(R):
            for c in columns(tile):
                acc[r, c] = T.float32(0)
        for kg in range(in_dim // group):
            # Scaled formats: the group's x boosted once for all chunks of columns, which then
            # broadcast it from memory (a load, no vector operation).
            xs = T.alloc_buffer((R, group) if scaled else (1, 1), F32, scope="local", annotations=ON_STACK)
            if scaled:
                for r in T.unroll(R):
                    for i in columns(group):
                        xs[r, i] = boosted(X[x_index(first + r, g, kg * group + i)])
            for cc in range(tile // chunk(R)):
                # This chunk's accumulators, which LLVM keeps in registers over the group.
                part = T.alloc_buffer((R, chunk(R)), F32, scope="local", annotations=ON_STACK)
                for r in T.unroll(R):
                    for c in columns(chunk(R)):
                        part[r, c] = T.float32(0) if scaled else acc[r, cc * chunk(R) + c]
                for ko in range(group // unroll):
                    if prefetched and cc == 0:
                        prefetch(parts, w, a, kg * group + ko * unroll)
                    if slotted(R):
                        for u in T.unroll(unroll):
                            # The slot is a Python value in each call: it picks the decode's operations.
                            slot_fma(X, xs, parts, part, w, g, a, first, kg, ko * unroll + u, cc, R, 3)
                            slot_fma(X, xs, parts, part, w, g, a, first, kg, ko * unroll + u, cc, R, 2)
                            slot_fma(X, xs, parts, part, w, g, a, first, kg, ko * unroll + u, cc, R, 1)
                            slot_fma(X, xs, parts, part, w, g, a, first, kg, ko * unroll + u, cc, R, 0)
                    else:
                        for v in T.unroll(chunk(R) // vector(R)):
                            for u in T.unroll(unroll):
                                for r in T.unroll(R):
                                    for c in columns(vector(R)):
                                        part[r, v * vector(R) + c] = part[r, v * vector(R) + c] + \
                                            x_at(X, xs, g, first, r, kg, ko * unroll + u) * \
                                            decode(parts, (w,), a, kg * group + ko * unroll + u,
                                                   cc * chunk(R) + v * vector(R) + c)
                if slotted(R):
                    slot_total(parts, acc, part, w, a, kg, cc, R, 0)
                    slot_total(parts, acc, part, w, a, kg, cc, R, 1)
                    slot_total(parts, acc, part, w, a, kg, cc, R, 2)
                    slot_total(parts, acc, part, w, a, kg, cc, R, 3)
                else:
                    for r in T.unroll(R):
                        for c in columns(chunk(R)):
                            acc[r, cc * chunk(R) + c] = total(acc[r, cc * chunk(R) + c], part[r, c], fmt.group_scale(
                                parts, (w,), a, kg * group, cc * chunk(R) + c) if scaled else 1)
        for r in T.unroll(R):
            for c in columns(tile):
                Y[at(first + r, g, a * tile + c)] = acc[r, c]

    @T.macro
    def direct_rows(X, parts, Y, w, g, a, first, count):
        for b in range((count + GEMV_ROWS - 1) // GEMV_ROWS):
            if count - b * GEMV_ROWS >= 4:
                direct(X, parts, Y, w, g, a, first + b * GEMV_ROWS, 4)
            elif count - b * GEMV_ROWS == 3:
                direct(X, parts, Y, w, g, a, first + b * GEMV_ROWS, 3)
            elif count - b * GEMV_ROWS == 2:
                direct(X, parts, Y, w, g, a, first + b * GEMV_ROWS, 2)
            else:
                direct(X, parts, Y, w, g, a, first + b * GEMV_ROWS, 1)

    def weight(panel, parts, w, a, k, ki, pb, pc):  # input k (ki in the k block), panel pb's column pc
        return panel[ki, pc] if fmt.decoded else fmt.raw(parts, (w,), a, k, pb * pw + pc)

    # The micro-kernel's loops over its R rows: unrolled (R a number) or, AMX's last block of
    # however many rows are left, a loop.
    rows_of = T.unroll if not amx else T.serial

    @T.macro
    def micro(X, xb, panel, parts, Y, w, g, a, row, first, pb, cs, kb, R):
        # The sums: AMX's of every group of the k block (sum_blocks) at once, else the group's.
        acc = T.alloc_buffer((sum_blocks, AMX_ROWS if amx else R, cols), F32, scope="local", annotations=ON_STACK)
        scales = T.alloc_buffer((cols,) if scaled else (1,), F32, scope="local", annotations=ON_STACK)
        # Scaled formats: each output's total so far (zero before the first group, then y) beside
        # the group's sum, written back once after the k block's groups.
        totals = T.alloc_buffer((AMX_ROWS if amx else R, cols) if scaled else (1, 1), F32, scope="local",
                                annotations=ON_STACK)
        if scaled:
            for r in rows_of(R):
                for c in T.vectorized(cols):
                    totals[r, c] = T.if_then_else(kb == 0, T.float32(0), Y[at(row + r, g, a * tile + pb * pw + cs * cols + c)])
        if amx:  # every group's (or the k block's) products on tiles: the chunk's rounded x by the panel's pairs
            if not scaled:
                for r in rows_of(R):
                    for c in T.vectorized(cols):
                        acc[0, r, c] = T.if_then_else(kb == 0, T.float32(0),
                                                      Y[at(row + r, g, a * tile + pb * pw + cs * cols + c)])
            T.evaluate(tile_products(cols // DOT_LANES, k_pairs, scaled, T.address_of(acc[0, 0, 0]),
                                     T.address_of(xb[row - first, 0]), kc // 2 * 4, T.address_of(panel[0, cs * cols]),
                                     pw * 4, R, sum_blocks, summed // 2 // k_pairs))
        for kg in range(kc // group if scaled else 1):
            if not amx:
                if scaled or kb == 0:
                    for r in T.unroll(R):
                        for c in T.vectorized(cols):
                            acc[0, r, c] = T.float32(0)
                else:
                    for r in T.unroll(R):
                        for c in T.vectorized(cols):
                            acc[0, r, c] = Y[at(row + r, g, a * tile + pb * pw + cs * cols + c)]
            if pairs and not amx:  # two inputs a vdpbf16ps: the chunk's rounded x (rows from first) by the panel
                for k2 in range(summed // 2):
                    for r in T.unroll(R):
                        for v in T.unroll(cols // DOT_LANES):
                            acc[0, r, T.Ramp(v * DOT_LANES, 1, DOT_LANES)] = dot(
                                acc[0, r, T.Ramp(v * DOT_LANES, 1, DOT_LANES)],
                                T.Broadcast(X[x_index(row + r, g, kb * kc // 2 + kg * (group // 2) + k2)], DOT_LANES),
                                panel[kg * (group // 2) + k2, T.Ramp(cs * cols + v * DOT_LANES, 1, DOT_LANES)])
            elif not pairs:
                for ki in range(summed):
                    for r in T.unroll(R):
                        for c in T.vectorized(cols):
                            acc[0, r, c] = acc[0, r, c] + x_value(X[x_index(row + r, g, kb * kc + kg * group + ki)]) * \
                                weight(panel, parts, w, a, kb * kc + kg * group + ki, kg * group + ki, pb, cs * cols + c)
            if scaled:
                # The group's scales, once for all rows.
                for c in T.vectorized(cols):
                    scales[c] = fmt.group_scale(parts, (w,), a, kb * kc + kg * group, pb * pw + cs * cols + c)
                for r in rows_of(R):
                    for c in T.vectorized(cols):
                        totals[r, c] = total(totals[r, c], acc[kg if amx else 0, r, c], scales[c])
            else:
                for r in rows_of(R):
                    for c in T.vectorized(cols):
                        Y[at(row + r, g, a * tile + pb * pw + cs * cols + c)] = acc[0, r, c]
        if scaled:
            for r in rows_of(R):
                for c in T.vectorized(cols):
                    Y[at(row + r, g, a * tile + pb * pw + cs * cols + c)] = totals[r, c]

    @T.macro
    def panel_chunk(X, parts, Y, w, g, a, first, count):
        panel = T.alloc_buffer((kc // 2, pw) if pairs else ((kc, pw) if fmt.decoded else (1, 1)),
                               "uint32" if pairs else F32, scope="local", annotations=ON_STACK)
        # AMX: the tile loads read the chunk's pairs of the k block from a copy on the stack (read
        # in place from X, LLVM 20's tile configuration failed: "define the shape earlier").
        xb = T.alloc_buffer((chunk_rows, kc // 2) if amx else (1, 1), "uint32", scope="local", annotations=ON_STACK)
        for kb in range(in_dim // kc):
            if amx:
                for r in range(count):
                    for kv in range(kc // 2 // x_copy):
                        xb[r, T.Ramp(kv * x_copy, 1, x_copy)] = X[x_index(first + r, g, T.Ramp(
                            kb * kc // 2 + kv * x_copy, 1, x_copy))]
            for pb in range(tile // pw):
                if pairs:
                    for k2 in range(kc // 2):  # vectors of 16 columns: the FP4 table decodes so
                        for v in T.unroll(pw // DOT_LANES):
                            for c in T.vectorized(DOT_LANES):
                                panel[k2, v * DOT_LANES + c] = pair(
                                    panel_value(decode(parts, (w,), a, kb * kc + 2 * k2, pb * pw + v * DOT_LANES + c)),
                                    panel_value(decode(parts, (w,), a, kb * kc + 2 * k2 + 1, pb * pw + v * DOT_LANES + c)))
                elif fmt.decoded:
                    for ki in range(kc):
                        for c in T.vectorized(pw):
                            panel[ki, c] = panel_value(decode(parts, (w,), a, kb * kc + ki, pb * pw + c))
                # Row blocks of rb, then one of rb / 2 if that many are left, then single rows (AMX:
                # blocks of AMX_ROWS, the last one the rows left); each block's x (rows x k block)
                # stays in L1 across the panel's column strips.
                if amx:
                    for b in range((count + rb - 1) // rb):
                        for cs in range(pw // cols):
                            micro(X, xb, panel, parts, Y, w, g, a, first + b * rb, first, pb, cs, kb,
                                  T.min(rb, count - b * rb))
                else:
                    for b in range(count // rb):
                        for cs in range(pw // cols):
                            micro(X, xb, panel, parts, Y, w, g, a, first + b * rb, first, pb, cs, kb, rb)
                    if half > 0:
                        if count % rb >= half:
                            for cs in range(pw // cols):
                                micro(X, xb, panel, parts, Y, w, g, a, first + count // rb * rb, first, pb, cs, kb,
                                      half)
                        for r in range(count % rb % half):
                            for cs in range(pw // cols):
                                micro(X, xb, panel, parts, Y, w, g, a, first + count - count % rb % half + r, first,
                                      pb, cs, kb, 1)

    @T.macro
    def chunks(X, parts, Y, w, g, a, first, count):
        # Chunks of rows whose x k block stays in L2 across the tile's panels.
        for rc in range((count + chunk_rows - 1) // chunk_rows):
            panel_chunk(X, parts, Y, w, g, a, first + rc * chunk_rows, T.min(chunk_rows, count - rc * chunk_rows))

    @T.macro
    def round_row(X, XB, g, row):
        # pairs: a row of x rounded to BF16 pairs (XB: x's layout, in_dim / 2 pairs a row) once
        # for every column tile, which then read them (panel_rows' X); rounded per tile, the same
        # row was read and rounded once per 64 columns.
        for kv in range(in_dim // x_vector):
            XB[x_index(row, g, T.Ramp(kv * (x_vector // 2), 1, x_vector // 2))] = rounded_pairs(
                X[x_index(row, g, T.Ramp(kv * x_vector, 1, x_vector))], x_vector)

    @T.macro
    def panel_rows(X, parts, Y, w, g, a, first, count):
        if pairs:  # the vdpbf16ps (or AMX) function linked into the kernel's module
            with T.attr(0, "pragma_import_llvm", tile_ir(cols // DOT_LANES, k_pairs, scaled) if amx else DOT_IR):
                chunks(X, parts, Y, w, g, a, first, count)
        else:
            chunks(X, parts, Y, w, g, a, first, count)

    # With pairs, panel_rows takes x as round_row wrote it.
    return direct_rows, panel_rows, round_row if pairs else None


def linear(out_dim: int, in_dim: int, quant: str, gemv: bool, groups: int = 0, compute: str = "fp32", *,
           schedule: bool = True):
    """y = x @ W.T with the weight stored in column tiles [O / tile, I, tile]: fp32; FP8 e4m3 (or
    e4m3fnuz) codes with their 128x128 block scales expanded per column and tiled the same way,
    [O / tile, ceil(I/128), tile] (a vector of columns then reads a vector of scales); FP4; or
    BF16 (half the bytes of fp32 for the BF16 tensors of the checkpoint, such as the head).
    GEMV: x [N, I] -> y [N, O]; GEMM: x [B, 8, I] -> y [B, 8, O] (rows padded to blocks of 8).
    ``groups`` > 0: G independent projections, weights [G, O / tile, I, tile], y [..., G, O]; the
    GEMV's x is [N, G, I], the GEMM's group-major, [G, B, 8, I] (step_kernels.pad_rows writes it
    so). Its rows are then 4 * I bytes apart, not G times that: Flash's wo_a (8 groups of 4096
    inputs) had rows 128 KiB apart, which maps every row of a k block to the same few L2 sets
    (group-major runs faster, bench/RESULTS.md).

    The CPU kernel (``schedule``) runs ``_matmul_loops`` in parallel over (group, column tile):
    the direct loop for GEMV, the panel loop for GEMM. ``schedule=False`` gives the GEMM's compute
    definition, which GPU targets schedule where it does not tile onto tensor cores (their
    GEMVs are ``kernels.gpu_gemv``'s). ``compute``: "fp32", or "bf16" (CPU GEMMs, see
    ``_matmul_loops``)."""
    if schedule:
        return _cpu_linear(out_dim, in_dim, quant, gemv, groups, compute)
    if gemv:
        raise ValueError("linear: GPU targets build decode GEMVs with kernels.gpu_gemv, not a compute definition")
    n = te.var("B")
    rows = (n, GEMM_ROWS)
    fmt = tir_format(quant)
    lead = (groups,) if groups else ()
    x = te.placeholder(lead + rows + (in_dim,), F32, name="x")
    tile = column_tile(out_dim)
    args = [te.placeholder(lead + shape, dtype, name=name)
            for (shape, dtype), name in zip(fmt.parts(out_dim, in_dim), ("w", "s"))]
    tiled = lambda *i: fmt.value(args, i[:-3], *i[-3:])  # noqa: E731
    if fmt.decoded:
        # Each weight tile decoded once into a scratch tile that every row block reuses.
        decoded = te.compute(lead + (out_dim // tile, in_dim, tile), tiled, name="w_decoded")
        tiled = lambda *i: decoded[i]  # noqa: E731
    k = te.reduce_axis((0, in_dim), "k")
    x_row = lambda idx: idx[len(rows):-1] + idx[:len(rows)]  # noqa: E731
    y = te.compute(rows + lead + (out_dim,), lambda *idx: te.sum(
        x[x_row(idx) + (k,)] * tiled(*idx[len(rows):-1], idx[-1] // tile, k, idx[-1] % tile), axis=k), name="y")
    return te.create_prim_func([x] + args + [y])


def _cpu_linear(out_dim: int, in_dim: int, quant: str, gemv: bool, groups: int, compute: str):
    g = max(groups, 1)
    tiles = out_dim // column_tile(out_dim)
    direct_rows, panel_rows, round_row = _matmul_loops(out_dim, in_dim, quant, True, group_major_x=not gemv,
                                                       compute=compute)
    run = direct_rows if gemv else panel_rows
    rounds_x = not gemv and round_row is not None  # the bf16 GEMM's x, rounded to pairs first
    lead = (groups,) if groups else ()
    outer = (lambda n: (n,)) if gemv else (lambda n: (n, GEMM_ROWS))  # noqa: E731
    rows = (lambda n: n) if gemv else (lambda n: n * GEMM_ROWS)  # noqa: E731
    x_shape = (lambda n: outer(n) + lead) if gemv else (lambda n: lead + outer(n))  # noqa: E731
    x_flat = (lambda n: (rows(n), g)) if gemv else (lambda n: (g, rows(n)))  # noqa: E731
    storage = tir_format(quant).parts(out_dim, in_dim)
    (w_shape, w_dtype), (s_shape, s_dtype) = storage[0], storage[-1]

    @T.macro
    def jobs(X, parts, Y, n):
        if rounds_x:
            XB = T.alloc_buffer(x_flat(n) + (in_dim // 2,), "uint32")
            for r in T.parallel(g * rows(n)):
                round_row(X, XB, r // rows(n), r % rows(n))
            for job in T.parallel(g * tiles):
                run(XB, parts, Y, job // tiles, job // tiles, job % tiles, 0, rows(n))
        else:
            for job in T.parallel(g * tiles):
                run(X, parts, Y, job // tiles, job // tiles, job % tiles, 0, rows(n))

    if len(storage) == 2:
        @T.prim_func
        def f(x: T.handle, w: T.handle, s: T.handle, y: T.handle):
            n = T.int32()
            X0 = T.match_buffer(x, x_shape(n) + (in_dim,), F32)
            W0 = T.match_buffer(w, lead + w_shape, w_dtype)
            S0 = T.match_buffer(s, lead + s_shape, s_dtype)
            Y0 = T.match_buffer(y, outer(n) + lead + (out_dim,), F32)
            X = T.decl_buffer(x_flat(n) + (in_dim,), F32, data=X0.data)
            W = T.decl_buffer((g,) + w_shape, w_dtype, data=W0.data)
            S = T.decl_buffer((g,) + s_shape, s_dtype, data=S0.data)
            Y = T.decl_buffer((rows(n), g, out_dim), F32, data=Y0.data)
            jobs(X, (W, S), Y, n)
        return f

    @T.prim_func
    def f(x: T.handle, w: T.handle, y: T.handle):
        n = T.int32()
        X0 = T.match_buffer(x, x_shape(n) + (in_dim,), F32)
        W0 = T.match_buffer(w, lead + w_shape, w_dtype)
        Y0 = T.match_buffer(y, outer(n) + lead + (out_dim,), F32)
        X = T.decl_buffer(x_flat(n) + (in_dim,), F32, data=X0.data)
        W = T.decl_buffer((g,) + w_shape, w_dtype, data=W0.data)
        Y = T.decl_buffer((rows(n), g, out_dim), F32, data=Y0.data)
        jobs(X, (W,), Y, n)
    return f


def expert_linear(out_dim: int, in_dim: int, quant: str, n_experts: int, decode: bool = False, compute: str = "fp32", *,
                  max_lanes: int = 0):
    """y[p] = x[p] @ W[e].T for the rows p of each expert e's group, offsets[e] <= p <
    offsets[e + 1] (rows sorted by expert, see step_kernels.moe_group); weights stacked
    [E, O / tile, I, tile] in any ``linear`` format. One kernel for decode and prefill, in
    parallel over (column tile, expert), tile-major so both halves of the jobs hold every
    expert: a group of up to GEMV_ROWS rows runs ``_matmul_loops``' direct loop, a larger one
    the panel loop; an expert without rows costs nothing. Summed like ``linear``, so an
    expert's rows get the same bits whatever the group's size. ``decode`` marks the decode
    function's kernel: the CPU's is this one either way, GPU targets build
    ``kernels.gpu_gemv``'s for it (and tensor-core GEMMs, ``kernels.gpu_matmul``, for
    prefill's). GPU builds of this kernel (``max_lanes``: shapes that do not tile) run the
    direct loop, with column vectors of at most ``max_lanes``. ``compute`` "bf16": the panel
    loop's (groups of more than GEMV_ROWS rows) as ``linear``'s."""
    tile = column_tile(out_dim)
    tiles = out_dim // tile
    columns = T.vectorized if not max_lanes or tile <= max_lanes else T.serial
    cpu = not max_lanes
    direct_rows, panel_rows, round_row = _matmul_loops(out_dim, in_dim, quant, False, columns, cpu, compute=compute)
    rounds_x = round_row is not None  # the bf16 GEMM's x, rounded to pairs first (XB)

    @T.macro
    def body(X, XB, OFF, parts, Y, job):  # expert job % E, column tile job // E
        if cpu and OFF[job % n_experts + 1] - OFF[job % n_experts] > GEMV_ROWS:
            panel_rows(XB, parts, Y, job % n_experts, 0, job // n_experts, OFF[job % n_experts],
                       OFF[job % n_experts + 1] - OFF[job % n_experts])
        else:
            direct_rows(X, parts, Y, job % n_experts, 0, job // n_experts, OFF[job % n_experts],
                        OFF[job % n_experts + 1] - OFF[job % n_experts])

    @T.macro
    def jobs(X, OFF, parts, Y):
        if rounds_x:
            XB = T.alloc_buffer((X.shape[0], in_dim // 2), "uint32")
            for r in T.parallel(X.shape[0]):
                round_row(X, XB, 0, r)
            for job in T.parallel(n_experts * tiles):
                body(X, XB, OFF, parts, Y, job)
        else:
            for job in T.parallel(n_experts * tiles):
                body(X, X, OFF, parts, Y, job)
    return expert_linear_function(out_dim, in_dim, quant, n_experts, jobs)


def expert_linear_function(out_dim: int, in_dim: int, quant: str, n_experts: int, run):
    """The ``expert_linear`` kernel (x [P, I], offsets [E + 1], the stacked weight's parts -> y
    [P, O]) whose work is the macro ``run(X, OFF, parts, Y)``: the CPU's, or the GPU targets'
    (``kernels.gpu_matmul``, ``kernels.gpu_gemv``)."""
    storage = [((n_experts,) + shape, dtype) for shape, dtype in tir_format(quant).parts(out_dim, in_dim)]
    (w_shape, w_dtype), (s_shape, s_dtype) = storage[0], storage[-1]
    if len(storage) == 2:
        @T.prim_func
        def f(x: T.handle, offsets: T.handle, w: T.handle, s: T.handle, y: T.handle):
            p = T.int32()
            X = T.match_buffer(x, (p, in_dim), F32)
            OFF = T.match_buffer(offsets, (n_experts + 1,), "int32")
            W = T.match_buffer(w, w_shape, w_dtype)
            S = T.match_buffer(s, s_shape, s_dtype)
            Y = T.match_buffer(y, (p, out_dim), F32)
            run(X, OFF, (W, S), Y)
        return f

    @T.prim_func
    def f(x: T.handle, offsets: T.handle, w: T.handle, y: T.handle):
        p = T.int32()
        X = T.match_buffer(x, (p, in_dim), F32)
        OFF = T.match_buffer(offsets, (n_experts + 1,), "int32")
        W = T.match_buffer(w, w_shape, w_dtype)
        Y = T.match_buffer(y, (p, out_dim), F32)
        run(X, OFF, (W,), Y)
    return f
