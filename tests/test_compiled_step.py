"""The compiled step: the artifact's library is a Relax VM module whose entry functions run a
whole step; the host uploads O(tokens + requests) integers per step and reads back only the
logits it asked for; GPU builds get the same functions (CUDA graphs on sm90)."""

import json
import re

import numpy as np
import pytest
import tvm
from tvm import relax

from dsv4c.codegen import gpu
from dsv4c.codegen.build import lower_step
from dsv4c.frontend.checkpoint_writer import write_checkpoint
from dsv4c.frontend.random_model import iter_random_weights
from dsv4c.frontend.config import preset, with_weights
from dsv4c.frontend.trace import trace
from dsv4c.passes.pipeline import run_pipeline
from dsv4c.passes.quant_plan import plan_for
from dsv4c.runtime.engine import Engine
from dsv4c.artifact.pool import PoolGeometry
from dsv4c.runtime.sampling import SamplingParams
from dsv4c.targets import target_info

from conftest import compile_pair


@pytest.fixture(scope="module")
def tiny(tiny_llvm):
    return tiny_llvm


def test_manifest_names_a_vm_library_with_its_functions(tiny):
    vm_info = json.loads((tiny / "manifest.json").read_text())["vm"]
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(tiny / vm_info["library"])), tvm.cpu())
    # The step's two functions, and the MTP layer's (the tiny model has one).
    assert vm_info["functions"] == ["decode", "prefill", "mtp0_decode", "mtp0_prefill"]
    assert vm_info["outputs"] == ["logits", "streams"] and vm_info["mtp_inputs"][-2:] == ["streams", "stream_rows"]
    for name in vm_info["functions"]:
        assert vm.module.implements_function(name)
    assert not (tiny / "kernels.so").exists()


