"""safetensors reader/writer: round trips, interop with the safetensors package, error paths."""

import json
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv4c.errors import CheckpointError
from dsv4c.artifact import safetensors_io
from dsv4c.artifact.lowbit import bf16_bits_from_f32, f32_from_bf16_bits
from dsv4c.artifact.safetensors_io import SafetensorsFile, write_safetensors

RNG = np.random.default_rng(0)

EVERY_DTYPE = {
    "f32": ("F32", RNG.standard_normal((3, 4)).astype(np.float32)),
    "f16": ("F16", RNG.standard_normal((5,)).astype(np.float16)),
    "bf16": ("BF16", RNG.integers(0, 2**16, (2, 3), dtype=np.uint16)),
    "e4m3": ("F8_E4M3", RNG.integers(0, 256, (4, 4), dtype=np.uint8)),
    "e8m0": ("F8_E8M0", RNG.integers(0, 255, (2,), dtype=np.uint8)),
    "i8": ("I8", RNG.integers(-128, 128, (7,), dtype=np.int8)),
    "u8": ("U8", RNG.integers(0, 256, (1, 7), dtype=np.uint8)),
    "i32": ("I32", RNG.integers(-(2**31), 2**31, (3,), dtype=np.int32)),
    "i64": ("I64", RNG.integers(-(2**62), 2**62, (2, 2), dtype=np.int64)),
    "bool": ("BOOL", RNG.integers(0, 2, (9,)).astype(bool)),
    "scalar": ("F32", np.array(1.5, np.float32)),
    "empty": ("I64", np.zeros((0, 3), np.int64)),
}


def _header_and_data(path) -> tuple[dict, bytes]:
    blob = path.read_bytes()
    (size,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + size]), blob[8 + size :]


