"""Streamed weight conversion, the sharded artifact weights and their loader.

The artifact's tensors must keep exactly the names, dtypes, shapes and tile layouts the
kernels read, so :func:`_in_memory_layout` freezes the in-memory ``weight_layout`` that the
streaming converter replaced (commit 708e335) as the oracle; FP8 / FP4 codes now come from the
checkpoint unchanged where that function re-quantized the dequantized values, so those are
compared by value, and the codes against the checkpoint's own, tile for tile.
"""

import dataclasses
import itertools
import json
import re
import shutil
import tracemalloc

import numpy as np
import pytest

from dsv4c import threads
from dsv4c.cli import main as cli
from dsv4c.codegen import convert
from dsv4c.compile import compile_model
from dsv4c.codegen.convert import convert_weights
from dsv4c.codegen.kernels.formats import column_tile
from dsv4c.artifact.quant import dense_format, fp4_words
from dsv4c.codegen.lowering import column_tiles, weight_layouts
from dsv4c.errors import CheckpointError, UsageError
from dsv4c.artifact import lowbit
from dsv4c.frontend import checkpoint_writer
from dsv4c.frontend.checkpoint import Checkpoint, ir_sources, load_weights
from dsv4c.frontend.checkpoint_writer import write_checkpoint
from dsv4c.frontend.random_model import iter_random_weights
from dsv4c.frontend.config import config_from_dict, preset, with_weights
from dsv4c.artifact.safetensors_io import SafetensorsFile
from dsv4c.frontend.trace import trace
from dsv4c.passes.merge_projections import base_weight_names, materialize_weights, weight_sources
from dsv4c.passes.pipeline import run_pipeline
from dsv4c.passes.quant_plan import plan_for
from dsv4c.artifact.manifest import ArtifactError, read_manifest
from dsv4c.runtime import weights as weight_loader
from dsv4c.runtime.weights import open_weights

from file_breakages import corrupt_header, flip_byte, offsets_past_the_end, truncate

# FP8 projections merged along their outputs (wq_a + wkv, wq_b + indexer.wq_b), a grouped wo_a,
# FP4 experts, BF16 merges: every way a weight is assembled from checkpoint tensors.
MERGE = config_from_dict({
    "model_type": "deepseek_v4", "vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 2, "head_dim": 128, "qk_rope_head_dim": 64, "q_lora_rank": 128, "o_groups": 2,
    "o_lora_rank": 64, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
    "index_n_heads": 2, "index_head_dim": 64, "index_topk": 2, "sliding_window": 4, "num_hash_layers": 1,
    "compress_ratios": [4, 128],
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0"}, "expert_dtype": "fp4",
}, "merge")
CONFIGS = {"tiny": preset("tiny"), "tiny-fp32": with_weights(preset("tiny"), dense="fp32", experts="fp32"),
           "tiny-bf16": with_weights(preset("tiny"), dense="bf16", experts="bf16"),
           "tiny-fp32-scales": with_weights(preset("tiny"), scale="fp32"), "merge": MERGE}


