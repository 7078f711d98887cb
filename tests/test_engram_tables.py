"""V4.1's Engram tables in files of their own (artifact.engram_tables): compile writes one file
per Engram layer (FP8 rows and E8M0 scales as an official checkpoint stores them, float32 for a
save_pretrained-style float checkpoint), none of them in the weight index; the step reads them
mapped, read into memory or gathered on the host, bit for bit alike, and the reference backend
reads the same files; a damaged table or an artifact of the older layout is refused in one line;
`inspect` reports the tables apart from the weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from dsv4c.artifact import lowbit
from dsv4c.artifact.engram_tables import EngramTable, table_weight
from dsv4c.artifact.safetensors_io import SafetensorsFile
from dsv4c.cli import main as cli
from dsv4c.errors import ArtifactError, UsageError
from dsv4c.frontend.config import preset
from dsv4c.runtime.backend_tvm import TvmBackend
from dsv4c.runtime.engine import Engine
from dsv4c.runtime.sampling import SamplingParams

from v41_case import compile_case

PROMPT = np.random.default_rng(4).integers(3, 250, 37).tolist()


@pytest.fixture
def fp8_model(v41_fp8_model):
    return v41_fp8_model


@pytest.fixture
def fp8_artifacts(v41_fp8_artifacts):
    return v41_fp8_artifacts


def _manifest(artifact: Path) -> dict:
    return json.loads((artifact / "manifest.json").read_text())


def _generate(artifact: Path, **engine) -> tuple[list[int], np.ndarray]:
    e = Engine(artifact, max_requests=1, max_context=256, **engine)
    rid = e.submit(PROMPT, SamplingParams(max_new_tokens=6), record_logits=True)
    e.run()
    result = e.result(rid)
    return result.tokens, result.logits


def _checkpoint_table(model: Path, name: str) -> tuple[np.ndarray, np.ndarray]:
    index = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    with SafetensorsFile(model / index[name]) as st:
        rows = st.read_raw(name)
    scale = name.replace(".weight", ".scale")
    with SafetensorsFile(model / index[scale]) as st:
        return rows, st.read_raw(scale)


def test_compile_writes_each_fp8_table_as_the_checkpoint_stores_it_apart_from_the_weights(fp8_model, fp8_artifacts):
    model, _ = fp8_model
    for artifact in fp8_artifacts.values():
        manifest = _manifest(artifact)
        tables = manifest["engram"]["tables"]
        assert manifest["engram"]["hash"] == "engram_hash.safetensors"
        assert [t["layer"] for t in tables] == list(preset("v41-tiny").engram.layer_ids)
        index = json.loads((artifact / manifest["weights"]["index"]).read_text())["weight_map"]
        assert not any(".engram.embed." in name for name in index)
        for t in tables:
            assert t["file"] == f"engram-table-{t['layer']}.safetensors" and t["format"] == "fp8_e4m3_e8m0"
            assert t["file"] in manifest["files"]
            rows, scales = _checkpoint_table(model, table_weight(t["layer"]))
            with SafetensorsFile(artifact / t["file"]) as st:
                assert np.array_equal(st.read_raw("rows"), rows.view(np.uint8))
                assert np.array_equal(st.read_raw("scales"), scales.view(np.uint8))
                assert (t["rows"], t["width"]) == rows.shape


def test_a_float_checkpoints_tables_are_stored_float32(tmp_path):
    """The parity case, saved by transformers' save_pretrained: float tables, no scales."""
    artifact = compile_case(tmp_path, "reference")
    for t in _manifest(artifact)["engram"]["tables"]:
        assert t["format"] == "fp32"
        with SafetensorsFile(artifact / t["file"]) as st:
            assert st.names() == ["rows"] and st.dtype("rows") == "F32"
            assert st.shape("rows") == (t["rows"], t["width"])


def test_map_read_and_the_host_gather_give_bit_identical_logits_and_the_reference_matches(fp8_artifacts):
    llvm = fp8_artifacts["llvm"]
    mapped = _generate(llvm)
    read = _generate(llvm, engram_memory="read")
    TvmBackend.engram_host_gather = True  # the path GPU targets take, on the CPU
    try:
        gathered = _generate(llvm)
    finally:
        TvmBackend.engram_host_gather = False
    for other in (read, gathered):
        assert other[0] == mapped[0] and np.array_equal(other[1], mapped[1])
    # The reference backend reads the same files. Its fp32 GEMMs (on float32 weights) sum in
    # another order than llvm's FP8 kernels, so a fake-quant round trip may flip a value later on
    # (docs/v41.md, "Fake-quant"): the tokens are the same; the gather kernel itself is bit-exact
    # (tests/test_v41_compiled.py).
    reference = _generate(fp8_artifacts["reference"])
    assert reference[0] == mapped[0] and np.abs(reference[1][0] - mapped[1][0]).max() < 1e-5
    assert np.array_equal(_generate(fp8_artifacts["reference"], engram_memory="read")[1], reference[1])


