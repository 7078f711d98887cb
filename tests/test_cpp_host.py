"""The C++ runtime (runtime/cpp) and its example host (examples/cpp_host) against Python.

The module builds examples/cpp_host with CMake in a fresh build directory (while the tiny model
compiles for the llvm target), then checks that ``dsv4c_host``

* prints the tokens ``dsv4c generate --greedy`` prints, with logits within 1e-6 (single and
  batched requests, chunked prefill),
* fails like the Python CLI: exit status 2 and the same one-line message on stderr,

and that the C++ KV pool makes the Python KVPool's decisions on random operation traces
(admit / ensure / free / exhaust, valid or not), state by state.
"""

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dsv4c.cli import main as cli
from dsv4c.compile import compile_model
from dsv4c.errors import DsvError, UsageError
from dsv4c.frontend.config import config_from_dict, preset
from dsv4c.passes.quant_plan import plan_for
from dsv4c.artifact.manifest import FORMAT_VERSION, read_manifest
from dsv4c.runtime.engine import Engine
from dsv4c.artifact.pool import ENVELOPE_TOKENS, PoolGeometry
from dsv4c.runtime.kv_pool import KVPool, PoolExhausted
from dsv4c.runtime.sampling import SamplingParams
from dsv4c.runtime.weights import open_weights

from file_breakages import corrupt_header, flip_byte, offsets_past_the_end, truncate

REPO = Path(__file__).resolve().parents[1]


def _build(build_dir: Path) -> str | None:
    """Configure and build the host and the pool-trace tool; the failure's output, or None."""
    for cmd in (["cmake", "-S", str(REPO / "examples" / "cpp_host"), "-B", str(build_dir),
                 f"-DDSV4C_PYTHON={sys.executable}"],
                ["cmake", "--build", str(build_dir), "-j", str(os.cpu_count() or 2),
                 "--target", "dsv4c_host", "dsv4c_pool_trace", "dsv4c_weights_dump"]):
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            return f"{' '.join(cmd)} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return None


@pytest.fixture(scope="module")
def cpp(tmp_path_factory, tiny_llvm):
    """(build directory, tiny llvm artifact)."""
    build = tmp_path_factory.mktemp("cpp_host") / "build"
    failure = _build(build)
    if failure:
        pytest.fail(failure)
    return build, tiny_llvm


