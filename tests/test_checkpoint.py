"""Checkpoint writer and streaming loader: round trips in every storage format, sharding,
transformers names, and one test per refusal (one-line CheckpointError naming file / tensor)."""

import dataclasses
import json
import re
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from dsv4c.errors import CheckpointError, UsageError
from dsv4c.artifact import lowbit
from dsv4c.frontend import checkpoint_writer
from dsv4c.frontend.checkpoint import Checkpoint, load_weights, official_name
from dsv4c.frontend.checkpoint_writer import write_checkpoint
from dsv4c.frontend.random_model import iter_random_weights, random_weights
from dsv4c.frontend.tensor_inventory import BF16, DENSE, EXPERT, FP32, INDEX, inventory
from dsv4c.frontend.config import config_from_dict, preset, with_weights
from dsv4c.artifact.safetensors_io import SafetensorsFile, SafetensorsWriter, write_safetensors

TINY = with_weights(preset("tiny"), dense="fp32", experts="fp32")
# FP8 / FP4 storage with partial 128x128 edge blocks (160 and 96 are not multiples of 128).
EDGE = config_from_dict({
    "model_type": "deepseek_v4", "vocab_size": 130, "hidden_size": 160, "num_hidden_layers": 2,
    "num_attention_heads": 2, "head_dim": 80, "qk_rope_head_dim": 16, "q_lora_rank": 96, "o_groups": 2,
    "o_lora_rank": 48, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 96,
    "index_n_heads": 2, "index_head_dim": 32, "index_topk": 2, "sliding_window": 4, "num_hash_layers": 1,
    "compress_ratios": [4, 128, 0],
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0"}, "expert_dtype": "fp4",
})
_EXPERT = re.compile(r"^(.*\.ffn\.experts)\.\d+\.(w[123])\.weight$")


def stacked(cfg, per_tensor: dict) -> dict:
    """Official per-tensor arrays as load_weights returns them (routed experts stacked)."""
    out, stacks = {}, {}
    for spec in inventory(cfg):
        m = _EXPERT.match(spec.name)
        if m:
            stacks.setdefault(f"{m[1]}.{m[2]}", []).append(per_tensor[spec.name])
        else:
            out[spec.name] = per_tensor[spec.name]
    return {**out, **{k: np.stack(v) for k, v in stacks.items()}}


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def stored(path: Path) -> dict[str, str]:
    """Stored tensor name -> dtype over every shard of a checkpoint directory."""
    out = {}
    for shard in sorted(path.glob("*.safetensors")):
        with SafetensorsFile(shard) as st:
            out.update({n: st.dtype(n) for n in st.names()})
    return out


def shard_of(path: Path, name: str) -> Path:
    return path / json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][name]


def rewrite(shard: Path, change) -> None:
    """Rewrite one shard after ``change`` edits its ``{name: (dtype, raw array)}``."""
    with SafetensorsFile(shard) as st:
        tensors = {n: (st.dtype(n), st.read_raw(n).copy()) for n in st.names()}
    change(tensors)
    write_safetensors(shard, tensors)


def refused(cfg, path, *named, error=CheckpointError, **kwargs) -> str:
    with pytest.raises(error) as info:
        load_weights(cfg, path, **kwargs)
    message = str(info.value)
    assert "\n" not in message, message
    for part in named:
        assert part in message, f"{part!r} not named in: {message}"
    return message


bf16 = lowbit.bf16_roundtrip


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    return write_checkpoint(TINY, random_weights(TINY, 0), tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture
def tiny_copy(tiny_ckpt, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_ckpt, tmp_path / "ckpt"))


@pytest.fixture(scope="module")
def edge_ckpt(tmp_path_factory) -> Path:
    return write_checkpoint(EDGE, random_weights(EDGE, 0), tmp_path_factory.mktemp("edge") / "ckpt")


@pytest.fixture
def edge_copy(edge_ckpt, tmp_path) -> Path:
    return Path(shutil.copytree(edge_ckpt, tmp_path / "ckpt"))


# --------------------------------------------------------------------------- round trips


