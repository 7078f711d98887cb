"""The ``qat`` numerics: the official reference's FP8 KV and Hadamard + FP4 indexer round trips."""

import ml_dtypes
import numpy as np
import pytest

from dsv4c.artifact import lowbit
from dsv4c.errors import UnsupportedModelError
from dsv4c.frontend.config import config_from_dict, preset
from dsv4c.frontend.trace import trace
from dsv4c.ir import reference_ops

from parity_configs import PARITY_CONFIGS
from reference_harness import fp32_checkpoint, run_ours


def test_kv_round_trip_is_fp8_nope_and_bf16_rope():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 80)).astype(np.float32) * 3
    y = reference_ops.fp8_roundtrip(x, block=64, channels=64)
    rope_bf16 = x[:, 64:].astype(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(y[:, 64:], rope_bf16), "rope channels are stored as BF16, never FP8"
    # Each 64-block is on the e4m3 grid times a power-of-two scale 2^ceil(log2(amax/448)).
    amax = np.abs(x[:, :64]).max(axis=1)
    scale = 2.0 ** np.ceil(np.log2(amax / 448))
    grid = (x[:, :64] / scale[:, None]).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale[:, None]
    assert np.array_equal(y[:, :64], grid)


def test_fp8_round_trip_hand_values():
    # amax 448 -> scale 1; 1.0625 lies between e4m3 neighbours 1.0 and 1.125 -> ties to even (1.0);
    # 0.001953125 = 2^-9 is the smallest subnormal and survives.
    x = np.zeros(64, np.float32)
    x[:4] = [448.0, 1.0625, -3.3, 2.0 ** -9]
    y = lowbit.fp8_roundtrip(x, 64)
    assert y[:4].tolist() == [448.0, 1.0, -3.25, 2.0 ** -9]


def test_indexer_round_trip_is_hadamard_then_fp4():
    # Hadamard of a one-hot is a constant +-1/sqrt(d) row; fp4 with scale 2^ceil(log2(amax/6))
    # then maps 1/sqrt(32)=0.1768 -> scale 2^-5, value 5.657 -> 6 (nearest e2m1) -> 0.1875.
    x = np.zeros((1, 32), np.float32)
    x[0, 0] = 1.0
    h = lowbit.hadamard(x)
    assert np.allclose(np.abs(h), 32 ** -0.5)
    y = lowbit.fp4_roundtrip(h, 32)
    assert np.allclose(np.abs(y), 0.1875)
    assert np.array_equal(np.sign(y), np.sign(h))


def test_qat_program_has_round_trips_where_the_reference_has_them():
    cfg = config_from_dict(PARITY_CONFIGS["mixed_hc4"], "m")
    counts = trace(cfg, "qat").functions["step"].op_counts()
    n_csa = sum(l.has_indexer for l in cfg.layers)
    assert counts["fp8_roundtrip"] == cfg.num_layers  # window KV of every layer
    assert counts["hadamard"] == counts["fp4_roundtrip"] == n_csa  # indexer queries
    entry_quant = [n.attrs["entry_quant"] for n in trace(cfg, "qat").functions["step"].nodes if n.op == "compress"]
    assert sorted(entry_quant) == sorted(["fp8"] * sum(l.is_compressed for l in cfg.layers) + ["hadamard_fp4"] * n_csa)
    assert "fp8_roundtrip" not in trace(cfg, "exact").functions["step"].op_counts()


class TopkRecorder:
    def __init__(self):
        self.rows = {}  # (layer, position) -> selected entries

    def __call__(self, node, args, result):
        if node.op == "sparse_attn" and node.attrs["kind"] == "csa":
            for p, sel in zip(args[3], args[6]):
                self.rows[(node.attrs["layer"], int(p))] = tuple(sorted(int(s) for s in sel if s >= 0))


@pytest.mark.parametrize("name", ["mixed_hc4", "tiny"])
def test_qat_chunked_equals_one_shot(tmp_path, name):
    cfg = preset("tiny") if name == "tiny" else config_from_dict(PARITY_CONFIGS[name], name)
    cfg = fp32_checkpoint(cfg, tmp_path / "c")
    n = 90
    tokens = np.random.default_rng(5).integers(0, cfg.vocab_size, n)
    a, b = TopkRecorder(), TopkRecorder()
    one = run_ours(cfg, tmp_path / "c", tokens, [n], "qat", hook=a)
    chunked = run_ours(cfg, tmp_path / "c", tokens, [11, 2, 29, 3] + [1] * 10 + [n - 55], "qat", hook=b)
    assert a.rows and a.rows == b.rows, "chunking changed the indexer's top-k selection"
    assert np.abs(one - chunked).max() <= 1e-3
    # The round trips really run (FP4 index scores may even change which rows are picked).
    exact = run_ours(cfg, tmp_path / "c", tokens, [n], "exact")
    assert np.abs(one - exact).max() > 1e-4


def test_qat_refuses_blocks_that_do_not_divide():
    cfg = config_from_dict(PARITY_CONFIGS["csa_only_hc4"], "c")  # nope dims 32: not a multiple of 64
    with pytest.raises(UnsupportedModelError, match="divisible by 64"):
        trace(cfg, "qat")
