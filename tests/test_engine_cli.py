"""Artifacts, the engine's request handling and the generate / compile command lines."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dsv4c.cli import main as cli
from dsv4c.compile import compile_model
from dsv4c.errors import UsageError
from dsv4c.artifact.manifest import ArtifactError
from dsv4c.runtime.engine import Engine
from dsv4c.runtime.sampling import SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    assert cli(["make-tiny", "--out", str(root / "model"), "--seed", "1"]) == 0
    assert cli(["compile", "--model", str(root / "model"), "--target", "llvm", "-o", str(root / "cpu")]) == 0
    assert cli(["compile", "--model", str(root / "model"), "--target", "reference", "-o", str(root / "ref")]) == 0
    return root


def _one_line_error(capsys):
    err = capsys.readouterr().err.strip()
    assert err.startswith("dsv4c: error: ") and "\n" not in err and "Traceback" not in err
    return err


def test_generate_prints_ids_and_saves_logits(tiny, capsys):
    out = tiny / "logits.npy"
    assert cli(["generate", str(tiny / "cpu"), "--token-ids", "5,6,7,8", "--max-new-tokens", "6", "--greedy",
                "--logits-out", str(out)]) == 0
    ids = [int(t) for t in capsys.readouterr().out.split()]
    assert len(ids) == 6
    logits = np.load(out)
    assert logits.shape == (4 + 6, 512) and logits.dtype == np.float32
    # Greedy: each generated id is the argmax of the previous position's logits.
    assert [int(np.argmax(logits[3 + i])) for i in range(6)] == ids
    # Same tokens through the reference backend, and with the prompt chunked.
    assert cli(["generate", str(tiny / "ref"), "--token-ids", "5,6,7,8", "--max-new-tokens", "6"]) == 0
    assert [int(t) for t in capsys.readouterr().out.split()] == ids
    assert cli(["generate", str(tiny / "cpu"), "--token-ids", "5,6,7,8", "--max-new-tokens", "6",
                "--prefill-chunk", "3"]) == 0
    assert [int(t) for t in capsys.readouterr().out.split()] == ids


def test_generate_speculative_prints_plain_tokens_and_acceptance(tiny, capsys):
    args = ["generate", str(tiny / "cpu"), "--token-ids", "5,6,7,8", "--max-new-tokens", "20"]
    assert cli(args) == 0
    plain = capsys.readouterr().out
    for k in ("1", "2"):
        assert cli(args + ["--speculative", "mtp", "--num-draft-tokens", k, "--stats"]) == 0
        out = capsys.readouterr()
        assert out.out == plain
        assert out.err.count("\n") == 1 and "acceptance" in out.err
    # What speculation needs, refused in one line.
    assert cli(args + ["--stats"]) == 2
    assert "--speculative" in _one_line_error(capsys)
    assert cli(args + ["--speculative", "mtp", "--num-draft-tokens", "0"]) == 2
    assert "num_draft_tokens" in _one_line_error(capsys)
    assert cli(["generate", str(tiny / "ref"), "--token-ids", "5,6", "--max-new-tokens", "2", "--speculative", "mtp"]) == 2
    assert "MTP layer" in _one_line_error(capsys)


def test_sampling_is_reproducible_per_seed(tiny, capsys):
    args = ["generate", str(tiny / "cpu"), "--token-ids", "1,2,3", "--max-new-tokens", "12", "--temperature",
            "1.5", "--top-p", "0.9"]
    runs = []
    for seed in ("4", "4", "5"):
        assert cli(args + ["--seed", seed]) == 0
        runs.append(capsys.readouterr().out.split())
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_stop_tokens_and_streaming(tiny):
    engine = Engine(tiny / "cpu")
    full = engine.generate([3, 4, 5], SamplingParams(max_new_tokens=10)).tokens
    seen = []
    stopped = engine.generate([3, 4, 5], SamplingParams(max_new_tokens=10, stop_token_ids=(full[3],)),
                              on_token=lambda rid, tok: seen.append(tok)).tokens
    assert stopped == full[:full.index(full[3]) + 1] == seen


@pytest.mark.parametrize("argv, fragment", [
    (["--token-ids", "1,99999", "--max-new-tokens", "2"], "outside the vocabulary"),
    (["--prompt", "hello", "--max-new-tokens", "2"], "tokenizer.json"),
    (["--token-ids", "1,2", "--max-new-tokens", "2", "--greedy", "--temperature", "0.5"], "--greedy"),
    (["--token-ids", "1,2", "--max-new-tokens", "2", "--temperature", "0.5", "--top-p", "1.5"], "top_p"),
])
def test_generate_user_errors_are_one_line(tiny, capsys, argv, fragment):
    assert cli(["generate", str(tiny / "cpu")] + argv) == 2
    assert fragment in _one_line_error(capsys)


def test_missing_and_tampered_artifacts_are_refused(tiny, tmp_path, capsys):
    assert cli(["generate", str(tmp_path / "nothing"), "--token-ids", "1", "--max-new-tokens", "1"]) == 2
    assert "not an artifact" in _one_line_error(capsys)
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny / "cpu", copy)
    with open(copy / "weights.safetensors", "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\x01\x02\x03")
    with pytest.raises(ArtifactError, match="weights.safetensors does not match its sha256"):
        Engine(copy, verify=True)
    manifest = json.loads((tiny / "cpu" / "manifest.json").read_text())
    manifest["format_version"] = 999
    shutil.rmtree(copy)
    shutil.copytree(tiny / "cpu", copy)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="format version"):
        Engine(copy)


@pytest.mark.parametrize("section, key, value, fragment", [
    ("pool_geometry", "state_bytes_per_request", 1, "pool_geometry disagrees with the model description"),
    ("pool_geometry", "layers", None, "pool_geometry lacks 'layers'"),
    ("model", "layer_types", None, "model description lacks or mangles field 'layer_types'"),
])
def test_the_runtime_reads_model_and_pool_from_the_manifest(tiny, tmp_path, capsys, section, key, value, fragment):
    """The engine takes the model and the pool geometry the compiler recorded (as the C++ host
    does), cross-checked, and refuses a manifest whose record is damaged in one line."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny / "cpu", copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    if value is None:
        del manifest[section][key]
    else:
        manifest[section][key] = value
    (copy / "manifest.json").write_text(json.dumps(manifest))
    assert cli(["generate", str(copy), "--token-ids", "1", "--max-new-tokens", "1"]) == 2
    assert fragment in _one_line_error(capsys)