def test_a_step_uploads_compact_inputs_and_reads_back_only_logits(tiny):
    """Per step the host uploads tokens, positions and the request of each token (3 T), four
    numbers and a block-table row per request, the logit rows and one extent per compress
    ratio: O(tokens + requests), whatever the depth or expert count. It reads back vocab floats
    per requested row: the last token of each request that completes its sequence."""
    engine = Engine(tiny, prefill_chunk=16, max_step_tokens=64)
    vocab, ratios = engine.config.vocab_size, len(engine.backend.entry_ratios)
    prompts = [list(range(1, 40)), [5, 6], list(range(100, 170))]
    rids = [engine.submit(p, SamplingParams(max_new_tokens=12)) for p in prompts]
    steps = 0
    while engine.step():
        s = engine.backend.last_step
        steps += 1
        assert engine.backend.uploaded_ints == 3 * s["tokens"] + s["requests"] * (4 + s["blocks"]) + \
            max(s["logit_rows"], 1) + ratios  # a step needing no logits computes one row
        assert s["blocks"] <= -(-engine.max_context // 256)
        assert engine.backend.read_back == s["logit_rows"] * vocab and s["logit_rows"] <= s["requests"]
    assert steps > 10 and all(len(engine.result(i).tokens) == 12 for i in rids)


def test_decode_and_prefill_agree_with_the_host_reference_rows(tiny):
    """Only the requested rows come back, and they are the rows a full readback would hold."""
    engine = Engine(tiny)
    backend = engine.backend
    engine.pool.admit(0, reserve_tokens=20)
    engine.pool.ensure(0, 20)
    tokens = np.arange(3, 23, dtype=np.int32)
    every = backend.step(tokens, np.arange(20, dtype=np.int32), np.zeros(20, np.int32))
    assert every.shape == (20, engine.config.vocab_size) and backend.read_back == every.size
    engine.pool.free(0)
    engine.pool.admit(0, reserve_tokens=20)
    engine.pool.ensure(0, 20)
    some = backend.step(tokens, np.arange(20, dtype=np.int32), np.zeros(20, np.int32), np.array([4, 19], np.int32))
    assert backend.read_back == 2 * engine.config.vocab_size
    assert np.array_equal(some, every[[4, 19]])


def test_a_bf16_checkpoint_runs_like_its_reference(tmp_path):
    """BF16 dense weights reach every matmul as the BF16 its kernel reads (the grouped output
    projection and the shared expert included), and the step computes what the reference does."""
    cfg = with_weights(preset("tiny"), dense="bf16", experts="bf16")
    write_checkpoint(cfg, iter_random_weights(cfg, 0), tmp_path / "model")
    ref, cpu = compile_pair(tmp_path, tmp_path / "model")
    prompt, params = list(range(1, 24)), SamplingParams(max_new_tokens=6)
    want = Engine(ref).generate(prompt, params, record_logits=True)
    got = Engine(cpu).generate(prompt, params, record_logits=True)
    assert got.tokens == want.tokens
    np.testing.assert_allclose(got.logits, want.logits, atol=1e-4, rtol=0)


def test_a_checkpoint_of_32_x_32_fp8_blocks_runs_like_its_reference(tmp_path):
    """V4.1's dense FP8 blocks (``weight_block_size`` [32, 32], UE8M0 scales): the block size goes
    from the config through the checkpoint and the quantization plan to the artifact's scales and
    the kernels, and the step computes what the reference does."""
    cfg = with_weights(preset("tiny"), fp8_block=32)
    model = write_checkpoint(cfg, iter_random_weights(cfg, 0), tmp_path / "model")
    assert json.loads((model / "config.json").read_text())["quantization_config"]["weight_block_size"] == [32, 32]
    ref, cpu = compile_pair(tmp_path, model)
    manifest = json.loads((cpu / "manifest.json").read_text())
    assert manifest["quant_plan"]["weights"]["dense"]["block"] == [32, 32]
    symbols = manifest["vm"]["profile"]["kernels"]
    assert any("fp8_b32" in s for s in symbols) and not any("fp8_b128" in s for s in symbols)
    prompt, params = list(range(1, 24)), SamplingParams(max_new_tokens=6)
    want = Engine(ref).generate(prompt, params, record_logits=True)
    got = Engine(cpu).generate(prompt, params, record_logits=True)
    assert got.tokens == want.tokens
    np.testing.assert_allclose(got.logits, want.logits, atol=1e-4, rtol=0)


def _lowered(target):
    cfg = preset("tiny")
    program = run_pipeline(trace(cfg))
    plan = plan_for(cfg, target)
    lowered, step, _ = lower_step(program, plan, PoolGeometry.build(cfg, plan), target_info(target), 256)
    return lowered.script(), step


def _kernel_launches(text: str, function: str) -> tuple[list[str], list[str]]:
    """The kernels a lowered Relax function launches itself, and those its captured CUDA graphs do."""
    bodies = {}
    for m in re.finditer(r"\n    @R\.function[^\n]*\n    def (\w+)\(", text):
        end = re.search(r"\n    @(R\.function|T\.prim_func)", text[m.end():])
        bodies[m.group(1)] = text[m.end():m.end() + (end.start() if end else len(text))]
    launched = lambda name: re.findall(r"cls\.(\w+)\(", bodies[name])  # noqa: E731
    captured = [k for name in bodies if re.fullmatch(rf"{function}_cuda_graph_capture\d*", name) for k in launched(name)]
    return [k for k in launched(function) if not k.startswith("shape_func")], captured


def test_sm90_decode_runs_as_cuda_graphs():
    """sm90's decode function replays captured CUDA graphs (TVM's RewriteCUDAGraph); it cannot
    run here, so the lowered module is checked for the capture regions and their runtime
    builtins. The weights and the pool are the same tensors every step (``num_input``), the
    step's inputs are copied into buffers of its own first and its outputs out of them last, and
    the context-shaped inputs (block tables, entry extents) are padded to the context's bucket, so
    every kernel is captured but those copies. Prefill, whose shapes change every step, launches
    kernels directly."""
    text, step = _lowered("sm90")
    assert "vm.builtin.cuda_graph.run_or_capture" in text
    assert not re.search(r"prefill_cuda_graph_capture", text)
    assert step.functions == ["decode", "prefill", "mtp0_decode", "mtp0_prefill"]
    assert step.cuda_graph
    direct, captured = _kernel_launches(text, "decode")
    # in: tokens, positions, token_request, requests, block_table, logit_rows; out: logits, streams
    assert sorted(direct) == ["copy_rows_float32"] * 2 + ["copy_rows_int32"] * 6
    assert len(captured) > 20 * len(direct)  # 201 launches on the tiny model
    assert {"embed", "rope", "attention", "compress", "entry", "index", "topk", "sparse"} <= \
        {k.split("_")[0] for k in captured}  # readers of the copied inputs and of the context-shaped ones
    assert f"linear_{preset('tiny').vocab_size}_" in " ".join(captured)  # the head: its logits are copied out
    mtp_direct, mtp_captured = _kernel_launches(text, "mtp0_decode")  # the MTP draft: a decode-sized call too
    assert set(mtp_direct) == {"copy_rows_float32", "copy_rows_int32", "gather_rows"}  # gather: the step's streams
    assert len(mtp_captured) > 3 * len(mtp_direct)


def test_context_buckets_leave_the_logits_as_they_are(tiny_llvm):
    """A decode step that replays CUDA graphs gets block tables and entry extents padded to its
    context's bucket (``artifact.pool.context_bucket``); the kernels mask what lies past each
    token's own context, so the logits are the same bits. Checked here by padding a CPU step
    (a ragged batch, contexts across several buckets)."""
    from dsv4c.artifact.pool import context_bucket

    assert [context_bucket(n) for n in (1, 256, 257, 600, 1024, 1025)] == [256, 256, 512, 1024, 1024, 2048]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 500, n).tolist() for n in (300, 37, 600)]

    def run(bucketed: bool):
        engine = Engine(tiny_llvm, max_requests=3, max_context=1024)
        engine.backend.context_buckets = bucketed
        ids = [engine.submit(p, SamplingParams(max_new_tokens=12), record_logits=True) for p in prompts]
        widths = set()
        while engine.step():
            widths.add(engine.backend.last_step["blocks"])
        return [engine.result(i) for i in ids], widths

    (plain, plain_widths), (padded, padded_widths) = run(False), run(True)
    assert max(padded_widths) > max(plain_widths)  # the padding happened: wider block tables
    for a, b in zip(plain, padded):
        assert a.tokens == b.tokens
        np.testing.assert_array_equal(np.array(a.logits), np.array(b.logits))


@pytest.mark.parametrize("target", ["gfx942", "gfx950"])
def test_rocm_builds_get_the_same_functions_without_graphs(target):
    """ROCm builds run the same entry functions with plain kernel launches (TVM has no HIP
    graph rewrite), so their lowered module holds no capture regions."""
    text, step = _lowered(target)
    assert "cuda_graph" not in text and "call_tir" not in text and "decode" in text
    assert step.functions == ["decode", "prefill", "mtp0_decode", "mtp0_prefill"]


def test_the_runtime_imports_nothing_of_the_compiler():
    """The runtime reads the model, the plan, the geometry and the rope tables from the artifact
    (through ``artifact/``): loading an engine or a server imports no part of the compiler."""
    import subprocess
    import sys

    code = ("import sys, dsv4c.runtime.engine, dsv4c.runtime.backend_tvm, dsv4c.runtime.serve.app; "
            "print(sorted(m for m in sys.modules if m.startswith(('dsv4c.frontend', 'dsv4c.passes', 'dsv4c.codegen', "
            "'dsv4c.compile'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_rocm_toolchain_errors_name_what_to_install(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(gpu.ToolchainError, match="lld-19"):
        gpu.rocm_environment()