def test_fp32_round_trip_is_exact(tiny_ckpt):
    weights = random_weights(TINY, 0)
    assert set(stored(tiny_ckpt).values()) == {"F32", "I64"}
    assert_same(load_weights(TINY, tiny_ckpt), stacked(TINY, weights))
    assert json.loads((tiny_ckpt / "config.json").read_text())["torch_dtype"] == "float32"


def test_bf16_round_trip_rounds_once(tmp_path):
    cfg = with_weights(preset("tiny"), dense="bf16", experts="bf16")
    weights = random_weights(cfg, 1)
    out = write_checkpoint(cfg, weights, tmp_path / "ckpt")
    dtypes = stored(out)
    want = {}
    for spec in inventory(cfg):
        value = weights[spec.name]
        assert dtypes[spec.name] == {FP32: "F32", INDEX: "I64"}.get(spec.kind, "BF16"), spec.name
        want[spec.name] = value if spec.kind in (FP32, INDEX) else bf16(value)
    assert_same(load_weights(cfg, out), stacked(cfg, want))


def _fp8_scale_per_element(w, scale_format, block):
    _, scales = lowbit.quantize_fp8_blocks(w, block, scale_format)
    scales = lowbit.decode_e8m0(scales) if scale_format == "e8m0" else scales
    return np.repeat(np.repeat(scales, block, 0), block, 1)[: w.shape[0], : w.shape[1]]


@pytest.mark.parametrize("experts, scale, block", [("fp4", "e8m0", 128), ("fp4", "fp32", 128), ("fp8", "e8m0", 128),
                                                   ("fp4", "e8m0", 32), ("fp8", "e8m0", 32)])
def test_fp8_and_fp4_round_trip(tmp_path, experts, scale, block):
    """Checkpoints of V4's 128 x 128 FP8 blocks and V4.1's 32 x 32 ones, written and read back."""
    cfg = with_weights(EDGE, experts=experts, scale=scale, fp8_block=block)
    weights = random_weights(cfg, 2)
    out = write_checkpoint(cfg, weights, tmp_path / "ckpt")
    dtypes = stored(out)
    got = load_weights(cfg, out)
    want = {}
    for spec in inventory(cfg):
        w = weights[spec.name]
        fmt = {DENSE: "fp8", EXPERT: experts}.get(spec.kind)
        if fmt == "fp8":
            assert dtypes[spec.name] == "F8_E4M3"
            assert dtypes[spec.name[: -len("weight")] + "scale"] == {"e8m0": "F8_E8M0", "fp32": "F32"}[scale]
            want[spec.name] = lowbit.dequantize_fp8_blocks(*lowbit.quantize_fp8_blocks(w, block, scale), block, scale)
            # e4m3: half a step is 2**-4 of the value, or 2**-10 of the block scale among subnormals
            bound = np.maximum(np.abs(w) * 2.0**-4, _fp8_scale_per_element(w, scale, block) * 2.0**-10)
        elif fmt == "fp4":
            assert dtypes[spec.name] == "I8" and dtypes[spec.name[: -len("weight")] + "scale"] == "F8_E8M0"
            want[spec.name] = lowbit.dequantize_fp4_groups(*lowbit.quantize_fp4_groups(w, 32), 32)
            # e2m1 steps: 0.5 up to 2, 1 up to 4, 2 up to 6 (times the group scale)
            group_scale = np.repeat(lowbit.decode_e8m0(lowbit.quantize_fp4_groups(w, 32)[1]), 32, axis=1)
            bound = np.maximum(np.abs(w) / 4, group_scale / 4)
        else:
            want[spec.name] = bf16(w) if spec.kind == BF16 else w
            continue
        assert np.all(np.abs(want[spec.name] - w) <= bound * (1 + 1e-6)), spec.name
        assert not np.array_equal(want[spec.name], w)  # it was quantized at all
    assert_same(got, stacked(cfg, want))