def _craft(path, header, data: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_round_trip_of_every_dtype(tmp_path):
    path = tmp_path / "all.safetensors"
    write_safetensors(path, EVERY_DTYPE, metadata={"format": "pt", "note": "ü"})
    with SafetensorsFile(path) as file:
        assert sorted(file.names()) == sorted(EVERY_DTYPE)
        assert file.metadata == {"format": "pt", "note": "ü"}
        for name, (dtype, array) in EVERY_DTYPE.items():
            assert file.dtype(name) == dtype
            assert file.shape(name) == array.shape
            raw = file.read_raw(name)
            assert raw.dtype == array.dtype
            np.testing.assert_array_equal(raw, array)


def test_writer_layout_is_sorted_and_aligned(tmp_path):
    path = tmp_path / "layout.safetensors"
    write_safetensors(path, {"b": ("U8", np.arange(3, dtype=np.uint8)), "a": ("I32", np.int32([7]))})
    (size,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert (8 + size) % 64 == 0
    header, data = _header_and_data(path)
    assert header["a"]["data_offsets"] == [0, 4] and header["b"]["data_offsets"] == [4, 7]
    assert data == np.int32([7]).tobytes() + bytes([0, 1, 2])
    assert "__metadata__" not in header


def test_tensors_whose_size_allows_start_64_byte_aligned(tmp_path):
    path = tmp_path / "aligned.safetensors"
    tensors = {"odd": ("U8", np.arange(5, dtype=np.uint8)), "z_big": ("F32", np.ones((3, 64), np.float32)),
               "a_tile": ("U8", np.full((2, 32), 7, np.uint8)), "bf16": ("BF16", np.zeros(7, np.uint16))}
    write_safetensors(path, tensors)
    (size,) = struct.unpack("<Q", path.read_bytes()[:8])
    header, data = _header_and_data(path)
    # No holes (the safetensors package refuses them): 64-byte multiples first, then the rest.
    spans = sorted(tuple(header[n]["data_offsets"]) for n in tensors)
    assert [s[0] for s in spans] == [0] + [s[1] for s in spans[:-1]] and spans[-1][1] == len(data)
    assert header["a_tile"]["data_offsets"][0] == 0 and header["z_big"]["data_offsets"][0] == 64
    with SafetensorsFile(path) as file:
        mapped = file.mapped()
    for name in ("a_tile", "z_big"):
        assert mapped[name].ctypes.data % 64 == 0 and (8 + size + header[name]["data_offsets"][0]) % 64 == 0
    for name, (_, array) in tensors.items():
        assert not mapped[name].flags.writeable and mapped[name].dtype == array.dtype
        np.testing.assert_array_equal(mapped[name], array)
    assert load_file(str(path))["z_big"].shape == (3, 64)


def test_read_rows_reads_a_row_range(tmp_path):
    path = tmp_path / "rows.safetensors"
    cube = np.arange(4 * 3 * 5, dtype=np.float32).reshape(4, 3, 5)
    write_safetensors(path, {"cube": ("F32", cube), "scalar": ("I64", np.array(9, np.int64))})
    with SafetensorsFile(path) as file:
        assert file.matrix_shape("cube") == (12, 5) and file.matrix_shape("scalar") == (1, 1)
        np.testing.assert_array_equal(file.read_rows("cube", 4, 7), cube.reshape(12, 5)[4:7])
        assert file.read_rows("cube", 12, 12).shape == (0, 5)
        with pytest.raises(ValueError, match="rows \\[10, 13\\)"):
            file.read_rows("cube", 10, 13)


def test_read_f32_converts_float_dtypes(tmp_path):
    values = np.float32([1.0, -2.5, 3.140625, 0.0])
    path = tmp_path / "floats.safetensors"
    write_safetensors(path, {"f32": ("F32", values), "f16": ("F16", values.astype(np.float16)),
                             "bf16": ("BF16", bf16_bits_from_f32(values)), "i8": ("I8", np.int8([1]))})
    with SafetensorsFile(path) as file:
        for name in ("f32", "f16", "bf16"):
            result = file.read_f32(name)
            assert result.dtype == np.float32
            np.testing.assert_array_equal(result, values)
        with pytest.raises(CheckpointError, match="'i8': is I8, not a float tensor"):
            file.read_f32("i8")


def test_bf16_conversion_matches_torch():
    specials = np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, 3.4e38, 1e-40, 1 + 2**-8, 1 + 3 * 2**-8])
    x = np.concatenate([specials, RNG.standard_normal(10_000).astype(np.float32) * 1e3])
    expected = torch.from_numpy(x).bfloat16().view(torch.int16).numpy().view(np.uint16)
    bits = bf16_bits_from_f32(x)
    finite = ~np.isnan(x)
    np.testing.assert_array_equal(bits[finite], expected[finite])
    assert np.isnan(f32_from_bf16_bits(bits[4]))
    all_bits = np.arange(2**16, dtype=np.uint16)
    np.testing.assert_array_equal(
        f32_from_bf16_bits(all_bits), torch.from_numpy(all_bits.view(np.int16)).view(torch.bfloat16).float().numpy()
    )


def test_reads_files_written_by_the_safetensors_package(tmp_path):
    tensors = {
        "bf16": torch.randn(4, 6).bfloat16(),
        "e4m3": torch.randn(3, 5).to(torch.float8_e4m3fn),
        "e8m0": torch.tensor([0.25, 1.0, 8.0]).to(torch.float8_e8m0fnu),
        "i64": torch.arange(-3, 3),
        "f16": torch.randn(2).half(),
        "f32": torch.randn(2, 2),
        "flags": torch.tensor([True, False, True]),
    }
    path = tmp_path / "torch.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    with SafetensorsFile(path) as file:
        assert file.metadata == {"format": "pt"}
        np.testing.assert_array_equal(file.read_f32("bf16"), tensors["bf16"].float().numpy())
        np.testing.assert_array_equal(file.read_f32("f16"), tensors["f16"].float().numpy())
        np.testing.assert_array_equal(file.read_f32("f32"), tensors["f32"].numpy())
        for name in ("e4m3", "e8m0"):
            assert file.read_raw(name).dtype == np.uint8
            np.testing.assert_array_equal(file.read_raw(name), tensors[name].view(torch.uint8).numpy())
        np.testing.assert_array_equal(file.read_raw("e8m0"), np.uint8([125, 127, 130]))
        np.testing.assert_array_equal(file.read_raw("i64"), tensors["i64"].numpy())
        np.testing.assert_array_equal(file.read_raw("flags"), tensors["flags"].numpy())