def _in_memory_layout(program, weights, fp8_format="e4m3fn"):
    """``codegen.lowering.weight_layout`` as of commit 708e335, verbatim: every weight in memory
    as fp32, FP8 / FP4 re-quantized from the values; two changes since: the MTP function's
    weights are laid out like the step's (it is compiled too), so all functions' nodes count; and
    BF16 dense weights stay BF16 for every matmul that reads them as BF16 (the grouped output
    projection and the shared expert were stored as fp32, which their BF16 kernels misread)."""
    matmul, fp8, fp4, bf16 = set(), set(), set(), set()
    nodes = [node for fn in program.functions.values() for node in fn.nodes]
    for node in nodes:
        q = node.attrs.get("quant") or ""
        reads = {"linear": node.inputs[1:2], "linear_split": node.inputs[1:2], "lm_head": node.inputs[1:2],
                 "moe_route": node.inputs[1:2], "shared_expert": node.inputs[1:4], "grouped_linear": node.inputs[1:2],
                 "experts": node.inputs[3:6]}.get(node.op, [])
        matmul.update(v.name for v in reads)
        if node.op not in ("moe_route", "experts") and dense_format(q).name == "fp8_b128":
            fp8.update(v.name for v in reads)
        if node.op == "experts" and ("fp4_g32" if q == "fp4_g32" else "fp32") == "fp4_g32":
            fp4.update(v.name for v in reads)
        if node.op not in ("moe_route", "experts") and dense_format(q).name == "bf16":
            bf16.update(v.name for v in reads)
    groups = {n.inputs[1].name: n.attrs["groups"] for n in nodes if n.op == "grouped_linear"}

    def tiles(a):
        lead, (o, i) = a.shape[:-2], a.shape[-2:]
        t = column_tile(o)
        return np.ascontiguousarray(np.moveaxis(a.reshape(*lead, o // t, t, i), -2, -1))

    def grouped(name, a):
        g = groups.get(name, 1)
        return a.reshape(g, a.shape[0] // g, a.shape[1]) if g > 1 else a

    out = {}
    for name, value in weights.items():
        if value.dtype.kind in "iu":
            out[name] = ("I32", value.astype(np.int32))
        elif name in fp8:
            codes, scales = lowbit.quantize_fp8_blocks(value, 128, "e8m0")
            scale = lowbit.decode_e8m0(scales).astype(np.float32)
            if fp8_format == "e4m3fnuz":
                codes, scale = lowbit.e4m3fn_to_fnuz(codes), 2 * scale
            per_column = np.repeat(scale, 128, axis=0)[:value.shape[0]]
            out[name] = ("U8", tiles(grouped(name, codes)))
            out[name + ".scale"] = ("F32", tiles(grouped(name, per_column)))
        elif name in fp4:
            flat = value.reshape(-1, value.shape[-1])
            packed, scales = lowbit.quantize_fp4_groups(flat, 32)
            out[name] = ("I32", tiles(fp4_words(packed.view(np.uint8).reshape(-1, packed.shape[-1]))
                                      .reshape(*value.shape[:-1], -1)))
            out[name + ".scale"] = ("U8", tiles(scales.reshape(*value.shape[:-1], -1)))
        elif name in bf16:
            out[name] = ("BF16", tiles(grouped(name, lowbit.bf16_bits_from_f32(value))))
        elif name in matmul:
            out[name] = ("F32", tiles(grouped(name, np.asarray(value, np.float32))))
        else:
            out[name] = ("F32", np.ascontiguousarray(value, np.float32))
    return out


def _untile(a):
    """[..., out / t, in, t] -> [..., out, in] (stacked / grouped lead axes flattened into out)."""
    return np.moveaxis(a, -1, -2).reshape(-1, a.shape[-2])


def _untiled_bytes(codes):
    """The checkpoint's byte rows of tiled codes: FP8 bytes, or FP4 words read back as the packed
    pairs they were made of (little-endian)."""
    return np.ascontiguousarray(_untile(codes)).view(np.uint8)


def _fp8_values(codes, scales, fnuz):
    import ml_dtypes

    f8 = ml_dtypes.float8_e4m3fnuz if fnuz else ml_dtypes.float8_e4m3fn
    codes, scales = _untile(codes), _untile(scales)
    return codes.view(f8).astype(np.float32) * np.repeat(scales, 128, axis=1)[:, :codes.shape[1]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {label: write_checkpoint(cfg, iter_random_weights(cfg, 0), root / label) for label, cfg in CONFIGS.items()}


def _convert(cfg, path, target, out, **kwargs):
    """Convert a checkpoint's weights for ``target`` into ``out``: (program, report)."""
    program = run_pipeline(trace(cfg, "exact"))
    out.mkdir()
    with Checkpoint(path) as ckpt:
        sources = weight_sources(program, ir_sources(cfg, ckpt, base_weight_names(program)))
        return program, convert_weights(weight_layouts(program, plan_for(cfg, target)), sources, out, **kwargs)


def _stored(directory, files) -> dict:
    out = {}
    for fname in files:
        with SafetensorsFile(directory / fname) as st:
            out.update({n: (st.dtype(n), st.read_raw(n)) for n in st.names()})
    return out


@pytest.mark.parametrize("target", ["llvm", "gfx942", "reference"])
@pytest.mark.parametrize("label", sorted(CONFIGS))
def test_streamed_weights_match_the_in_memory_layout(models, tmp_path, label, target):
    cfg = CONFIGS[label]
    program, report = _convert(cfg, models[label], target, tmp_path / "art", shard_bytes=64 << 10)
    assert len(report.files) > 1
    got = _stored(tmp_path / "art", report.files)
    base = load_weights(cfg, models[label], base_weight_names(program))
    weights = materialize_weights(program, base)
    if target == "reference":
        want = {k: ("F32", v.astype(np.float32)) if v.dtype.kind == "f" else ("I64", v) for k, v in weights.items()}
    else:
        want = _in_memory_layout(program, weights, "e4m3fnuz" if target == "gfx942" else "e4m3fn")
    assert got.keys() == want.keys()
    for name, (dtype, array) in want.items():
        assert (got[name][0], got[name][1].shape) == (dtype, array.shape), name
        if name.endswith(".scale") or name + ".scale" not in want:  # values compared with their codes
            if not name.endswith(".scale"):
                np.testing.assert_array_equal(got[name][1], array, err_msg=name)
            continue
        # Quantized: the codes are the checkpoint's own, so compare the values the kernels read:
        # exactly the checkpoint's. The in-memory layout re-quantized with E8M0 scales, which was
        # lossless for E8M0 checkpoints and lossy for fp32 block scales.
        fp8 = got[name + ".scale"][0] == "F32"
        if fp8:
            fnuz = target == "gfx942"
            values = _fp8_values(got[name][1], got[name + ".scale"][1], fnuz)
            in_memory = _fp8_values(array, want[name + ".scale"][1], fnuz)
        else:
            values = _fp4_values(got[name][1], got[name + ".scale"][1])
            in_memory = _fp4_values(array, want[name + ".scale"][1])
        np.testing.assert_array_equal(values, weights[name].reshape(values.shape), err_msg=name)
        assert np.array_equal(values, in_memory) == (not fp8 or cfg.weights.scale == "e8m0"), name


def _fp4_values(packed, scales):
    return lowbit.dequantize_fp4_groups(_untiled_bytes(packed), _untile(scales), 32)


@pytest.mark.parametrize("target", ["llvm", "gfx942"])
def test_fp8_and_fp4_codes_reach_the_artifact_unchanged(models, tmp_path, target):
    """Every FP8 / FP4 code and scale of the checkpoint is in the artifact, tile for tile (gfx942:
    the codes re-encoded e4m3fnuz, the scales doubled): merged, grouped and stacked weights too."""
    fnuz = target == "gfx942"
    _, report = _convert(MERGE, models["merge"], target, tmp_path / "art")
    got = _stored(tmp_path / "art", report.files)
    stored = {}
    for shard in sorted(models["merge"].glob("*.safetensors")):
        with SafetensorsFile(shard) as st:
            stored.update({n: st.read_raw(n) for n in st.names()})
    checked = 0
    for name, (dtype, codes) in got.items():
        if name + ".scale" not in got:
            continue
        parts = [name] if not name.startswith("concat(") else name[len("concat("):-1].split(",")
        if re.match(r".*\.ffn\.experts\.w[123]$", name):
            prefix, w = name.rsplit(".", 1)
            parts = [f"{prefix}.{e}.{w}.weight" for e in range(MERGE.n_routed_experts)]
        want_codes = np.concatenate([stored[p].view(np.uint8) for p in parts])
        scale_of = {p: stored[p[:-len("weight")] + "scale"] for p in parts}
        if got[name + ".scale"][0] == "F32":  # FP8: block scales expanded per output row
            want_scale = np.concatenate([np.repeat(lowbit.decode_e8m0(scale_of[p]), 128, axis=0)[:len(stored[p])]
                                         for p in parts])
            if fnuz:
                want_codes, want_scale = lowbit.e4m3fn_to_fnuz(want_codes), 2 * want_scale
        else:
            want_scale = np.concatenate([scale_of[p] for p in parts])
        np.testing.assert_array_equal(_untiled_bytes(codes), want_codes, err_msg=name)
        np.testing.assert_array_equal(_untile(got[name + ".scale"][1]), want_scale, err_msg=name)
        checked += len(parts)
    # Every quantized tensor of the checkpoint, the MTP layer's included (its function is compiled).
    assert checked == sum(n.endswith(".scale") for n in stored)


def test_column_tiles_matches_a_plain_transpose():
    rng = np.random.default_rng(0)
    for dtype in (np.uint8, np.uint16, np.float32, np.int64):
        for rows, cols, tile in ((128, 96, 64), (80, 7, 16), (64, 3, 8), (5, 40, 1)):
            a = rng.integers(0, 200, (rows, cols)).astype(dtype)
            want = np.ascontiguousarray(a.reshape(rows // tile, tile, cols).transpose(0, 2, 1))
            np.testing.assert_array_equal(column_tiles(a, tile), want)


def test_bf16_declared_weight_that_bf16_cannot_hold_is_refused(models, tmp_path):
    # A checkpoint written as fp32 whose config then claims BF16 storage.
    cfg = CONFIGS["tiny-bf16"]
    with pytest.raises(UsageError, match="declared BF16 but holds values BF16 cannot represent"):
        _convert(cfg, models["tiny-fp32"], "llvm", tmp_path / "art")


# --------------------------------------------------------------------------- bounded memory


def test_memory_does_not_grow_with_the_model(tmp_path, monkeypatch):
    """Peak traced memory (tracemalloc sees every numpy buffer and Python object) while writing a
    checkpoint and converting it barely moves between 8 and 64 experts (35 MB more weights): a
    few pieces in flight whatever the model, plus per-tensor bookkeeping. One worker thread, so
    the peak does not depend on which pieces the threads happen to overlap (a 2-core CI run once
    saw the 64-expert conversion overlap larger pieces than the 8-expert one, 1.6x the peak)."""
    monkeypatch.setattr(checkpoint_writer, "PIECE_BYTES", 1 << 20)
    monkeypatch.setattr(convert, "PIECE_ELEMENTS", 1 << 18)
    monkeypatch.setattr(threads, "default_workers", lambda: 1)
    peaks, sizes = [], []
    for experts in (8, 64):
        cfg = config_from_dict({**MERGE.to_json_dict("hf"), "n_routed_experts": experts, "moe_intermediate_size": 256,
                                "hidden_size": 512}, f"wide-{experts}")
        tracemalloc.start()
        try:
            path = write_checkpoint(cfg, iter_random_weights(cfg, 0), tmp_path / f"ckpt-{experts}")
            _, write_peak = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            held, _ = tracemalloc.get_traced_memory()
            _, report = _convert(cfg, path, "llvm", tmp_path / f"art-{experts}")
            convert_peak = tracemalloc.get_traced_memory()[1] - held
        finally:
            tracemalloc.stop()
        peaks.append((write_peak, convert_peak))
        sizes.append((sum(f.stat().st_size for f in path.glob("*.safetensors")), report.bytes_written))
    (small_write, large_write), (small_art, large_art) = zip(*sizes)
    assert large_write > 3 * small_write and large_art > 3 * small_art
    # Holding the weights would add their whole growth; a few pieces add nothing, bookkeeping ~1-2%.
    for (small_peak, large_peak), growth in zip(zip(*peaks), (large_write - small_write, large_art - small_art)):
        assert large_peak - small_peak < 0.05 * growth, (peaks, sizes)


# --------------------------------------------------------------------------- the artifact


@pytest.fixture(scope="module")
def artifacts(models, tmp_path_factory):
    """The tiny model compiled for llvm (its weights in one file, and split over several) and
    for reference (split)."""
    root = tmp_path_factory.mktemp("artifacts")
    builds = {"llvm": ("llvm", None), "llvm-sharded": ("llvm", 256 << 10), "reference": ("reference", 256 << 10)}
    return {label: compile_model(str(models["tiny"]), target, root / label, progress=False, log=lambda *_: None,
                                 shard_bytes=shard_bytes) for label, (target, shard_bytes) in builds.items()}


def test_manifest_records_the_weight_files(artifacts):
    art = artifacts["llvm-sharded"]
    manifest = json.loads((art / "manifest.json").read_text())
    files = manifest["weights"]["files"]
    assert manifest["weights"]["index"] == "weights.safetensors.index.json" and len(files) > 2
    assert files == [f"weights-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    # Every other file of the artifact is listed, the weight files and their index among them.
    assert sorted(manifest["files"]) == sorted(p.name for p in art.iterdir() if p.name != "manifest.json")
    assert {*files, "weights.safetensors.index.json", "program.json"} <= set(manifest["files"])
    for name, entry in manifest["files"].items():
        assert entry["bytes"] == (art / name).stat().st_size and len(entry["sha256"]) == 64
    index = json.loads((art / "weights.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == files
    single = json.loads((artifacts["llvm"] / "manifest.json").read_text())["weights"]
    assert single["files"] == ["weights.safetensors"]


def test_open_weights_maps_every_tensor_read_only_and_aligned(artifacts):
    art = artifacts["llvm-sharded"]
    weights = open_weights(art, read_manifest(art))
    index = json.loads((art / "weights.safetensors.index.json").read_text())["weight_map"]
    assert sorted(weights) == sorted(index)
    single = open_weights(artifacts["llvm"], read_manifest(artifacts["llvm"]))
    assert sorted(single) == sorted(weights)
    for name, array in weights.items():
        with SafetensorsFile(art / index[name]) as st:
            raw = st.read_raw(name)
        assert array.dtype == raw.dtype and array.shape == raw.shape and not array.flags.writeable, name
        np.testing.assert_array_equal(array, raw)
        np.testing.assert_array_equal(single[name], raw)  # the split changes where tensors lie, nothing else
        if array.nbytes % 64 == 0:
            assert array.ctypes.data % 64 == 0, name
    assert weights["layers.2.ffn.experts.w1"].ndim == 4  # stacked experts whole: [E, out / t, in / 2, t]
    with pytest.raises(TypeError):
        weights["head.weight"] = None  # the mapping is read-only too


@pytest.mark.parametrize("chunk", [weight_loader.READ_CHUNK_BYTES, 1000], ids=["whole-tensors", "in-pieces"])
def test_read_weights_equal_the_mapped_ones_in_memory_of_their_own(artifacts, monkeypatch, chunk):
    """Read whole or, in jobs of a few rows on several threads, in pieces (the tiny model's
    tensors are smaller than a real job)."""
    art = artifacts["llvm-sharded"]
    monkeypatch.setattr(weight_loader, "READ_CHUNK_BYTES", chunk)
    mapped, read = (open_weights(art, read_manifest(art), read=r) for r in (False, True))
    assert sorted(read) == sorted(mapped)
    for name, array in read.items():
        assert array.dtype == mapped[name].dtype and array.shape == mapped[name].shape, name
        np.testing.assert_array_equal(array, mapped[name])
        assert not array.flags.writeable and array.ctypes.data % 64 == 0, name
        assert not np.shares_memory(array, mapped[name]), name


def test_a_failed_read_job_fails_open_weights_with_its_error(artifacts, monkeypatch):
    """A file that ends early (e.g. truncated while loading, after the header checks) is
    reported as such from whichever thread read it."""
    art = artifacts["llvm-sharded"]
    monkeypatch.setattr(weight_loader, "READ_CHUNK_BYTES", 1000)
    calls, read_rows_into = itertools.count(), SafetensorsFile.read_rows_into

    def short_file(st, name, start, stop, out):
        if next(calls) == 4:  # one call, whichever thread makes it (count() is atomic)
            raise st._fail("file ended while reading the tensor", name)
        read_rows_into(st, name, start, stop, out)

    monkeypatch.setattr(SafetensorsFile, "read_rows_into", short_file)
    with pytest.raises(CheckpointError, match="file ended while reading the tensor"):
        open_weights(art, read_manifest(art), read=True)


def test_weights_mode_reads_on_the_cpu_when_they_fit(artifacts, monkeypatch):
    from dsv4c.runtime import weights

    art = artifacts["llvm-sharded"]
    manifest = read_manifest(art)
    size = sum((art / f).stat().st_size for f in manifest.weights.files)
    assert weights.reads_weights(art, manifest, "read", on_host=False)
    assert not weights.reads_weights(art, manifest, "map", on_host=True)
    monkeypatch.setattr(weights, "available_memory", lambda: int(size / weights.READ_SHARE))
    assert weights.reads_weights(art, manifest, "auto", on_host=True)
    assert not weights.reads_weights(art, manifest, "auto", on_host=False)  # a GPU copies them anyway
    monkeypatch.setattr(weights, "available_memory", lambda: int(size / weights.READ_SHARE) - 1)
    assert not weights.reads_weights(art, manifest, "auto", on_host=True)
    with pytest.raises(UsageError, match="'mmap' is not one of auto, read, map"):
        weights.reads_weights(art, manifest, "mmap", on_host=True)
    assert weights.available_memory() > 0  # this Linux reports MemAvailable
    assert not weights.reads_weights(art, dataclasses.replace(manifest, weights=None), "auto", on_host=True)  # --no-weights


def test_generate_reads_or_maps_the_weights_alike(artifacts, capsys):
    from dsv4c.runtime.engine import Engine
    from dsv4c.runtime.weights import WEIGHTS_MODES

    args = ["generate", str(artifacts["llvm"]), "--token-ids", "5,6,7", "--max-new-tokens", "5"]
    outputs = {}
    for mode in WEIGHTS_MODES:
        assert cli([*args, "--weights", mode]) == 0
        outputs[mode] = capsys.readouterr().out
    assert outputs["read"] == outputs["map"] == outputs["auto"] and len(outputs["map"].split()) == 5
    assert Engine(artifacts["llvm"], weights="read").backend.reads_weights
    assert not Engine(artifacts["llvm"], weights="map").backend.reads_weights
    with pytest.raises(UsageError, match="weights mode 'copy'"):
        Engine(artifacts["llvm"], weights="copy")
    with pytest.raises(SystemExit):
        cli([*args, "--weights", "copy"])
    assert "invalid choice: 'copy'" in capsys.readouterr().err


def test_read_only_weights_reach_tvm_without_a_copy(artifacts):
    tvm = pytest.importorskip("tvm")
    weights = open_weights(artifacts["llvm"], read_manifest(artifacts["llvm"]))
    array = weights["head.weight"]
    tensor = tvm.runtime.from_dlpack(array.__dlpack__(max_version=(1, 0)))
    assert tensor.shape == array.shape and np.array_equal(tensor.numpy(), array)


def test_generate_runs_on_sharded_and_single_file_weights(artifacts, capsys):
    args = ["--token-ids", "5,6,7", "--max-new-tokens", "5"]
    assert cli(["generate", str(artifacts["reference"]), *args]) == 0
    ref = capsys.readouterr().out
    assert cli(["generate", str(artifacts["llvm"]), *args, "--verify"]) == 0
    assert capsys.readouterr().out == ref and len(ref.split()) == 5


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("dsv4c: error: ") and "\n" not in err and "Traceback" not in err
    return err


@pytest.mark.parametrize("target", ["llvm-sharded", "reference"])
def test_verify_finds_a_flipped_byte_and_generate_verifies_on_request(artifacts, tmp_path, capsys, target):
    art = shutil.copytree(artifacts[target], tmp_path / "art")
    assert cli(["verify", str(art)]) == 0
    assert "match their sha256" in capsys.readouterr().out
    shard = art / read_manifest(art).weights.files[1]
    flip_byte(shard)
    assert cli(["verify", str(art)]) == 2
    assert f"{shard.name} does not match its sha256" in _one_line_error(capsys)
    assert cli(["generate", str(art), "--token-ids", "1,2", "--max-new-tokens", "2", "--verify"]) == 2
    assert shard.name in _one_line_error(capsys)


@pytest.mark.parametrize("breakage, fragment", [
    (truncate, "has {size} bytes, the manifest records"),
    (corrupt_header, "header is not valid UTF-8 JSON"),
    (offsets_past_the_end, "lie outside the"),
], ids=["truncated", "header-not-json", "offsets-past-the-end"])
@pytest.mark.parametrize("target", ["llvm", "reference"])
def test_a_broken_shard_is_a_one_line_error_without_verify(artifacts, tmp_path, capsys, target, breakage, fragment):
    art = shutil.copytree(artifacts[target], tmp_path / "art")
    shard = art / read_manifest(art).weights.files[-1]
    breakage(shard)
    assert cli(["generate", str(art), "--token-ids", "1,2", "--max-new-tokens", "2"]) == 2
    err = _one_line_error(capsys)
    assert shard.name in err and fragment.format(size=shard.stat().st_size) in err


def test_a_no_weights_artifact_has_no_weights_to_open(tmp_path):
    art = compile_model("tiny", "reference", tmp_path / "art", no_weights=True, progress=False, log=lambda *_: None)
    manifest = read_manifest(art)
    assert manifest.weights is None and not manifest.has_weights
    with pytest.raises(ArtifactError, match="--no-weights"):
        open_weights(art, manifest)


def test_compile_prints_a_one_line_summary(models, tmp_path):
    lines = []
    compile_model(str(models["tiny-fp32"]), "reference", tmp_path / "art", progress=False, log=lines.append)
    assert len(lines) == 1 and "GB/s" in lines[0] and "peak RSS" in lines[0]