def test_the_host_gather_uploads_each_distinct_row_once():
    rng = np.random.default_rng(0)
    table = EngramTable(3, "fp8_e4m3_e8m0", rng.integers(0, 120, (50, 64)).astype(np.uint8),
                        rng.integers(110, 130, (50, 2)).astype(np.uint8))
    ids = rng.integers(0, 50, (5, 8))
    compact, remapped = table.compact(ids)
    assert len(compact.rows) == len(np.unique(ids)) and np.array_equal(compact[remapped], table[ids])
    padded, again = table.compact(ids, 40)  # what a step replaying a CUDA graph takes: one row per id
    assert padded.rows.shape == (40, 64) and padded.scales.shape == (40, 2)
    assert np.array_equal(again, remapped) and np.array_equal(padded[remapped], table[ids])
    assert np.array_equal(table[ids][..., :32], lowbit.decode_e4m3fn(table.rows[ids][..., :32])
                          * lowbit.decode_e8m0(table.scales[ids][..., :1]))


def _one_line(error: Exception) -> str:
    assert "\n" not in str(error)
    return str(error)


def test_a_damaged_table_or_an_older_layout_is_refused_in_one_line(fp8_artifacts, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(fp8_artifacts["reference"], art)
    manifest = _manifest(art)
    table = art / manifest["engram"]["tables"][0]["file"]
    # A table whose header does not hold what the manifest records.
    wrong = json.loads(json.dumps(manifest))
    wrong["engram"]["tables"][0]["rows"] += 1
    (art / "manifest.json").write_text(json.dumps(wrong))
    with pytest.raises(ArtifactError) as e:
        Engine(art, max_context=256)
    assert table.name in _one_line(e.value) and "recompile" in str(e.value)
    # The older layout: no 'engram' section (its tables were weights).
    older = {k: v for k, v in manifest.items() if k != "engram"}
    (art / "manifest.json").write_text(json.dumps(older))
    with pytest.raises(ArtifactError) as e:
        Engine(art, max_context=256)
    assert "recompile" in _one_line(e.value)
    # A truncated table.
    (art / "manifest.json").write_text(json.dumps(manifest))
    with open(table, "r+b") as f:
        f.truncate(table.stat().st_size - 64)
    with pytest.raises(ArtifactError) as e:
        Engine(art, max_context=256)
    assert table.name in _one_line(e.value)


def test_engram_memory_takes_map_or_read(fp8_artifacts, capsys):
    with pytest.raises(UsageError) as e:
        Engine(fp8_artifacts["reference"], engram_memory="disk")
    assert "map, read" in _one_line(e.value)
    assert cli(["generate", str(fp8_artifacts["reference"]), "--token-ids", "5,6", "--max-new-tokens", "1",
                "--engram-memory", "disk"]) != 0
    assert "\n" not in capsys.readouterr().err.strip()


def test_a_model_without_engram_takes_the_flag_without_effect(tmp_path):
    assert cli(["compile", "--model", "tiny", "--target", "reference", "-o", str(tmp_path / "tiny")]) == 0
    assert "engram" not in _manifest(tmp_path / "tiny")
    assert np.array_equal(_generate(tmp_path / "tiny", engram_memory="read")[1], _generate(tmp_path / "tiny")[1])


def test_inspect_reports_the_tables_apart_from_the_weights(fp8_artifacts, capsys):
    manifest = _manifest(fp8_artifacts["llvm"])
    assert cli(["inspect", str(fp8_artifacts["llvm"]), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["engram_bytes"] == sum(manifest["files"][t["file"]]["bytes"] for t in manifest["engram"]["tables"])
    assert report["weight_bytes_per_device"] > 0
    # The released structure: weights per device without the 189 GiB of tables, and a memory budget.
    assert cli(["inspect", "v41-flash", "--memory", "141GiB", "--json"]) == 0
    flash = json.loads(capsys.readouterr().out)
    assert 0 < flash["weight_bytes_per_device"] < 330 * 2**30 and flash["min_devices"] > 1
