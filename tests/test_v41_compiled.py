"""DeepSeek-V4.1 compiled for the CPU (llvm) against transformers' reference, as
tests/test_v41_parity.py holds the reference target to it (tests/v41_case.py): the logits and
greedy tokens whole, with chunked prefill and in a ragged batch; a prefix-cache hit
bit-identical to a miss, preempted requests and speculative decoding computing the plain tokens; the V4.1 kernels against their numpy models: the fake-quant round
trips and the Engram gather bit for bit, the candidate-block mask exactly; the Engram tables
mapped, read or gathered on the host alike; and the GPU targets compiling v41-tiny
without weights into machine code that neither spills nor keeps arrays in local memory (no GPU
needed; tests/test_gpu_targets.py says which tools each target needs)."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import tvm

from dsv4c.artifact import lowbit
from dsv4c.artifact.engram_tables import EngramTable
from dsv4c.artifact.safetensors_io import SafetensorsFile
from dsv4c.codegen import gpu
from dsv4c.cli import main as cli
from dsv4c.codegen.kernel_factories import KERNELS
from dsv4c.compile import compile_model
from dsv4c.errors import DsvError
from dsv4c.ir.reference_v41 import candidate_mask
from dsv4c.runtime.backend_tvm import TvmBackend
from dsv4c.runtime.engine import Engine
from dsv4c.runtime.sampling import SamplingParams
from dsv4c.targets import target_info

from v41_case import TOKEN_IDS, TOLERANCE
from v41_case import test_a_prefix_cache_hit_is_bit_identical_to_a_miss  # noqa: F401  (run here on llvm)
from v41_case import test_a_ragged_batch_matches_the_reference  # noqa: F401
from v41_case import test_logits_and_greedy_tokens_match_the_reference  # noqa: F401
from v41_case import test_preempted_requests_recompute_the_same_tokens  # noqa: F401
from v41_case import test_speculative_decoding_computes_the_plain_tokens  # noqa: F401


@pytest.fixture(scope="module")
def artifact(v41_case_artifacts):
    """The parity case compiled for llvm, once for the session (as a model that sees images: text
    prompts leave its image inputs unused)."""
    return v41_case_artifacts["llvm"]


@functools.lru_cache(maxsize=None)
def _kernel(factory: str, *params):
    func = KERNELS[factory](*params)
    return tvm.compile(tvm.IRModule({"k": func.with_attr("global_symbol", "k")}),
                       target=target_info("llvm").tvm_target())["k"]


def _call(kernel, inputs: list, out_shape, dtype="float32"):
    tensors = [tvm.runtime.tensor(np.ascontiguousarray(a)) for a in inputs]
    out = tvm.runtime.tensor(np.zeros(out_shape, dtype))
    kernel(*tensors, out)
    return out.numpy()


@pytest.mark.parametrize("fmt", lowbit.V41_ROUNDTRIPS)
def test_the_round_trips_are_bit_exact(fmt):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((40, 64)) * np.exp2(rng.integers(-30, 20, (40, 1)))).astype(np.float32)
    x[0] = 0  # the amax floors
    x[1, :32] = np.float32(1e-30)
    x[2] = np.linspace(-6, 6, 64, dtype=np.float32)  # midpoints of the grids
    x[3, :16] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, 448, -448, 500, 6, -6, 0, 1]
    got = _call(_kernel("v41_roundtrip", 64, fmt), [x], x.shape)
    assert np.array_equal(got.view(np.uint32), lowbit.v41_roundtrip(x, fmt).view(np.uint32))


@pytest.mark.parametrize("ratio,block,blocks", [(2, 8, 2), (1, 4, 3), (2, 3, 1), (1, 1, 7)])
def test_the_candidate_mask_matches_the_reference(ratio, block, blocks):
    rng = np.random.default_rng(ratio + block)
    entries = 22  # every query sees at most the step's entries
    positions = np.array([p for p in (0, 1, 2, 5, 9, 17, 21, 30, 31, 40) if (p + 1) // ratio <= entries], np.int32)
    scores = rng.standard_normal((len(positions), entries)).astype(np.float32)
    scores[:, 3] = scores[:, 11]  # ties between blocks
    visible = (positions[:, None] + 1) // ratio
    scores[np.arange(entries)[None, :] >= visible] = np.float32(-3.4028234663852886e38)  # index_score's mask
    block_scores = _call(_kernel("candidate_block_scores", ratio, block), [scores, positions],
                         (len(positions), -(-entries // block)))
    got = _call(_kernel("candidate_mask", block, blocks), [block_scores], scores.shape)
    want = candidate_mask(np.where(scores < -1e38, -np.inf, scores).astype(np.float32), positions, None,
                          ratio=ratio, block=block, blocks=blocks)
    assert np.array_equal(got == 0, want == 0)


def _kernel_resources():
    path = Path(__file__).resolve().parents[1] / "scripts" / "kernel_resources.py"
    spec = importlib.util.spec_from_file_location("kernel_resources", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("fmt", ["fp8_e4m3_e8m0", "fp32"])
def test_the_engram_gather_decodes_table_rows_bit_for_bit(fmt):
    """From a whole table or a step's gather of it (artifact.engram_tables), FP8 or float."""
    rng = np.random.default_rng(1)
    rows = rng.integers(0, 256, (70, 64)).astype(np.uint8)
    rows[(rows & 0x7F) == 0x7F] = 0  # no NaN codes
    scales = rng.integers(100, 150, (70, 2)).astype(np.uint8)
    table = EngramTable(1, fmt, rows, scales) if fmt != "fp32" else \
        EngramTable(1, fmt, rng.standard_normal((70, 64)).astype(np.float32), None)
    ids = rng.integers(0, 70, (9, 2, 6)).astype(np.int32)  # [T, L_e, C]: slot 1 is this layer's
    out = _call(_kernel("engram_gather", 64, 6, 2, 1, fmt), [ids] + table.arrays, (9, 6 * 64))
    assert np.array_equal(out, table[ids[:, 1]].reshape(9, -1))