def test_sharding_and_the_index(tmp_path):
    weights = random_weights(TINY, 0)
    out = write_checkpoint(TINY, weights, tmp_path / "ckpt", shard_bytes=200_000)
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) > 3
    assert [s.name for s in shards] == [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                                        for i in range(1, len(shards) + 1)]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    by_shard = {}
    for shard in shards:
        with SafetensorsFile(shard) as st:
            by_shard.update({n: shard.name for n in st.names()})
            assert st.metadata == {"format": "pt"}
            if len(st.names()) > 1:
                assert sum(np.prod(st.shape(n)) * 4 for n in st.names()) <= 200_000
    assert index["weight_map"] == by_shard
    assert index["metadata"]["total_size"] == sum(int(np.prod(w.shape)) * w.itemsize for w in weights.values())
    want = stacked(TINY, weights)
    assert_same(load_weights(TINY, out), want)
    assert_same(load_weights(TINY, out / "model.safetensors.index.json"), want)


def test_a_single_shard_file_is_a_checkpoint(tmp_path):
    out = write_checkpoint(TINY, random_weights(TINY, 0), tmp_path / "ckpt", shard_bytes=200_000)
    first = sorted(out.glob("*.safetensors"))[0]
    with SafetensorsFile(first) as st, Checkpoint(first) as ckpt:
        assert ckpt.names() == sorted(st.names())


@pytest.mark.parametrize("dtype", ["I64", "I32"])
def test_tid2eid_integer_widths(tiny_copy, dtype):
    name = "layers.0.ffn.gate.tid2eid"

    def narrow(tensors):
        tensors[name] = (dtype, tensors[name][1].astype({"I64": np.int64, "I32": np.int32}[dtype]))

    rewrite(shard_of(tiny_copy, name), narrow)
    got = load_weights(TINY, tiny_copy, names={name})[name]
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, random_weights(TINY, 0)[name])


def test_transformers_names_load_identically(tiny_ckpt, tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32)
    # save_pretrained writes transformers' reverse mapping (model.layers.N.attn.*, one tensor
    # per expert); the state dict holds its own names with merged experts.
    model.save_pretrained(tmp_path / "saved")
    (tmp_path / "state").mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "state" / "model.safetensors")
    saved, state = stored(tmp_path / "saved"), stored(tmp_path / "state")
    assert "model.layers.0.attn.norm.weight" in saved and "model.hc_head.hc_fn" in saved
    assert "model.layers.2.mlp.experts.gate_up_proj" in state and "model.layers.2.mlp.experts.down_proj" in state
    assert "model.layers.1.self_attn.compressor.indexer.q_b_proj.weight" in state
    # transformers does not instantiate the MTP block, so compare the backbone.
    backbone = dataclasses.replace(TINY, mtp_layers=())
    for path in (tmp_path / "saved", tmp_path / "state"):
        from_hf = load_weights(backbone, path)  # nothing missing, nothing left over
        assert_same(from_hf, load_weights(backbone, tiny_ckpt, names=set(from_hf)))
        refused(TINY, path, "missing tensor mtp.0.")


def test_official_names_pass_through():
    for cfg in (TINY, EDGE):
        for spec in inventory(cfg):
            assert official_name(spec.name) == spec.name


def test_transformers_fp8_scale_names(edge_copy):
    base, hf = "layers.0.attn.wq_a", "model.layers.0.self_attn.q_a_proj"

    def rename(tensors):
        tensors[f"{hf}.weight"] = tensors.pop(f"{base}.weight")
        tensors[f"{hf}.weight_scale_inv"] = tensors.pop(f"{base}.scale")

    want = load_weights(EDGE, edge_copy, names={f"{base}.weight"})
    rewrite(shard_of(edge_copy, f"{base}.weight"), rename)
    assert_same(load_weights(EDGE, edge_copy, names={f"{base}.weight"}), want)


def test_random_weights_are_deterministic():
    a, b, c = random_weights(EDGE, 7), random_weights(EDGE, 7), random_weights(EDGE, 8)
    assert a.keys() == b.keys() == c.keys() == {s.name for s in inventory(EDGE)}
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
        assert not np.array_equal(a[name], c[name]), name
        assert a[name].dtype == (np.int64 if name.endswith("tid2eid") else np.float32)


# --------------------------------------------------------------------------- streaming


