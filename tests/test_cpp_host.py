"""The C++ runtime (runtime/cpp) and its example host (examples/cpp_host) against Python.

The module builds examples/cpp_host with CMake in a fresh build directory (while the tiny model
compiles for the llvm target), then checks that ``dsv4c_host``

* prints the tokens ``dsv4c generate --greedy`` prints, with logits within 1e-6 (single and
  batched requests, chunked prefill; V4 and DeepSeek-V4.1 with its Engram rows),
* fails like the Python CLI: exit status 2 and the same one-line message on stderr,

that the C++ KV pool makes the Python KVPool's decisions on random operation traces
(admit / ensure / free / exhaust, valid or not), state by state, and that the C++ Engram hash
computes Python's rows for random requests fed in random chunks and refuses the hash files
Python refuses, in the same words.
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

from dsv4c.artifact.engram import EngramTables
from dsv4c.artifact.file_names import ENGRAM_HASH
from dsv4c.artifact.safetensors_io import SafetensorsFile, write_safetensors
from dsv4c.cli import main as cli
from dsv4c.compile import compile_model
from dsv4c.errors import ArtifactError, DsvError, UsageError
from dsv4c.frontend.config import config_from_dict, preset
from dsv4c.frontend.engram import hash_multipliers, hash_primes
from dsv4c.passes.quant_plan import plan_for
from dsv4c.artifact.manifest import FORMAT_VERSION, read_manifest
from dsv4c.runtime.engine import Engine
from dsv4c.artifact.pool import ENVELOPE_TOKENS, PoolGeometry
from dsv4c.runtime.kv_pool import KVPool, PoolExhausted
from dsv4c.runtime.sampling import SamplingParams
from dsv4c.runtime.weights import open_weights

from file_breakages import corrupt_header, flip_byte, offsets_past_the_end, truncate
from v41_case import GREEDY as V41_GREEDY, TOKEN_IDS as V41_PROMPT, prompt as v41_prompt

REPO = Path(__file__).resolve().parents[1]


def _build(build_dir: Path) -> str | None:
    """Configure and build the host and its conformance tools; the failure's output, or None."""
    for cmd in (["cmake", "-S", str(REPO / "examples" / "cpp_host"), "-B", str(build_dir),
                 f"-DDSV4C_PYTHON={sys.executable}"],
                ["cmake", "--build", str(build_dir), "-j", str(os.cpu_count() or 2),
                 "--target", "dsv4c_host", "dsv4c_pool_trace", "dsv4c_weights_dump", "dsv4c_engram_rows"]):
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
    """The batched case also gives back the VM's cached buffers before every step
    (EngineOptions::release_cached_memory_every 0): the steps after allocate theirs afresh."""
    build, art = cpp
    release = ["--release-cached-memory-every", "0"] if len(prompts) > 1 else []
    _assert_host_runs_like_the_engine(build, art, tmp_path, prompts, new_tokens, chunk, *release)


def _assert_host_runs_like_the_engine(build: Path, art: Path, tmp_path: Path, prompts, new_tokens: int, chunk: int,
                                      *options) -> None:
    """The prompts batched, in prefill chunks of ``chunk``: the host's tokens and logits are the
    Python engine's."""
    engine = Engine(art, prefill_chunk=chunk, max_context=max(4096, new_tokens + 8192))
    ids = [engine.submit(p, SamplingParams(max_new_tokens=new_tokens), record_logits=True) for p in prompts]
    engine.run()
    results = [engine.result(i) for i in ids]
    args = [a for p in prompts for a in ("--token-ids", ",".join(map(str, p)))]
    done = _host(build, art, *args, "--max-new-tokens", new_tokens, "--prefill-chunk", chunk,
                 "--logits-out", tmp_path / "cpp.npy", *options)
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


def test_host_refuses_a_negative_release_interval(cpp):
    build, art = cpp
    done = _host(build, art, "--token-ids", "1", "--max-new-tokens", "1", "--release-cached-memory-every", "-1")
    assert done.returncode == 2 and done.stderr.endswith(
        "dsv4c_host: error: argument --release-cached-memory-every: expected seconds >= 0, got '-1'\n")


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


# --------------------------------------------------------------------------- DeepSeek-V4.1 (Engram)


@pytest.fixture(scope="module")
def v41(v41_case_artifacts):
    """The V4.1 parity case (tests/v41_case.py) compiled for llvm, as a model that sees images:
    the host runs its text prompts (its prefill takes no image rows)."""
    return v41_case_artifacts["llvm"]


