"""The artifact contract: the manifest a compile writes reads back as the same typed record
(``open_artifact``), every key it can hold is in docs/artifact.md, and a damaged or older one is
refused in one line."""

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest

from dsv4c.artifact.directory import open_artifact
from dsv4c.artifact.file_names import MANIFEST
from dsv4c.artifact.json_record import keys_of
from dsv4c.artifact.manifest import FORMAT_VERSION, Kernels, Manifest, RankWeights, Weights, read_manifest
from dsv4c.artifact.pool import PoolGeometry
from dsv4c.compile import compile_model
from dsv4c.errors import ArtifactError
from dsv4c.frontend.config import resolve_model
from dsv4c.passes.quant_plan import KV_CACHE_DTYPES, plan_for
from dsv4c.targets import TARGETS

DOC = Path(__file__).resolve().parents[1] / "docs" / "artifact.md"


@pytest.fixture(scope="module")
def tiny_reference(tmp_path_factory) -> Path:
    """The tiny preset compiled for the reference interpreter (its weights written from seed 0)."""
    return compile_model("tiny", "reference", tmp_path_factory.mktemp("manifest") / "art", progress=False,
                         log=lambda *_: None)


def documented_keys() -> list[tuple[str, ...]]:
    """The dotted keys in the first column of the tables of docs/artifact.md's "manifest.json"
    section, split into their segments."""
    text = DOC.read_text()
    section = text[text.index("\n## manifest.json"):]
    section = section[:section.index("\n## ", 1)]
    keys = []
    for line in section.splitlines():
        if line.startswith("| `"):
            first = line.split("|")[1]
            keys += [tuple(k.split(".")) for k in re.findall(r"`([^`]+)`", first)]
    return keys


def _segment_matches(documented: str, written: str) -> bool:
    return documented == written or (documented.startswith("<") and documented.endswith(">"))


def undocumented(paths, documented) -> list[str]:
    """The key paths no documented key names: a path is named by a key of the same length whose
    segments match (``<name>`` matches any), or is the prefix of such a key (a section)."""
    def named(path):
        return any(len(doc) >= len(path) and all(map(_segment_matches, doc, path)) for doc in documented)
    return sorted(".".join(p) for p in paths if not named(p))