def _spy_reads(monkeypatch) -> list[str]:
    calls = []
    real = SafetensorsFile.read_rows

    def read_rows(self, name, start, stop):
        calls.append(name)
        return real(self, name, start, stop)

    monkeypatch.setattr(SafetensorsFile, "read_rows", read_rows)
    return calls


def test_load_reads_only_the_requested_tensors(edge_ckpt, monkeypatch):
    calls = _spy_reads(monkeypatch)
    names = {"embed.weight", "layers.1.attn.wq_a.weight", "layers.0.ffn.experts.w2"}
    got = load_weights(EDGE, edge_ckpt, names=names)
    assert set(got) == names and got["layers.0.ffn.experts.w2"].shape == (4, 160, 96)
    want = ["embed.weight", "layers.1.attn.wq_a.weight", "layers.1.attn.wq_a.scale"]
    want += [f"layers.0.ffn.experts.{e}.w2.{part}" for e in range(4) for part in ("weight", "scale")]
    assert sorted(calls) == sorted(want)


def test_a_full_load_reads_every_tensor_once(edge_ckpt, monkeypatch):
    calls = _spy_reads(monkeypatch)
    load_weights(EDGE, edge_ckpt)
    assert Counter(calls) == Counter(list(stored(edge_ckpt)))


# --------------------------------------------------------------------------- refusals


def test_truncated_shard(tiny_copy):
    shard = shard_of(tiny_copy, "head.weight")
    shard.write_bytes(shard.read_bytes()[:-100])
    refused(TINY, tiny_copy, shard.name, "truncated")


def test_a_bad_shard_leaves_no_file_open(tmp_path, monkeypatch):
    out = write_checkpoint(TINY, random_weights(TINY, 0), tmp_path / "ckpt", shard_bytes=200_000)
    last = sorted(out.glob("*.safetensors"))[-1]
    last.write_bytes(last.read_bytes()[:-1])
    opened, real_init = [], SafetensorsFile.__init__

    def init(self, path):
        real_init(self, path)
        opened.append(self)

    monkeypatch.setattr(SafetensorsFile, "__init__", init)
    refused(TINY, out, last.name)
    assert len(opened) > 1 and all(st._file.closed for st in opened)


def test_header_offsets_out_of_range(tiny_copy):
    shard = shard_of(tiny_copy, "norm.weight")
    blob = shard.read_bytes()
    size = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8: 8 + size])
    begin, end = header["norm.weight"]["data_offsets"]
    data = len(blob) - 8 - size
    header["norm.weight"]["data_offsets"] = [data, data + end - begin]
    raw = json.dumps(header).encode()
    shard.write_bytes(len(raw).to_bytes(8, "little") + raw + blob[8 + size:])
    refused(TINY, tiny_copy, shard.name, "norm.weight", "outside")


def test_missing_tensor(tiny_copy):
    rewrite(shard_of(tiny_copy, "layers.1.attn.wkv.weight"), lambda t: t.pop("layers.1.attn.wkv.weight"))
    refused(TINY, tiny_copy, "missing tensor layers.1.attn.wkv.weight", str(tiny_copy))


def test_wrong_shape(tiny_copy):
    name = "layers.0.attn.q_norm.weight"
    rewrite(shard_of(tiny_copy, name), lambda t: t.update({name: ("F32", np.ones(33, np.float32))}))
    refused(TINY, tiny_copy, name, "shape [33]", "[32]")


def test_int_where_a_float_is_expected(tiny_copy):
    name = "layers.0.attn_norm.weight"
    rewrite(shard_of(tiny_copy, name), lambda t: t.update({name: ("I32", np.ones(64, np.int32))}))
    refused(TINY, tiny_copy, name, "I32")


def test_fp8_without_its_scale(edge_copy):
    name = "layers.0.attn.wo_b"
    rewrite(shard_of(edge_copy, f"{name}.scale"), lambda t: t.pop(f"{name}.scale"))
    refused(EDGE, edge_copy, f"{name}.weight", f"{name}.scale")


def test_fp8_scale_of_the_wrong_shape(edge_copy):
    name = "layers.0.attn.wq_a"
    rewrite(shard_of(edge_copy, f"{name}.scale"),
            lambda t: t.update({f"{name}.scale": ("F8_E8M0", np.full((2, 2), 127, np.uint8))}))
    refused(EDGE, edge_copy, f"{name}.weight", "scale has shape [2, 2]", "[1, 2]")