def test_interrupted_compile_leaves_nothing(tiny, tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("dsv4c.codegen.build.build_step", boom)
    with pytest.raises(KeyboardInterrupt):
        compile_model(str(tiny / "model"), "llvm", tmp_path / "art", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_compile_refuses_existing_output_and_weightless_presets(tiny, capsys):
    assert cli(["compile", "--model", str(tiny / "model"), "--target", "llvm", "-o", str(tiny / "cpu")]) == 2
    assert "already exists" in _one_line_error(capsys)
    assert cli(["compile", "--model", "pro", "--target", "reference", "-o", str(tiny / "pro")]) == 2
    assert "--no-weights" in _one_line_error(capsys)


def test_an_artifact_for_x86_64_v3_records_its_cpu_and_runs_here(tiny, capsys):
    """--cpu x86-64-v3 builds for any AVX2 CPU: the manifest names it and the AVX2-level
    instructions it needs (no AVX-512), and it generates what the native build does."""
    art = tiny / "v3"
    assert cli(["compile", "--model", str(tiny / "model"), "--target", "llvm", "--cpu", "x86-64-v3", "-o", str(art)]) == 0
    kernels = json.loads((art / "manifest.json").read_text())["kernels"]
    assert kernels["mcpu"] == "x86-64-v3"
    assert {"sse4_2", "avx", "avx2", "fma", "bmi2"} <= set(kernels["cpu_features"])
    assert not any(f.startswith("avx512") for f in kernels["cpu_features"])
    prompt, params = [3, 4, 5], SamplingParams(max_new_tokens=8)
    ours, native = (Engine(a).generate(prompt, params, record_logits=True) for a in (art, tiny / "cpu"))
    assert ours.tokens == native.tokens
    assert float(np.abs(ours.logits - native.logits).max()) <= 1e-4


def test_a_cpu_that_lacks_the_artifacts_instructions_is_refused(tiny, capsys, monkeypatch):
    """Loading checks the manifest's instruction sets against /proc/cpuinfo's flags before any
    kernel runs (a missing instruction would kill the process). The C++ host's twin of this
    check is in test_cpp_host's breakages."""
    from dsv4c import targets

    host = targets.host_cpu_flags()
    if host is None:
        pytest.skip("no /proc/cpuinfo flags on this machine")
    needs = json.loads((tiny / "cpu" / "manifest.json").read_text())["kernels"]["cpu_features"]
    monkeypatch.setattr(targets, "host_cpu_flags", lambda: targets.HostCpu("Test CPU 9000", host.flags - {"avx2"}))
    assert "avx2" in needs
    assert cli(["generate", str(tiny / "cpu"), "--token-ids", "1,2", "--max-new-tokens", "2"]) == 2
    err = _one_line_error(capsys)
    assert "which needs avx2 that this CPU (Test CPU 9000) lacks; recompile with --cpu native" in err
    with pytest.raises(ArtifactError, match="lacks"):
        Engine(tiny / "cpu")


def test_host_cpu_flags_reads_the_first_processor(tmp_path):
    from dsv4c.targets import host_cpu_flags

    (tmp_path / "cpuinfo").write_text("processor\t: 0\nmodel name\t: Some CPU @ 3 GHz\nflags\t\t: fpu sse2 avx2\n\n"
                                      "processor\t: 1\nmodel name\t: Other\nflags\t\t: fpu\n")
    host = host_cpu_flags(str(tmp_path / "cpuinfo"))
    assert (host.model, host.flags) == ("Some CPU @ 3 GHz", {"fpu", "sse2", "avx2"})
    (tmp_path / "arm").write_text("processor\t: 0\nFeatures\t: fp asimd\n")
    assert host_cpu_flags(str(tmp_path / "arm")) is None and host_cpu_flags(str(tmp_path / "none")) is None


@pytest.mark.parametrize("target, cpu, fragment", [
    ("llvm", "znver9", "unknown CPU 'znver9' for --cpu; LLVM knows"),
    ("llvm", "", "unknown CPU ''"),
    ("sm90", "znver4", "--cpu applies to --target llvm only, not sm90"),
    ("reference", "native", "--cpu applies to --target llvm only, not reference"),
])
def test_compile_refuses_a_bad_cpu_and_writes_nothing(tiny, tmp_path, capsys, target, cpu, fragment):
    out = tmp_path / "out" / "art"
    assert cli(["compile", "--model", str(tiny / "model"), "--target", target, "--cpu", cpu, "-o", str(out)]) == 2
    err = _one_line_error(capsys)
    assert fragment in err
    if target == "llvm":
        assert "x86-64-v3" in err and "native" in err
    assert not (tmp_path / "out").exists()


def test_engine_api_errors(tiny):
    engine = Engine(tiny / "ref")
    with pytest.raises(UsageError, match="empty"):
        engine.submit([], SamplingParams())
    with pytest.raises(UsageError):
        SamplingParams(max_new_tokens=-1)
    with pytest.raises(UsageError, match="max_context"):
        engine.submit([1] * 10, SamplingParams(max_new_tokens=10**6))
    with pytest.raises(UsageError, match="no request 12345"):
        engine.result(12345)
    with pytest.raises(UsageError, match="reserve_tokens"):
        engine.pool.admit(777, reserve_tokens=-1)


def test_text_in_text_out_with_tokenizer_json(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>"] + [f"w{i}" for i in range(511)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    assert cli(["make-tiny", "--out", str(tmp_path / "model")]) == 0
    tok.save(str(tmp_path / "model" / "tokenizer.json"))
    assert cli(["compile", "--model", str(tmp_path / "model"), "--target", "reference", "-o", str(tmp_path / "a")]) == 0
    capsys.readouterr()
    assert cli(["generate", str(tmp_path / "a"), "--prompt", "w5 w6 w7", "--max-new-tokens", "4"]) == 0
    text = capsys.readouterr().out.strip()
    engine = Engine(tmp_path / "a")
    ids = engine.generate(engine.encode("w5 w6 w7"), SamplingParams(max_new_tokens=4)).tokens
    assert text == engine.decode(ids).strip() and len(text.split()) == 4


_THREADS = """
import os, sys, tvm
if len(sys.argv) > 2:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
from dsv4c.runtime.engine import Engine
from dsv4c.runtime.backend_tvm import physical_cores
from dsv4c.runtime.sampling import SamplingParams
Engine(sys.argv[1]).generate([1, 2, 3], SamplingParams(max_new_tokens=2, temperature=0.0))
print(tvm.get_global_func("runtime.NumThreads")(), physical_cores(), os.cpu_count())
"""


@pytest.mark.parametrize("env, pinned", [({}, False), ({}, True), ({"TVM_NUM_THREADS": "1"}, False),
                                         ({"OMP_NUM_THREADS": "1"}, False)])
def test_cpu_kernels_run_on_every_physical_core_unless_the_user_says(tiny, env, pinned):
    """Left alone, TVM runs kernels on half the logical CPUs of an x86 machine (assuming
    hyperthreads): one thread on a 2-vCPU VM. Loading an artifact makes it every physical core
    this process may use (one when pinned to one CPU); a thread count the user set wins."""
    clean = {k: v for k, v in os.environ.items() if k not in ("TVM_NUM_THREADS", "OMP_NUM_THREADS")}
    args = [sys.executable, "-c", _THREADS, str(tiny / "cpu")] + (["pin"] if pinned else [])
    done = subprocess.run(args, env={**clean, **env}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    threads, cores, cpus = map(int, done.stdout.split()[-3:])
    assert 1 <= cores <= cpus
    if pinned:
        assert cores == 1
    assert threads == (1 if env else cores)


_RUNTIME_ONLY = """
import sys
from dsv4c.runtime.engine import Engine
from dsv4c.runtime.sampling import SamplingParams
tokens = Engine(sys.argv[1]).generate([1, 2, 3], SamplingParams(max_new_tokens=2, temperature=0.0)).tokens
print(len(tokens), sorted(m for m in sys.modules if m.split(".")[0] in ("tvm", "torch", "ml_dtypes")
                          or m.startswith(("dsv4c.ir", "dsv4c.frontend", "dsv4c.passes", "dsv4c.codegen"))))
# What runtime.tvm_runtime says still works when torch, ml_dtypes and the compiler come later.
import ml_dtypes, numpy as np, torch, tvm
assert tvm.runtime.from_dlpack(torch.arange(4, dtype=torch.float32)).numpy().tolist() == [0, 1, 2, 3]
assert tvm.runtime.tensor(np.arange(3, dtype=np.float32).astype(ml_dtypes.bfloat16)).numpy().tolist() == [0, 1, 2]
print("later imports work")
"""


def test_running_an_llvm_artifact_imports_no_compiler_and_no_torch(tiny):
    """The runtime loads TVM's FFI and runtime library, not ``tvm`` (its compiler's Python side)
    nor torch / ml_dtypes that tvm_ffi would import: seconds of start-up (bench/startup.py)."""
    pytest.importorskip("torch")
    done = subprocess.run([sys.executable, "-c", _RUNTIME_ONLY, str(tiny / "cpu")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["2 []", "later imports work"]


def test_device_copies_take_read_only_and_strided_arrays():
    """GPU backends copy mapped (read-only) weights to the device; here the same helpers on the CPU."""
    from dsv4c.runtime import tvm_runtime

    mapped = np.arange(12, dtype=np.uint16).reshape(3, 4)[:, 1::2]
    mapped.flags.writeable = False
    copy = tvm_runtime.to_numpy(tvm_runtime.to_device(mapped, tvm_runtime.CPU))
    assert copy.dtype == np.uint16 and copy.tolist() == mapped.tolist() and copy.flags.writeable