def json_key_paths(value, path=()):
    """Every key path of a JSON value: objects' keys, ``name[]`` for the objects in a list."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield path + (k,)
            yield from json_key_paths(v, path + (k,))
    elif isinstance(value, list):
        for v in value:
            if isinstance(v, dict):
                yield from json_key_paths(v, path[:-1] + (path[-1] + "[]",))


def test_a_compiled_manifest_reads_back_as_written(tiny_reference):
    art = open_artifact(tiny_reference)
    on_disk = json.loads((tiny_reference / MANIFEST).read_text())
    assert art.manifest.to_json() == on_disk  # the record holds every key, and writes it back alike
    assert Manifest.from_json(on_disk, "x") == art.manifest
    cfg = resolve_model("tiny")
    assert art.config == cfg
    assert art.geometry == PoolGeometry.build(cfg, plan_for(cfg, "reference", "exact", "auto"))
    m = art.manifest
    assert (m.target, m.numerics, m.tensor_parallel, m.expert_parallel, m.vm) == ("reference", "exact", 1, None, None)
    assert m.weights.of_rank(0) == RankWeights(index="weights.safetensors.index.json", files=("weights.safetensors",))
    assert set(m.files) == {"program.json", "weights.safetensors", "weights.safetensors.index.json"}
    # Optional keys are absent, not null, when they do not apply.
    assert "tensor_parallel" not in on_disk and "vm" not in on_disk and on_disk["kernels"] == {}


def test_every_key_the_compiler_writes_is_documented(tiny_reference):
    """Keys of a real compile, every key the Manifest record can hold (the optional sections a
    reference compile leaves out), and the model, plan and pool sections of every preset on
    every target."""
    documented = documented_keys()
    paths = set(json_key_paths(json.loads((tiny_reference / MANIFEST).read_text())))
    paths |= {tuple(k.split(".")) for k in keys_of(Manifest)}
    paths.add(("format_version",))
    for name in ("tiny", "flash", "pro"):
        cfg = resolve_model(name)
        paths |= set(json_key_paths({"model": cfg.to_json_dict("hf")}))
        for target in TARGETS:
            for numerics in ("exact", "qat"):
                for kv in KV_CACHE_DTYPES:
                    try:
                        plan = plan_for(cfg, target, numerics, kv)
                    except Exception:  # a combination the target refuses
                        continue
                    paths |= set(json_key_paths({"quant_plan": plan.to_json(),
                                                 "pool_geometry": PoolGeometry.build(cfg, plan).summary()}))
    assert undocumented(paths, documented) == [], "add these keys to docs/artifact.md's manifest.json tables"
    # The check itself: a key nobody documents is caught.
    assert undocumented({("vm", "new_key")}, documented) == ["vm.new_key"]


def _rewrite(art: Path, edit) -> None:
    manifest = json.loads((art / MANIFEST).read_text())
    edit(manifest)
    (art / MANIFEST).write_text(json.dumps(manifest))


def _one_line(e: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(e.value)
    return str(e.value)


def test_an_older_format_version_is_refused_in_one_line(tiny_reference, tmp_path):
    art = shutil.copytree(tiny_reference, tmp_path / "art")
    _rewrite(art, lambda m: m.update(format_version=FORMAT_VERSION - 1))
    with pytest.raises(ArtifactError) as e:
        open_artifact(art)
    assert _one_line(e) == (f"{art}: artifact format version {FORMAT_VERSION - 1}, this runtime reads "
                            f"{FORMAT_VERSION}; recompile")


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.pop("numerics"), "'numerics' is missing or not a string; recompile"),
    (lambda m: m.update(has_weights=1), "'has_weights' is missing or not true or false; recompile"),
    (lambda m: m["entry_points"]["step"].update(inputs="tokens"), "'entry_points.step.inputs' is missing or not a list"),
    (lambda m: m["kernels"].update(cpu_features=["avx2", 1]), "'kernels.cpu_features' is missing or not a list"),
    (lambda m: m.update(surprise=1), "'surprise' is not a key this dsv4c reads; recompile"),
    (lambda m: m.update(weights={"index": 3}), "manifest has no weight file list; recompile"),
    (lambda m: m["files"]["program.json"].pop("sha256"), "manifest has no file list; recompile"),
], ids=["missing", "mistyped", "nested", "list-item", "unknown", "weights", "files"])
def test_a_damaged_manifest_is_refused_naming_the_key(tiny_reference, tmp_path, edit, message):
    """Checked once, at load, in the C++ host's words (``runtime/cpp/src/json.h``)."""
    art = shutil.copytree(tiny_reference, tmp_path / "art")
    _rewrite(art, edit)
    with pytest.raises(ArtifactError) as e:
        read_manifest(art)
    assert _one_line(e).startswith(f"{art / MANIFEST}: ") and message in str(e.value)


def test_multi_rank_weights_round_trip():
    weights = Weights(files=("rank0-weights.safetensors", "rank1-weights.safetensors"),
                      ranks=tuple(RankWeights(index=f"rank{r}-weights.safetensors.index.json",
                                              files=(f"rank{r}-weights.safetensors",)) for r in range(2)))
    art = dataclasses.replace(_tiny_manifest(), weights=weights, tensor_parallel=2, expert_parallel=True)
    on_disk = json.loads(json.dumps(art.to_json()))
    assert on_disk["weights"] == {"files": list(weights.files), "ranks": [
        {"index": f"rank{r}-weights.safetensors.index.json", "files": [f"rank{r}-weights.safetensors"]}
        for r in range(2)]}
    assert (on_disk["tensor_parallel"], on_disk["expert_parallel"]) == (2, True)
    back = Manifest.from_json(on_disk, "x")
    assert back.to_json() == on_disk and back.weights == weights and back.weights.of_rank(1).files == ("rank1-weights.safetensors",)
    assert back.weights.of_rank(2) is None


def _tiny_manifest() -> Manifest:
    cfg = resolve_model("tiny")
    plan = plan_for(cfg, "reference", "exact", "auto")
    return Manifest(dsv4c_version="0", tvm_version="0", target="reference", numerics="exact", kv_cache_dtype="auto",
                    model_name=cfg.name, model=cfg.to_json_dict("hf"), has_weights=False, weights=None,
                    quant_plan=plan.to_json(), pool_geometry=PoolGeometry.build(cfg, plan).summary(),
                    entry_points={}, kernels=Kernels(), files={})