def test_fp4_scale_must_be_e8m0(edge_copy):
    name = "layers.1.ffn.experts.3.w1"
    rewrite(shard_of(edge_copy, f"{name}.scale"),
            lambda t: t.update({f"{name}.scale": ("F32", np.ones((96, 5), np.float32))}))
    refused(EDGE, edge_copy, f"{name}.weight", "E8M0")


def test_fp8_where_bf16_is_expected(edge_copy):
    name = "embed.weight"
    rewrite(shard_of(edge_copy, name), lambda t: t.update({name: ("F8_E4M3", np.zeros((130, 160), np.uint8))}))
    refused(EDGE, edge_copy, name, "F8_E4M3")


def test_tensor_in_two_shards(tmp_path):
    out = write_checkpoint(TINY, random_weights(TINY, 0), tmp_path / "ckpt", shard_bytes=200_000)
    home = shard_of(out, "norm.weight")
    other = next(s for s in sorted(out.glob("*.safetensors")) if s != home)
    rewrite(other, lambda t: t.update({"norm.weight": ("F32", np.ones(64, np.float32))}))
    refused(TINY, out, "norm.weight", "stored twice", home.name, other.name)


def test_merged_and_per_expert_copies_clash(tiny_copy):
    merged = ("F32", np.zeros((8, 128, 64), np.float32))
    rewrite(shard_of(tiny_copy, "norm.weight"),
            lambda t: t.update({"model.layers.2.mlp.experts.gate_up_proj": merged}))
    refused(TINY, tiny_copy, "layers.2.ffn.experts.0.w1.weight", "stored twice")


def test_index_names_a_missing_shard(tmp_path):
    out = write_checkpoint(TINY, random_weights(TINY, 0), tmp_path / "ckpt", shard_bytes=200_000)
    gone = sorted(out.glob("*.safetensors"))[1]
    gone.unlink()
    refused(TINY, out, "model.safetensors.index.json", gone.name)


def test_index_that_is_not_an_index(tiny_copy):
    (tiny_copy / "model.safetensors.index.json").write_text('{"weights": {}}')
    refused(TINY, tiny_copy, "model.safetensors.index.json", "not a valid safetensors index")


def test_empty_directory(tmp_path):
    refused(TINY, tmp_path, str(tmp_path), "no .safetensors")


def test_nonexistent_path(tmp_path):
    refused(TINY, tmp_path / "nowhere", str(tmp_path / "nowhere"), "no such")


@pytest.mark.parametrize("bad", [-1, 8])
def test_tid2eid_expert_ids_out_of_range(tiny_copy, bad):
    name = "layers.1.ffn.gate.tid2eid"

    def corrupt(tensors):
        ids = tensors[name][1].copy()
        ids[5, 1] = bad
        tensors[name] = ("I64", ids)

    rewrite(shard_of(tiny_copy, name), corrupt)
    refused(TINY, tiny_copy, name, "[0, 8)")


def test_a_checkpoint_of_a_larger_model(tiny_ckpt):
    # The checkpoint has an MTP block this config does not: it is a different model.
    refused(dataclasses.replace(TINY, mtp_layers=()), tiny_ckpt, "does not describe", "mtp.0.")


def test_unknown_requested_names(tiny_ckpt):
    refused(TINY, tiny_ckpt, "layers.9.attn_norm.weight", error=UsageError, names={"layers.9.attn_norm.weight"})


# --------------------------------------------------------------------------- writer refusals