def test_the_engram_tables_mapped_read_or_gathered_on_the_host_give_bit_identical_logits(artifact):
    """The case's float tables (tests/test_engram_tables.py holds FP8 tables to the same)."""
    def run(**engine):
        e = Engine(artifact, max_requests=1, max_context=256, **engine)
        rid = e.submit(TOKEN_IDS, SamplingParams(max_new_tokens=4), record_logits=True)
        e.run()
        return e.result(rid).logits

    mapped, read = run(), run(engram_memory="read")
    TvmBackend.engram_host_gather = True  # the path GPU targets take, on the CPU
    try:
        gathered = run()
    finally:
        TvmBackend.engram_host_gather = False
    assert np.array_equal(mapped, read) and np.array_equal(mapped, gathered)


@pytest.mark.parametrize("target", ["sm90", "gfx942", "gfx950"])
def test_gpu_targets_compile_v41_tiny_into_machine_code(tmp_path, target):
    resources = _kernel_resources()
    try:
        gpu.nvcc_environment() if target == "sm90" else gpu.rocm_environment()
        if target == "sm90":
            resources.cuobjdump()
    except (gpu.ToolchainError, DsvError) as e:
        pytest.skip(f"toolchain missing for {target}: {e}")
    out = compile_model("v41-tiny", target, tmp_path / "art", no_weights=True, progress=False, log=lambda *_: None)
    _, rows = resources.kernel_resources(out)
    assert len(rows) >= 60
    memory = "stack" if target == "sm90" else "scratch"
    assert {row["kernel"]: row for row in rows if row[memory] or row["spills"] != 0} == {}


def test_an_fp8_checkpoint_runs_its_projections_in_the_plan_format_and_matches_the_reference(v41_fp8_artifacts,
                                                                                              tmp_path, capsys):
    """v41-tiny stored as the release stores it (FP8 32 x 32 dense weights, FP4 experts): on llvm
    the index keys' ``indexer.wk`` and Engram's ``wkv`` are FP8 matmul weights (codes and scales,
    GEMV in decode, GEMM in prefill), and the logits of a prefill in chunks and decode steps match
    the reference target's (which multiplies the decoded fp32 weights)."""
    logits, tokens = {}, {}
    for target, art in v41_fp8_artifacts.items():
        capsys.readouterr()
        assert cli(["generate", str(art), "--token-ids", ",".join(map(str, range(3, 40))), "--max-new-tokens", "6",
                    "--greedy", "--prefill-chunk", "16", "--logits-out", str(tmp_path / f"{target}.npy")]) == 0
        tokens[target], logits[target] = capsys.readouterr().out.split(), np.load(tmp_path / f"{target}.npy")
    with SafetensorsFile(v41_fp8_artifacts["llvm"] / "weights.safetensors") as stored:
        for name in ("layers.1.attn.indexer.wk.weight", "layers.4.attn.indexer.wk.weight", "layers.5.engram.wkv.weight"):
            assert stored.dtype(name) == "U8" and name + ".scale" in stored.names()
    assert tokens["llvm"] == tokens["reference"]
    assert np.abs(logits["llvm"] - logits["reference"]).max() < TOLERANCE