def test_files_we_write_load_in_the_safetensors_package(tmp_path):
    path = tmp_path / "ours.safetensors"
    write_safetensors(path, EVERY_DTYPE)
    loaded = load_file(str(path))
    torch_dtypes = {"F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "BF16": torch.bfloat16}
    for name, (dtype, array) in EVERY_DTYPE.items():
        tensor = loaded[name]
        if dtype in torch_dtypes:
            assert tensor.dtype == torch_dtypes[dtype]
            tensor = tensor.view(torch.uint8 if tensor.element_size() == 1 else torch.int16)
            array = array.view(np.int16) if dtype == "BF16" else array
        assert tuple(tensor.shape) == array.shape
        np.testing.assert_array_equal(tensor.numpy(), array)


def _assert_checkpoint_error(path, match: str, tensor: str | None = None):
    with pytest.raises(CheckpointError, match=match) as info:
        SafetensorsFile(path)
    message = str(info.value)
    assert "\n" not in message and path.name in message
    if tensor is not None:
        assert repr(tensor) in message


def test_error_file_shorter_than_8_bytes(tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\x10\x00\x00")
    _assert_checkpoint_error(path, "too short")


def test_error_header_length_past_the_end(tmp_path):
    path = tmp_path / "cut.safetensors"
    write_safetensors(path, {"w": ("F32", np.zeros(4, np.float32))})
    header_size = struct.unpack("<Q", path.read_bytes()[:8])[0]
    path.write_bytes(path.read_bytes()[: 8 + header_size // 2])  # truncated inside the header
    _assert_checkpoint_error(path, "exceeds the .* bytes after it")


def test_error_absurd_header_length(tmp_path):
    path = tmp_path / "absurd.safetensors"
    path.write_bytes(struct.pack("<Q", 2**40) + b"{}" + b"\0" * 64)
    _assert_checkpoint_error(path, "exceeds 104857600 bytes")


@pytest.mark.parametrize("header", [b"{not json", b"\xff\xfe{}", b"[1, 2]"])
def test_error_header_not_a_json_object(tmp_path, header):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    _assert_checkpoint_error(path, "not valid UTF-8 JSON|not an object")


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ({"shape": [1], "data_offsets": [0, 4]}, "missing or non-string 'dtype'"),
        ({"dtype": "F32", "data_offsets": [0, 4]}, "'shape' must be a list of integers"),
        ({"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]}, "'shape' must be a list of integers"),
        ({"dtype": "F32", "shape": [1]}, "'data_offsets' must be"),
        ({"dtype": "F32", "shape": [1], "data_offsets": [0]}, "'data_offsets' must be"),
        ({"dtype": "F32", "shape": [-1, -4], "data_offsets": [0, 16]}, "negative dimension"),
        ({"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}, "unsupported dtype 'F64'"),
        ({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, "hold 8 bytes but F32 \\[3\\] needs 12"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [-4, 4]}, "outside the 8-byte data buffer"),
        ("not an object", "not an object"),
    ],
)
def test_error_malformed_entry(tmp_path, entry, match):
    path = tmp_path / "entry.safetensors"
    _craft(path, {"w": entry}, bytes(8))
    _assert_checkpoint_error(path, match, tensor="w")


def test_error_bad_metadata(tmp_path):
    path = tmp_path / "meta.safetensors"
    _craft(path, {"__metadata__": {"n": 1}})
    _assert_checkpoint_error(path, "__metadata__ must map strings to strings")


def test_error_truncated_data(tmp_path):
    path = tmp_path / "truncated.safetensors"
    write_safetensors(path, {"a": ("F32", np.zeros(4, np.float32)), "b": ("I64", np.zeros(8, np.int64))})
    path.write_bytes(path.read_bytes()[:-1])
    # "b" (64 bytes) lies first, so the cut falls in "a".
    _assert_checkpoint_error(path, "outside the 79-byte data buffer; .*truncated", tensor="a")


def test_error_overlapping_ranges(tmp_path):
    path = tmp_path / "overlap.safetensors"
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "empty": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}
    _craft(path, header, bytes(12))
    _assert_checkpoint_error(path, "overlaps that of tensor 'b'", tensor="a")


def test_error_missing_tensor_and_file(tmp_path):
    path = tmp_path / "one.safetensors"
    write_safetensors(path, {"w": ("F32", np.zeros(1, np.float32))})
    with SafetensorsFile(path) as file:
        for access in (file.read_raw, file.read_f32, file.shape, file.dtype):
            with pytest.raises(CheckpointError, match="'nope': not in this file") as info:
                access("nope")
            assert "\n" not in str(info.value) and path.name in str(info.value)
    _assert_checkpoint_error(tmp_path / "absent.safetensors", "cannot open")


class _ReadSpy:
    """Wraps a file and records how many bytes each read asks for."""

    def __init__(self, file, sizes: list[int]):
        self._file, self._sizes = file, sizes

    def read(self, size=-1):
        self._sizes.append(size)
        return self._file.read(size)

    def readinto(self, buffer):
        self._sizes.append(memoryview(buffer).nbytes)
        return self._file.readinto(buffer)

    def __getattr__(self, name):
        return getattr(self._file, name)


def test_read_raw_reads_only_the_header_and_that_tensor(tmp_path, monkeypatch):
    path = tmp_path / "big.safetensors"
    big = np.zeros(1 << 20, np.float32)
    small = np.arange(10, dtype=np.int32)
    write_safetensors(path, {"a_big": ("F32", big), "b_small": ("I32", small)})
    sizes: list[int] = []
    monkeypatch.setattr(safetensors_io, "open", lambda *a: _ReadSpy(open(*a), sizes), raising=False)
    with SafetensorsFile(path) as file:
        np.testing.assert_array_equal(file.read_raw("b_small"), small)
    assert -1 not in sizes and sum(sizes) < 1024  # 8 + header + 40 bytes, never the 4 MiB tensor


def test_file_is_closed_on_exit_and_on_header_error(tmp_path, monkeypatch):
    path = tmp_path / "c.safetensors"
    write_safetensors(path, {"w": ("F32", np.zeros(1, np.float32))})
    with SafetensorsFile(path) as file:
        pass
    assert file._file.closed
    opened = []
    monkeypatch.setattr(safetensors_io, "open", lambda *a: opened.append(open(*a)) or opened[-1], raising=False)
    path.write_bytes(b"\x00" * 4)
    with pytest.raises(CheckpointError):
        SafetensorsFile(path)
    assert opened[0].closed


def test_writer_rejects_a_wrong_dtype_and_leaves_no_file(tmp_path):
    path = tmp_path / "w.safetensors"
    tensors = {"a": ("F32", np.zeros(2, np.float32)), "z": ("BF16", np.zeros(2, np.float32))}
    with pytest.raises(ValueError, match="'z': BF16 is stored as numpy uint16, got float32"):
        write_safetensors(path, tensors)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="unsupported dtype 'F64'"):
        write_safetensors(path, {"a": ("F64", np.zeros(2))})


def test_interrupted_write_leaves_neither_file_nor_tmp(tmp_path, monkeypatch):
    path = tmp_path / "w.safetensors"
    tensors = {name: ("F32", np.ones(1000, np.float32)) for name in "abc"}
    real, writes_left = safetensors_io.os.pwrite, [3]

    def pwrite(fd, data, offset):  # fails after a few writes, like a disk filling up
        if writes_left[0] == 0:
            raise OSError(28, "No space left on device")
        writes_left[0] -= 1
        return real(fd, data, offset)

    monkeypatch.setattr(safetensors_io.os, "pwrite", pwrite)
    with pytest.raises(OSError, match="No space left"):
        write_safetensors(path, tensors)  # length, header, "a" written; "b" fails
    assert list(tmp_path.iterdir()) == []


def test_failed_rename_leaves_neither_file_nor_tmp(tmp_path, monkeypatch):
    path = tmp_path / "w.safetensors"

    def failing_replace(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors_io.os, "replace", failing_replace)
    with pytest.raises(KeyboardInterrupt):
        write_safetensors(path, {"a": ("F32", np.ones(3, np.float32))})
    assert list(tmp_path.iterdir()) == []


def test_rewrite_replaces_an_existing_file(tmp_path):
    path = tmp_path / "w.safetensors"
    write_safetensors(path, {"a": ("F32", np.ones(3, np.float32))})
    write_safetensors(str(path), {"b": ("I8", np.int8([4]))})
    with SafetensorsFile(str(path)) as file:
        assert file.names() == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]