def _host(build: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([str(build / "dsv4c_host"), *map(str, args)], capture_output=True, text=True, timeout=120)


def _assert_close(cpp_logits: np.ndarray, py_logits: np.ndarray) -> None:
    assert cpp_logits.dtype == np.float32 and cpp_logits.shape == py_logits.shape
    assert float(np.abs(cpp_logits - py_logits).max()) <= 1e-6


# --------------------------------------------------------------------------- generation


def test_host_prints_what_dsv4c_generate_prints(cpp, tmp_path, capsys):
    build, art = cpp
    assert cli(["generate", str(art), "--token-ids", "1,2,3", "--max-new-tokens", "8", "--greedy",
                "--logits-out", str(tmp_path / "py.npy")]) == 0
    expected = capsys.readouterr().out
    done = _host(build, art, "--token-ids", "1,2,3", "--max-new-tokens", "8", "--logits-out", tmp_path / "cpp.npy")
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == expected and len(expected.split()) == 8
    _assert_close(np.load(tmp_path / "cpp.npy"), np.load(tmp_path / "py.npy"))


@pytest.mark.parametrize("prompts, new_tokens, chunk", [
    # Past the sliding window (8) and both compress ratios (4, 16), prompt fed in chunks of 7.
    ([list(range(5, 25))], 14, 7),
    # Three requests batched in every step; the short one decodes while the others still prefill.
    ([list(range(5, 25)), [7, 8, 9], list(range(100, 140))], 20, 8),
], ids=["chunked-prefill", "batched"])
def test_host_matches_the_python_engine(cpp, tmp_path, prompts, new_tokens, chunk):
    build, art = cpp
    engine = Engine(art, prefill_chunk=chunk, max_context=max(4096, new_tokens + 8192))
    ids = [engine.submit(p, SamplingParams(max_new_tokens=new_tokens), record_logits=True) for p in prompts]
    engine.run()
    results = [engine.result(i) for i in ids]
    args = [a for p in prompts for a in ("--token-ids", ",".join(map(str, p)))]
    done = _host(build, art, *args, "--max-new-tokens", new_tokens, "--prefill-chunk", chunk,
                 "--logits-out", tmp_path / "cpp.npy")
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.splitlines() == [" ".join(map(str, r.tokens)) for r in results]
    _assert_close(np.load(tmp_path / "cpp.npy"), np.concatenate([r.logits for r in results]))


# --------------------------------------------------------------------------- errors


def _set_version(version):
    def edit(art: Path) -> None:
        manifest = json.loads((art / "manifest.json").read_text())
        manifest["format_version"] = version
        (art / "manifest.json").write_text(json.dumps(manifest))
    return edit


def _edit_kernels(edit):
    def breakage(art: Path) -> None:
        manifest = json.loads((art / "manifest.json").read_text())
        edit(manifest["kernels"])
        (art / "manifest.json").write_text(json.dumps(manifest))
    return breakage


# Each breakage, and whether the run asks for the full sha256 check (--verify).
BREAKAGES = {
    "tampered-weights": lambda art: flip_byte(art / "weights.safetensors"),
    # Small files are hashed at every load: a damaged library is named, not run.
    "tampered-library": lambda art: flip_byte(art / "model.so", offset=-4096),
    "tampered-program": lambda art: flip_byte(art / "program.json", offset=-2),
    "truncated-weights": lambda art: truncate(art / "weights.safetensors"),
    "corrupt-weights-header": lambda art: corrupt_header(art / "weights.safetensors"),
    "missing-file": lambda art: (art / "program.json").unlink(),
    "no-manifest": lambda art: (art / "manifest.json").unlink(),
    "unreadable-manifest": lambda art: (art / "manifest.json").write_text("{"),
    "manifest-not-an-object": lambda art: (art / "manifest.json").write_text("[1]"),
    **{f"version-{v!r}": _set_version(v) for v in (1, FORMAT_VERSION - 1, FORMAT_VERSION + 1, True, 2.5, 1e16,
                                                   str(FORMAT_VERSION), None, [1, 2], {"it's": "x"})},
    # An instruction set no CPU has (so this CPU lacks it, AVX-512 or not), and manifests from
    # before the CPU check.
    "cpu-lacks-an-instruction-set": _edit_kernels(lambda k: k["cpu_features"].append("dsv4c_no_such_isa")),
    "no-cpu-features": _edit_kernels(lambda k: k.pop("cpu_features")),
    "cpu-features-not-strings": _edit_kernels(lambda k: k.update(cpu_features=["avx2", 1])),
    "no-mcpu": _edit_kernels(lambda k: k.pop("mcpu")),
}
VERIFIED = {"tampered-weights"}  # found only by hashing


@pytest.mark.parametrize("breakage", [None, *BREAKAGES], ids=["missing-artifact", *BREAKAGES])
def test_host_errors_are_the_python_cli_errors(cpp, tmp_path, capsys, breakage):
    build, art = cpp
    target = tmp_path / "art"
    if breakage is not None:
        shutil.copytree(art, target)
        BREAKAGES[breakage](target)
    # Messages name the artifact as pathlib prints it: "//" and a trailing "/" are normalised.
    path = f"{tmp_path}//art/"
    args = ["--token-ids", "1,2", "--max-new-tokens", "2", *(["--verify"] if breakage in VERIFIED else [])]
    assert cli(["generate", path, *args]) == 2
    expected = capsys.readouterr().err
    done = _host(build, path, *args)
    assert (done.returncode, done.stdout, done.stderr) == (2, "", expected)
    assert expected.startswith(f"dsv4c: error: {tmp_path}/art") and expected.count("\n") == 1


def test_host_refuses_a_gpu_artifact_here_like_python(cpp, tmp_path, capsys):
    """The C++ host runs GPU artifacts on a host with that GPU; here it has none and says so in
    the Python CLI's words."""
    build, art = cpp
    target = tmp_path / "art"
    shutil.copytree(art, target)
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["target"] = "sm90"
    (target / "manifest.json").write_text(json.dumps(manifest))
    assert cli(["generate", str(target), "--token-ids", "1,2", "--max-new-tokens", "2"]) == 2
    expected = capsys.readouterr().err
    assert "needs that GPU and this host has none" in expected
    done = _host(build, target, "--token-ids", "1,2", "--max-new-tokens", "2")
    assert (done.returncode, done.stdout, done.stderr) == (2, "", expected)


def test_host_refuses_a_multi_rank_artifact_in_one_line(cpp, tmp_path):
    """A --tensor-parallel artifact runs as a process per rank (``dsv4c generate``); the C++ host
    stays one process and says so before it allocates anything."""
    build, art = cpp
    target = tmp_path / "art"
    shutil.copytree(art, target)
    _set_manifest(target, tensor_parallel=2)
    done = _host(build, target, "--token-ids", "1,2", "--max-new-tokens", "2")
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (f"dsv4c: error: {target}: compiled with --tensor-parallel 2; the C++ runtime runs one-device "
                           "artifacts: run it with `dsv4c generate` or `dsv4c serve` (a process per rank), or compile "
                           "it with --tensor-parallel 1\n")


def test_host_runs_an_fp8_pool_artifact_like_dsv4c_generate(cpp, tmp_path, capsys):
    """One executor: the FP8 / E8M0 / BF16 pool rows are the compiled step's, whoever calls it."""
    build, art = cpp
    fp8 = tmp_path / "fp8"
    assert cli(["compile", "--model", str(art.parent / "model"), "--target", "llvm", "--kv-cache-dtype", "fp8",
                "-o", str(fp8)]) == 0
    capsys.readouterr()
    prompt = ",".join(map(str, range(5, 45)))  # past the window and several compressed windows
    assert cli(["generate", str(fp8), "--token-ids", prompt, "--max-new-tokens", "24", "--greedy"]) == 0
    expected = capsys.readouterr().out
    done = _host(build, fp8, "--token-ids", prompt, "--max-new-tokens", "24")
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == expected and len(expected.split()) == 24


def test_host_reads_or_maps_the_weights_to_the_same_tokens(cpp, capsys):
    build, art = cpp
    assert cli(["generate", str(art), "--token-ids", "4,5,6", "--max-new-tokens", "6", "--weights", "read"]) == 0
    expected = capsys.readouterr().out
    for mode in ("read", "map", "auto"):
        done = _host(build, art, "--token-ids", "4,5,6", "--max-new-tokens", "6", "--weights", mode)
        assert (done.returncode, done.stderr, done.stdout) == (0, "", expected), mode
    with pytest.raises(UsageError) as info:
        Engine(art, weights="all")
    done = _host(build, art, "--token-ids", "4", "--max-new-tokens", "1", "--weights", "all")
    assert (done.returncode, done.stderr) == (2, f"dsv4c: error: {info.value}\n")


@pytest.mark.parametrize("argv", [
    ["--token-ids", "1,512", "--max-new-tokens", "2"],
    ["--token-ids", "1", "--max-new-tokens", "2", "--prefill-chunk", "0"],
    ["--token-ids", "1", "--max-new-tokens", "-1"],
], ids=["vocabulary", "prefill-chunk", "max-new-tokens"])
def test_host_usage_errors_are_the_python_cli_errors(cpp, capsys, argv):
    build, art = cpp
    assert cli(["generate", str(art), *argv]) == 2
    expected = capsys.readouterr().err
    done = _host(build, art, *argv)
    assert (done.returncode, done.stderr) == (2, expected)


def test_tampering_goes_unseen_without_verify_in_both(cpp, tmp_path, capsys):
    build, art = cpp
    target = Path(shutil.copytree(art, tmp_path / "art"))
    flip_byte(target / "weights.safetensors")
    assert cli(["generate", str(target), "--token-ids", "1,2", "--max-new-tokens", "2"]) == 0
    done = _host(build, target, "--token-ids", "1,2", "--max-new-tokens", "2")
    assert (done.returncode, done.stdout) == (0, capsys.readouterr().out)


# --------------------------------------------------------------------------- weights


def _dump(build: Path, art: Path, *flags: str) -> subprocess.CompletedProcess:
    tool = build / "dsv4c_runtime" / "dsv4c_weights_dump"
    return subprocess.run([str(tool), str(art), *flags], capture_output=True, text=True, timeout=120)


def _checksum(array: np.ndarray) -> int:
    data = np.ascontiguousarray(array).reshape(-1).view(np.uint8).astype(np.uint64)
    return int((data * (np.arange(data.size, dtype=np.uint64) % 65521 + 1)).sum(dtype=np.uint64))


@pytest.fixture(scope="module")
def sharded(cpp, tmp_path_factory):
    """The tiny llvm artifact with its weights over several files."""
    art = tmp_path_factory.mktemp("sharded") / "art"
    return compile_model(str(cpp[1].parent / "model"), "llvm", art, progress=False, log=lambda *_: None,
                         shard_bytes=256 << 10)


@pytest.mark.parametrize("read", [False, True], ids=["mapped", "read"])
def test_cpp_weights_are_the_python_loaders(cpp, sharded, read):
    build, _ = cpp
    assert len(read_manifest(sharded).weights.files) > 2
    done = _dump(build, sharded, *(["--read"] if read else []))
    assert (done.returncode, done.stderr) == (0, "")
    weights = open_weights(sharded, read_manifest(sharded), read=read)
    codes = {"f": 2, "u": 1, "i": 0, "b": 6}  # DLPack type codes of numpy kinds
    expected = [f"{name} {codes[a.dtype.kind]} {a.dtype.itemsize * 8} {','.join(map(str, a.shape))} {_checksum(a)} "
                f"{int(a.ctypes.data % 64 == 0)}" for name, a in sorted(weights.items())]
    assert done.stdout.splitlines() == expected
    assert all(a.ctypes.data % 64 == 0 for a in weights.values() if a.nbytes % 64 == 0)


def _drop_from_index(art: Path) -> None:
    index = json.loads((art / "weights.safetensors.index.json").read_text())
    index["weight_map"].pop("head.weight")
    (art / "weights.safetensors.index.json").write_text(json.dumps(index))


WEIGHT_BREAKAGES = {
    "truncated-shard": lambda art, shard: truncate(shard),
    "offsets-past-the-end": lambda art, shard: offsets_past_the_end(shard),
    "index-not-json": lambda art, shard: (art / "weights.safetensors.index.json").write_text("{"),
    "tensor-missing-from-index": lambda art, shard: _drop_from_index(art),
    "no-weights": lambda art, shard: _set_manifest(art, has_weights=False),
    "no-weight-list": lambda art, shard: _set_manifest(art, weights={"index": 3}),
}


def _set_manifest(art: Path, **values) -> None:
    manifest = json.loads((art / "manifest.json").read_text())
    manifest.update(values)
    (art / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("read", [False, True], ids=["mapped", "read"])
@pytest.mark.parametrize("breakage", sorted(WEIGHT_BREAKAGES))
def test_cpp_weight_errors_are_the_python_loaders(cpp, sharded, tmp_path, breakage, read):
    build, _ = cpp
    art = Path(shutil.copytree(sharded, tmp_path / "art"))
    WEIGHT_BREAKAGES[breakage](art, art / read_manifest(sharded).weights.files[-1])
    with pytest.raises(DsvError) as info:
        open_weights(art, read_manifest(art), read=read)
    done = _dump(build, art, *(["--read"] if read else []))
    assert (done.returncode, done.stdout, done.stderr) == (2, "", f"dsv4c: error: {info.value}\n")


# --------------------------------------------------------------------------- KV pool conformance


def _state(pool: KVPool, error) -> dict:
    return {"error": error, "requests": [[seq, r.slot, list(r.blocks)] for seq, r in sorted(pool.requests.items())],
            "env_high": pool._env_high, "slot_high": pool._slot_high, "env_free": list(pool._env_free),
            "slot_free": list(pool._slot_free), "free_envelopes": pool.free_envelopes}


def _trace(rng: random.Random, pool: KVPool, steps: int) -> tuple[list[str], list[dict]]:
    """Random operations, run through the Python pool: (ops, the state after each)."""
    ops, states, next_seq = [], [], 0
    for _ in range(steps):
        live = sorted(pool.requests)
        kind = rng.choices(["admit", "ensure", "free", "exhaust", "invalid"], [4, 5, 3, 1, 1])[0]
        if kind == "admit" or (not live and kind in ("ensure", "free")):
            op, next_seq = f"admit {next_seq} {rng.randrange(0, 3 * ENVELOPE_TOKENS)}", next_seq + 1
        elif kind == "ensure":
            seq = rng.choice(live)
            op = f"ensure {seq} {max(0, len(pool.requests[seq].blocks) * ENVELOPE_TOKENS + rng.randrange(-300, 700))}"
        elif kind == "free":
            op = f"free {rng.choice(live)}"
        elif kind == "exhaust":  # more envelopes than the pool has
            tokens = (pool.max_envelopes + 1) * ENVELOPE_TOKENS
            op = f"ensure {rng.choice(live)} {tokens}" if live else f"admit {next_seq} {tokens}"
        else:  # a request admitted twice, or one the pool does not know
            op = rng.choice([f"admit {live[0]} 0" if live else "free 999", f"ensure {next_seq + 5} 1", "free -1"])
        name, seq, *count = op.split()
        error = None
        try:
            {"admit": pool.admit, "ensure": pool.ensure, "free": pool.free}[name](int(seq), *map(int, count))
        except (PoolExhausted, UsageError) as e:
            error = [type(e).__name__, str(e)]
        ops.append(op)
        states.append(_state(pool, error))
    return ops, states


def _geometries(art: Path, root: Path):
    """(geometry file for the C++ tool, the Python PoolGeometry): the tiny artifact's manifest
    itself, and manifest-like files for the full-size presets."""
    manifest = json.loads((art / "manifest.json").read_text())
    cfg = config_from_dict(manifest["model"], manifest["model_name"])
    yield art / "manifest.json", PoolGeometry.build(cfg, plan_for(cfg, "llvm", "exact"))
    for name in ("flash", "pro"):
        cfg = preset(name)
        geometry = PoolGeometry.build(cfg, plan_for(cfg, "llvm", "exact"))
        path = root / f"{name}.json"
        path.write_text(json.dumps({"model": cfg.to_json_dict("hf"), "pool_geometry": geometry.summary()}))
        yield path, geometry


def test_cpp_pool_makes_the_python_pools_decisions(cpp, tmp_path):
    build, art = cpp
    for geometry_file, geometry in _geometries(art, tmp_path):
        for seed in range(6):
            rng = random.Random(seed)
            # From one request's windows to a few requests with a few envelopes each.
            total_rows = rng.randrange(geometry.window_rows_per_request,
                                       3 * geometry.window_rows_per_request + 6 * geometry.rows_per_envelope)
            ops, expected = _trace(rng, KVPool(geometry, total_rows), 150)
            tool = build / "dsv4c_runtime" / "dsv4c_pool_trace"
            done = subprocess.run([str(tool), str(geometry_file), str(total_rows)], input="\n".join(ops) + "\n",
                                  capture_output=True, text=True, timeout=60)
            assert (done.returncode, done.stderr) == (0, "")
            got = [json.loads(line) for line in done.stdout.splitlines()]
            assert len(got) == len(ops)
            for op, g, e in zip(ops, got, expected):
                assert g == e, f"{geometry_file.name}, seed {seed}, total_rows {total_rows}: after {op!r}"
            assert any(s["error"] and s["error"][0] == "PoolExhausted" for s in expected)


def test_host_refuses_a_v41_step_with_engram_rows_in_one_line(cpp, tmp_path):
    from v41_case import compile_case

    build, _ = cpp
    done = _host(build, compile_case(tmp_path, "llvm"), "--token-ids", "1,2,3", "--max-new-tokens", "2")
    assert done.returncode != 0 and "Engram rows" in done.stderr and done.stderr.strip().count("\n") == 0
