"""Profiling the compiled step by op family (runtime/profile.py, `dsv4c generate --profile`): the
compiler's record of each kernel call's families, the attribution at run time, the prediction
beside it, and that profiling leaves the generated tokens alone."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import dsv4c
from dsv4c.artifact.manifest import ArtifactError
from dsv4c.cli import main as cli
from dsv4c.codegen.build import call_runs
from dsv4c.compile import compile_model
from dsv4c.errors import UsageError
from dsv4c.frontend.config import preset
from dsv4c.frontend.trace import trace
from dsv4c.ir.cost import FAMILIES, Cost, Decode, node_costs, node_families
from dsv4c.passes.pipeline import run_pipeline
from dsv4c.runtime.engine import Engine
from dsv4c.runtime.profile import format_profile
from dsv4c.runtime.sampling import SamplingParams
from dsv4c.token_cost import roofline_seconds

PROMPT = [1, 2, 3, 4, 5, 6, 7]


def test_node_families_split_a_merged_projection_by_its_bytes():
    step = run_pipeline(trace(preset("tiny"), mtp=False)).functions["step"]
    merged = next(n for n in step.nodes if n.op == "linear_split" and "indexer.weights_proj" in n.inputs[1].name)
    shares = node_families(merged)
    assert set(shares) == {"compressor", "indexer"} and sum(shares.values()) == pytest.approx(1)
    parts = node_costs(merged, Decode(1, 1, 4, 4))
    read = sum(c.bytes_read for _, c in parts)
    assert shares["indexer"] == pytest.approx(sum(c.bytes_read for f, c in parts if f == "indexer") / read)
    attention = next(n for n in step.nodes if n.op == "sparse_attn" and n.attrs["kind"] == "csa")
    assert node_families(attention) == {"csa_attention": 1.0}


def test_call_runs_merge_consecutive_calls_of_the_same_families():
    mix = {"compressor": 0.75, "indexer": 0.25}
    calls = [{"head": 1.0}, {"mhc": 1.0}, {"mhc": 1.0}, mix, mix, {"mhc": 1.0}]
    assert call_runs(calls) == [["head", 1], ["mhc", 2], [mix, 2], ["mhc", 1]]


def test_roofline_takes_the_longer_of_bytes_and_flops():
    parts = [("indexer", Cost(flops=100, bytes_read=30, bytes_written=10)),  # 40 B: 4 s; 100 FLOP: 2 s
             ("indexer", Cost(flops=300, bytes_read=10)),  # 1 s of bytes, 6 s of FLOPs
             ("head", Cost(bytes_read=50))]
    seconds = roofline_seconds(parts, bytes_per_s=10, flops_per_s=50)
    assert list(seconds) == list(FAMILIES)
    assert seconds["indexer"] == pytest.approx(4 + 6) and seconds["head"] == pytest.approx(5)
    assert sum(seconds.values()) == pytest.approx(15)


@pytest.fixture(scope="module")
def profiled(tiny_llvm):
    engine = Engine(tiny_llvm, max_context=64, max_requests=1, profile=True)
    result = engine.generate(PROMPT, SamplingParams(max_new_tokens=6))
    return engine, result


def test_the_manifest_records_every_kernel_call_of_each_entry_function(tiny_llvm):
    profile = json.loads((tiny_llvm / "manifest.json").read_text())["vm"]["profile"]
    assert set(profile["calls"]) == {"decode", "prefill", "mtp0_decode", "mtp0_prefill"}
    for runs in profile["calls"].values():
        for key, count in runs:
            families = {key: 1.0} if isinstance(key, str) else key
            assert count >= 1 and set(families) <= set(FAMILIES)
            assert sum(families.values()) == pytest.approx(1, abs=1e-3)
    # Prefill pads rows for its GEMMs: more calls than decode.
    calls = {name: sum(count for _, count in runs) for name, runs in profile["calls"].items()}
    assert calls["prefill"] > calls["decode"]


def test_profile_attributes_each_decode_step_by_family(profiled, tiny_llvm):
    engine, result = profiled
    decode = engine.profiler.summary("decode")
    # The prompt is one prefill step; each generated token but the last is fed in a decode step.
    assert engine.profiler.summary("prefill")["steps"] == 1
    assert decode["steps"] == len(result.tokens) - 1
    assert decode["contexts"] == [len(PROMPT) + 1 + i for i in range(decode["steps"])]
    assert 0 < decode["kernel_ms"] < decode["wall_ms"]
    assert sum(decode["families_ms"].values()) == pytest.approx(decode["kernel_ms"])
    recorded = json.loads((tiny_llvm / "manifest.json").read_text())["vm"]["profile"]["calls"]["decode"]
    families = {f for key, _ in recorded for f in ([key] if isinstance(key, str) else key)}
    assert set(decode["families_ms"]) == families


def test_a_step_whose_calls_differ_from_the_record_is_refused(tiny_llvm):
    engine = Engine(tiny_llvm, max_context=64, max_requests=1, profile=True)
    engine.profiler.calls["decode"] = engine.profiler.calls["decode"][:-1]
    with pytest.raises(ArtifactError, match="kernel calls where the manifest records"):
        engine.generate(PROMPT[:2], SamplingParams(max_new_tokens=2))


def test_generate_profile_emits_the_same_tokens(tiny_llvm, capsys):
    """Profiled in a process of its own, as a user runs it: the runtime's tensors are tvm_ffi's
    there, not ``tvm.runtime.Tensor`` (which a process that imported the compiler makes)."""
    args = ["generate", str(tiny_llvm), "--token-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "8"]
    assert cli(args) == 0
    plain = capsys.readouterr()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(dsv4c.__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    profiled = subprocess.run([sys.executable, "-m", "dsv4c", *args, "--profile"], capture_output=True, text=True,
                              env=env)
    assert profiled.returncode == 0, profiled.stderr
    assert profiled.stdout == plain.out and len(plain.out.split()) == 8
    assert "profile: 7 decode step(s)" in profiled.stderr and "predicted ms" in profiled.stderr
    assert "profile:" not in plain.err


def test_format_profile_shares_are_of_the_kernels_time():
    summary = {"function": "decode", "steps": 2, "tokens": [1, 1], "contexts": [9.0, 10.0], "wall_ms": 5.0,
               "kernel_ms": 4.0, "families_ms": {"indexer": 1.0, "head": 3.0}}
    lines = format_profile(summary, {"indexer": 2.0, "head": 2.0, "mhc": 0.0}, 10.0, 50.0)
    rows = {line.split("  ")[1].strip(): line.split() for line in lines[2:] if "%" in line}
    assert rows["indexer scoring"][-4:] == ["1.000", "25.0%", "2.000", "50.0%"]
    assert rows["embedding and head"][-4:] == ["3.000", "75.0%", "2.000", "50.0%"]
    assert "mHC incl. Sinkhorn" not in rows


def test_profiling_needs_a_compiled_step(tiny_llvm, tmp_path):
    ref = compile_model(str(tiny_llvm.parent / "model"), "reference", tmp_path / "ref", progress=False,
                        log=lambda *_: None)
    with pytest.raises(UsageError, match="profiling times the compiled step"):
        Engine(ref, max_context=64, profile=True)