def test_write_into_a_non_empty_directory(tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not an empty directory"):
        write_checkpoint(TINY, random_weights(TINY, 0), out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="not an empty directory"):
        write_checkpoint(TINY, random_weights(TINY, 0), tmp_path / "file")


def test_write_into_an_empty_directory(tmp_path):
    (tmp_path / "ckpt").mkdir()
    out = write_checkpoint(TINY, random_weights(TINY, 0), tmp_path / "ckpt")
    assert (out / "config.json").is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def _interrupted(tmp_path, weights, error=CheckpointError, **kwargs) -> str:
    parent = tmp_path / "models"
    parent.mkdir()
    (parent / "other").mkdir()
    with pytest.raises(error) as info:
        write_checkpoint(TINY, weights, parent / "ckpt", **kwargs)
    assert [p.name for p in parent.iterdir()] == ["other"]  # no output, no temporary directory
    return str(info.value)


def test_interrupted_by_a_missing_tensor(tmp_path):
    weights = random_weights(TINY, 0)
    del weights["layers.3.ffn.experts.7.w3.weight"]
    message = _interrupted(tmp_path, weights, shard_bytes=200_000)
    assert "layers.3.ffn.experts.7.w3.weight" in message and "\n" not in message


def test_interrupted_by_a_wrong_shape(tmp_path):
    weights = random_weights(TINY, 0)
    weights["layers.2.attn.wq_b.weight"] = weights["layers.2.attn.wq_b.weight"].T
    message = _interrupted(tmp_path, weights)
    assert "layers.2.attn.wq_b.weight" in message and "[320, 32]" in message


def test_refuses_tensors_outside_the_inventory(tmp_path):
    weights = {**random_weights(TINY, 0), "layers.4.attn_norm.weight": np.ones(64, np.float32)}
    assert "layers.4.attn_norm.weight" in _interrupted(tmp_path, weights)


def test_interrupted_between_shards(tmp_path, monkeypatch):
    real, written = SafetensorsWriter.write, []

    def write_then_stop(self, name, array, byte_offset=0):
        if written and written[0] != self.path:
            raise KeyboardInterrupt
        written.append(self.path)
        real(self, name, array, byte_offset)

    monkeypatch.setattr(SafetensorsWriter, "write", write_then_stop)
    _interrupted(tmp_path, iter_random_weights(TINY, 0), error=KeyboardInterrupt, shard_bytes=200_000)
    assert written


def test_random_weights_stream_in_pieces_of_bounded_size(monkeypatch):
    monkeypatch.setattr(checkpoint_writer, "PIECE_BYTES", 4096)  # 128-row pieces of the tiny model's matrices
    pieces = list(iter_random_weights(EDGE, 3))
    assert max(p.nbytes for _, p in pieces) <= 128 * 160 * 4 and len(pieces) > len(inventory(EDGE))
    whole = random_weights(EDGE, 3)
    for name in whole:
        np.testing.assert_array_equal(np.concatenate([p for n, p in pieces if n == name]), whole[name])


def test_a_streamed_checkpoint_equals_one_written_from_whole_tensors(edge_ckpt, tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_writer, "PIECE_BYTES", 4096)  # FP8 blocks and FP4 groups written piece by piece
    out = write_checkpoint(EDGE, iter_random_weights(EDGE, 0), tmp_path / "ckpt")
    for shard in sorted(edge_ckpt.glob("*.safetensors")):
        with SafetensorsFile(shard) as want, SafetensorsFile(out / shard.name) as got:
            assert got.names() == want.names()
            for name in want.names():
                assert got.dtype(name) == want.dtype(name)
                np.testing.assert_array_equal(got.read_raw(name), want.read_raw(name), err_msg=name)


@pytest.mark.parametrize("stream, message", [
    (lambda pieces: pieces[1:], "tensor embed.weight was not provided"),
    (lambda pieces: pieces[:1] + pieces[2:], "tensor head.weight was not provided"),
    (lambda pieces: pieces + [("norm.weight", np.ones(64, np.float32))], "comes after the whole inventory"),
    (lambda pieces: [("nope", np.ones(3, np.float32))] + pieces, "tensor nope is not in the model's inventory"),
    (lambda pieces: [(n, p[:-1] if n == "norm.weight" else p) for n, p in pieces], "norm.weight ended after 63"),
    (lambda pieces: [(n, p.T if n == "head.weight" else p) for n, p in pieces], "a piece of tensor head.weight"),
])
def test_stream_refusals(tmp_path, stream, message):
    pieces = list(iter_random_weights(TINY, 0))
    assert message in _interrupted(tmp_path, iter(stream(pieces)))