def _released_size_hash() -> EngramTables:
    """Hash constants of the released model's sizes (v41-flash: 384 M rows a layer, 8 heads,
    4-grams; multipliers up to int64's bound over the compressed vocabulary), a random token map."""
    e = preset("v41-flash").engram
    token_map = np.random.default_rng(0).integers(0, e.compressed_vocab_size, 129280).astype(np.int32)
    return EngramTables(token_map, e.layer_ids, hash_primes(len(e.layer_ids), e.vocab_size, e.max_ngram_size, e.n_heads),
                        hash_multipliers(e.layer_ids, e.max_ngram_size, e.compressed_vocab_size),
                        e.compressed_vocab_size, e.pad_id)


def _engram_rows(build: Path, hash_file: Path, lines: list[str]) -> subprocess.CompletedProcess:
    tool = build / "dsv4c_runtime" / "dsv4c_engram_rows"
    return subprocess.run([str(tool), str(hash_file)], input="".join(f"{line}\n" for line in lines),
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("which", ["case", "released-size"])
def test_cpp_engram_rows_are_the_python_hash(cpp, v41, tmp_path, which):
    """Random requests fed in random chunks, as an engine feeds them (each chunk sees the request's
    tokens up to its end): the C++ rows of the chunks are the Python hash of the whole sequence."""
    build, _ = cpp
    hash_file = v41 / ENGRAM_HASH
    if which == "released-size":
        hash_file = tmp_path / ENGRAM_HASH
        _released_size_hash().save(hash_file)
    tables = EngramTables.load(hash_file)
    rng = np.random.default_rng(7)
    lines, requests = [], []
    for _ in range(60):
        tokens = rng.integers(0, len(tables.token_map), int(rng.integers(1, 120))).tolist()
        stops = sorted({*rng.integers(1, len(tokens) + 1, int(rng.integers(0, 8))).tolist(), len(tokens)})
        lines += [f"{start} {stop} {' '.join(map(str, tokens[:stop]))}" for start, stop in zip([0, *stops], stops)]
        requests.append((tokens, len(stops)))
    bad = len(tables.token_map)
    lines.append(f"0 2 1 {bad}")
    done = _engram_rows(build, hash_file, lines)
    assert (done.returncode, done.stderr) == (0, "")
    got = done.stdout.splitlines()
    assert len(got) == len(lines)
    for tokens, chunks in requests:
        whole = tables.row_ids(tables.compress(tokens), 0, np.arange(len(tokens)))
        assert whole.max() < 2**31
        rows = np.array(" ".join(got[:chunks]).split(), np.int64).reshape(whole.shape)
        np.testing.assert_array_equal(rows, whole)
        got = got[chunks:]
    with pytest.raises(UsageError) as info:
        tables.compress([1, bad])
    assert got == [str(info.value)]


def _rewrite_hash(**changes):
    """A breakage that rewrites the case's hash file with some tensors or metadata changed."""
    def breakage(path: Path) -> None:
        t = EngramTables.load(path)
        arrays = {"token_map": ("I32", t.token_map), "layer_ids": ("I64", np.asarray(t.layer_ids, np.int64)),
                  "primes": ("I64", t.primes), "multipliers": ("I64", t.multipliers)}
        metadata = {"compressed_vocab_size": str(t.compressed_vocab_size), "pad": str(t.pad)}
        for name, value in changes.items():
            if name in arrays:
                arrays[name] = value(t)
            else:
                metadata[name] = value
        arrays = {name: a for name, a in arrays.items() if a is not None}
        write_safetensors(path, arrays, metadata={k: v for k, v in metadata.items() if v is not None})
    return breakage


HASH_BREAKAGES = {
    "not-a-hash-file": lambda path: write_safetensors(path, {"w": ("F32", np.zeros(3, np.float32))}),
    "no-primes": _rewrite_hash(primes=lambda t: None),
    "token-map-dtype": _rewrite_hash(token_map=lambda t: ("I64", t.token_map.astype(np.int64))),
    "no-pad": _rewrite_hash(pad=None),
    "size-not-an-integer": _rewrite_hash(compressed_vocab_size="2.5e2"),
    "axes": _rewrite_hash(primes=lambda t: ("I64", t.primes.reshape(-1))),
    "layers-do-not-fit": _rewrite_hash(multipliers=lambda t: ("I64", t.multipliers[:, :3])),
    "pad-outside": _rewrite_hash(pad="254"),
    "token-map-outside": _rewrite_hash(compressed_vocab_size="100"),
    "overflow": _rewrite_hash(multipliers=lambda t: ("I64", t.multipliers * 1000)),
    "truncated": truncate,
    "corrupt-header": corrupt_header,
    "missing": lambda path: path.unlink(),
}


@pytest.mark.parametrize("breakage", sorted(HASH_BREAKAGES))
def test_cpp_engram_hash_errors_are_the_python_loaders(cpp, v41, tmp_path, breakage):
    build, _ = cpp
    hash_file = tmp_path / ENGRAM_HASH
    shutil.copyfile(v41 / ENGRAM_HASH, hash_file)
    HASH_BREAKAGES[breakage](hash_file)
    with pytest.raises(ArtifactError) as info:
        EngramTables.load(hash_file)
    done = _engram_rows(build, hash_file, [])
    assert (done.returncode, done.stdout, done.stderr) == (2, "", f"dsv4c: error: {info.value}\n")


@pytest.mark.parametrize("chunk", [None, 5, 1])
def test_host_runs_v41_like_dsv4c_generate(cpp, v41, tmp_path, capsys, chunk):
    """The parity case's prompt, whole or in prefill chunks: the reference's greedy tokens, and
    logits bit for bit those of ``dsv4c generate``."""
    build, _ = cpp
    args = ["--token-ids", ",".join(map(str, V41_PROMPT)), "--max-new-tokens", str(len(V41_GREEDY)),
            *(["--prefill-chunk", str(chunk)] if chunk else [])]
    assert cli(["generate", str(v41), *args, "--greedy", "--logits-out", str(tmp_path / "py.npy")]) == 0
    expected = capsys.readouterr().out
    done = _host(build, v41, *args, "--logits-out", tmp_path / "cpp.npy")
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == expected and expected.split() == [str(t) for t in V41_GREEDY]
    _assert_close(np.load(tmp_path / "cpp.npy"), np.load(tmp_path / "py.npy"))


# How the host holds the Engram tables (where the artifact keeps them in files of their own).
TABLE_OPTIONS = pytest.mark.parametrize("options", [[], ["--engram-memory", "read"], ["--gather-engram-rows"]],
                                        ids=["mapped", "read", "gathered"])


@TABLE_OPTIONS
def test_host_runs_a_v41_batch_like_the_python_engine(cpp, v41, tmp_path, options):
    """Three requests of other lengths batched, in prefill chunks that never line up; the Engram
    tables (where the artifact keeps them in files of their own) mapped, read, or passed as the
    rows each step reads, as off the CPU: the same tokens and logits."""
    build, _ = cpp
    prompts = [V41_PROMPT, v41_prompt(5, 30), v41_prompt(6, 71)]
    _assert_host_runs_like_the_engine(build, v41, tmp_path, prompts, 12, 13, *options)


@pytest.fixture
def v41_fp8(v41_fp8_artifacts):
    """v41-tiny as the release stores it, compiled for llvm (conftest.py)."""
    return v41_fp8_artifacts["llvm"]


@TABLE_OPTIONS
def test_host_runs_an_fp8_v41_model_like_dsv4c_generate(cpp, v41_fp8, tmp_path, capsys, options):
    build, _ = cpp
    prompt = ",".join(map(str, np.random.default_rng(4).integers(3, 250, 37).tolist()))  # v41-tiny: 272 ids
    args = ["--token-ids", prompt, "--max-new-tokens", "6", "--prefill-chunk", "5"]
    capsys.readouterr()
    assert cli(["generate", str(v41_fp8), *args, "--greedy", "--logits-out", str(tmp_path / "py.npy")]) == 0
    expected = capsys.readouterr().out
    done = _host(build, v41_fp8, *args, "--logits-out", tmp_path / "cpp.npy", *options)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == expected and len(expected.split()) == 6
    _assert_close(np.load(tmp_path / "cpp.npy"), np.load(tmp_path / "py.npy"))


def _rewrite_table(**tensors):
    """A breakage that rewrites the first Engram table file with ``tensors`` (name -> function of
    the file's rows), its size recorded in the manifest as compile would have."""
    def breakage(art: Path, manifest: dict) -> None:
        name = manifest["engram"]["tables"][0]["file"]
        with SafetensorsFile(art / name) as file:
            rows = np.array(file.read_raw("rows"))
        write_safetensors(art / name, {n: ("F32" if a.dtype == np.float32 else "U8", a)
                                       for n, a in ((n, make(rows)) for n, make in tensors.items())})
        manifest["files"][name]["bytes"] = (art / name).stat().st_size
    return breakage


def _older_layout(art: Path, manifest: dict) -> None:
    inputs = manifest["vm"]["inputs"]
    manifest["vm"]["inputs"] = inputs[:inputs.index("engram_rows") + 1]


TABLE_BREAKAGES = {
    "wrong-width": _rewrite_table(rows=lambda rows: np.zeros((rows.shape[0], rows.shape[1] + 1), rows.dtype)),
    "stray-tensor": _rewrite_table(rows=lambda rows: rows, other=lambda rows: rows[:1]),
    "older-layout": _older_layout,
}


def _fails_like_the_cli(build: Path, art: Path, capsys) -> str:
    """The host's error for ``art`` is ``dsv4c generate``'s, exit status and line; that line."""
    args = ["--token-ids", "4,5", "--max-new-tokens", "1"]
    assert cli(["generate", str(art), *args]) == 2
    expected = capsys.readouterr().err
    done = _host(build, art, *args)
    assert (done.returncode, done.stdout, done.stderr) == (2, "", expected)
    return expected


@pytest.mark.parametrize("breakage", sorted(TABLE_BREAKAGES))
def test_host_refuses_a_damaged_engram_table_like_python(cpp, v41, tmp_path, capsys, breakage):
    build, _ = cpp
    art = Path(shutil.copytree(v41, tmp_path / "art"))
    manifest = json.loads((art / "manifest.json").read_text())
    if "engram" not in manifest:
        pytest.skip("this artifact keeps its Engram tables among the weights (no manifest 'engram' section)")
    TABLE_BREAKAGES[breakage](art, manifest)
    (art / "manifest.json").write_text(json.dumps(manifest))
    assert _fails_like_the_cli(build, art, capsys).count("\n") == 1


def test_host_refuses_other_engram_memory_modes_in_one_line(cpp, v41):
    build, art = cpp
    for artifact in (v41, art):  # accepted and without effect for a model without Engram
        done = _host(build, artifact, "--token-ids", "4", "--max-new-tokens", "1", "--engram-memory", "read")
        assert (done.returncode, done.stderr) == (0, "")
        done = _host(build, artifact, "--token-ids", "4", "--max-new-tokens", "1", "--engram-memory", "all")
        assert (done.returncode, done.stdout) == (2, "")
        assert done.stderr == "dsv4c: error: Engram memory mode 'all' is not one of map, read\n"


def test_host_needs_the_hash_file_of_a_v41_step(cpp, v41, tmp_path, capsys):
    """An artifact compiled without a tokenizer has no hash file: manifest ``engram.hash`` null
    (an artifact from before the ``engram`` section: no file)."""
    build, _ = cpp
    art = Path(shutil.copytree(v41, tmp_path / "art"))
    (art / ENGRAM_HASH).unlink()
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["files"].pop(ENGRAM_HASH)
    if "engram" in manifest:
        manifest["engram"]["hash"] = None
    (art / "manifest.json").write_text(json.dumps(manifest))
    assert "has no engram_hash.safetensors" in _fails_like_the_cli(build, art, capsys)


# --------------------------------------------------------------------------- vision
def test_host_encodes_an_image_like_python(cpp, v41_vision_artifact, tmp_path, capsys):
    """``--encode-image``: the span rows of pixels the host prepared are TvmBackend.encode_image's,
    bit for bit; pixels that are not whole patches fail in Python's words."""
    build, _ = cpp
    pixels = np.random.default_rng(4).uniform(-1, 1, (3, 28, 20)).astype(np.float32)
    pixels.tofile(tmp_path / "pixels.f32")
    done = _host(build, v41_vision_artifact, "--encode-image", tmp_path / "pixels.f32", "--image-size", "28,20",
                 "--rows-out", tmp_path / "rows.npy")
    assert done.returncode == 0, done.stderr
    want = Engine(v41_vision_artifact).backend.encode_image(pixels)
    assert done.stdout.split() == [str(len(want))]
    assert np.array_equal(np.load(tmp_path / "rows.npy"), want)
    done = _host(build, v41_vision_artifact, "--encode-image", tmp_path / "pixels.f32", "--image-size", "27,20")
    with pytest.raises(UsageError) as python:
        Engine(v41_vision_artifact).backend.encode_image(np.zeros((3, 27, 20), np.float32))
    assert done.returncode == 2 and done.stderr == f"dsv4c: error: {python.value}\n"
