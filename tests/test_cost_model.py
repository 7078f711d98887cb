"""The cost model (ir/cost.py, token_cost.py, frontend/v32.py): each op's rule against a count by
hand on the tiny config, sums against families, growth with context, the V4 report's ratios
against V3.2 at 1M context, and the CLI."""

import json

import pytest

from dsv4c.cli import main as cli
from dsv4c.errors import UnsupportedModelError, UsageError
from dsv4c.frontend.config import preset, resolve_model
from dsv4c.frontend.trace import trace
from dsv4c.ir.cost import FAMILIES, RULES, Cost, Decode, experts_touched, function_cost, node_costs, total
from dsv4c.ir.ops import OPS
from dsv4c.passes.pipeline import run_pipeline
from dsv4c.token_cost import decode_cost

CFG = preset("tiny")  # D 64, 4 heads of 80 (rope 16), q_lora 32, 8 experts top-2 of 64, index 8 x 32, top-4, W 8
MAIN, INDEX = 320, 128  # fp32 rows: 80 and 32 values


def _step(passes: bool):
    program = trace(CFG, mtp=False)
    return (run_pipeline(program) if passes else program).functions["step"]


def _node(fn, op, **attrs):
    return next(n for n in fn.nodes if n.op == op and all(n.attrs.get(k) == v for k, v in attrs.items()))


def _d(batch=1, context=64):
    return Decode(batch, context, MAIN, INDEX)


def test_every_op_has_a_cost_rule():
    assert set(OPS) - {"linear_split"} <= set(RULES), sorted(set(OPS) - set(RULES))


def test_linear_hand_count():
    n = next(n for n in _step(False).nodes if n.op == "linear" and n.inputs[1].name == "layers.0.attn.wq_a.weight")
    family, c = node_costs(n, _d(batch=3))[0]
    # [3, 64] x [32, 64]^T, fp32 weights (the tiny checkpoint's dense storage is fp8: 64 codes + one fp32 scale)
    assert family == "dense_projections"
    assert c.flops == 2 * 3 * 32 * 64
    assert c.bytes_read == 32 * (64 + 4) + 3 * 64 * 4
    assert c.bytes_written == 3 * 32 * 4


def test_merged_projection_is_split_by_family():
    fn = _step(True)
    merged = next(n for n in fn.nodes if n.op == "linear_split" and "indexer.weights_proj" in n.inputs[1].name)
    parts = node_costs(merged, _d())
    assert {f for f, _ in parts} == {"compressor", "indexer"}
    # The parts multiply their own rows: 2 * rows * 64 each, rows as the split sizes say.
    assert [c.flops for _, c in parts] == [2 * 64 * s for s in merged.attrs["sizes"]]


def test_sparse_attention_hand_count():
    fn = _step(False)
    d = _d(batch=2, context=100)
    heads, dh = 4, 80
    per_row = heads * (2 * dh + 4 + 2 * dh)
    for kind, rows in (("sliding", 8), ("hca", 8 + 100 // 16), ("csa", 8 + 4)):
        family, c = node_costs(_node(fn, "sparse_attn", kind=kind), d)[0]
        assert family == f"{kind}_attention"
        assert c.flops == 2 * rows * per_row
        # KV rows (once per row for all heads) + q, step kv, sink, positions, sequence ids (+ top-k ids)
        ids = 2 * 4 * 4 if kind == "csa" else 0
        assert c.bytes_read == 2 * rows * MAIN + 4 * (2 * heads * dh + 2 * dh + heads + 2 + 2) + ids


def test_indexer_and_topk_hand_count():
    fn = _step(False)
    d = _d(context=101)
    entries = 101 // 4
    family, c = node_costs(_node(fn, "index_score"), d)[0]
    assert family == "indexer"
    assert c.flops == entries * 8 * (2 * 32 + 3)
    assert c.bytes_read == entries * INDEX + 4 * (8 * 32 + 8 + 2)
    assert c.bytes_written == 4 * entries
    family, c = node_costs(_node(fn, "index_topk"), d)[0]
    assert (family, c.flops, c.bytes_written) == ("topk", entries, 4 * 4)


def test_compressor_hand_count():
    fn = _step(False)
    # The CSA main compressor: ratio 4, overlap, 80 wide; its ring entry is 2 x 160 fp32 values.
    family, c = node_costs(_node(fn, "compress", stream="main", ratio=4), _d(batch=4))[0]
    slots, hd = 8, 80
    close_flops = slots * hd * 6 + 4 * hd + 3 * 16
    assert family == "compressor"
    assert c.flops == close_flops  # 4 tokens close one window between them
    assert c.bytes_written == 4 * 2 * 160 * 4 + MAIN


def test_mhc_and_experts_hand_count():
    fn = _step(False)
    d = _d(batch=1)
    family, c = node_costs(_node(fn, "mhc_pre"), d)[0]
    n, dim, mix = 4, 64, 24
    assert family == "mhc"
    assert c.flops == 4 * n * dim + 2 * mix * n * dim + 4 * mix + 20 * 4 * n * n + 2 * n * dim
    routed = next(n for n in fn.nodes if n.op == "experts")
    family, c = node_costs(routed, d)[0]
    inter, k = 64, 2
    assert family == "routed_experts"
    assert c.flops == k * (6 * inter * dim + 6 * inter + 2 * dim)
    # One token touches exactly its k experts: FP4 rows of 64 inputs are 32 B + 2 scales.
    assert c.bytes_read == pytest.approx(k * 3 * 64 * (32 + 2) + 4 * (dim + 2 * k))


def test_experts_touched_by_a_batch():
    assert experts_touched(256, 6, 1) == pytest.approx(6)
    assert 6 < experts_touched(256, 6, 8) < 48
    assert experts_touched(256, 6, 10_000) == pytest.approx(256)


def test_family_sums_equal_the_nodes_and_the_json():
    fn = _step(True)
    d = _d(batch=2, context=300)
    by_family = function_cost(fn, d)
    assert list(by_family) == list(FAMILIES)
    nodes = sum((c for n in fn.nodes for _, c in node_costs(n, d)), Cost())
    sums = total(by_family)
    assert (sums.flops, sums.bytes_read, sums.bytes_written) == pytest.approx(
        (nodes.flops, nodes.bytes_read, nodes.bytes_written))
    report = decode_cost("tiny", context=300, batch=2).to_json()
    assert report["decode_flops_per_token"] == pytest.approx(nodes.flops / 2)
    assert report["decode_flops_per_token"] == pytest.approx(sum(f["flops"] for f in report["cost_by_family"].values()))
    assert report["decode_bytes_per_token"] == pytest.approx(
        sum(f["bytes_read"] for f in report["cost_by_family"].values()))


def test_cost_grows_with_context_as_the_ops_say():
    costs = {c: decode_cost("flash", "sm90", c).by_family for c in (4096, 8192, 16384, 65536)}
    flops = {f: [costs[c][f].flops for c in sorted(costs)] for f in FAMILIES}
    assert len(set(flops["sliding_attention"])) == 1  # the window is full from 128 tokens on
    assert len(set(flops["csa_attention"])) == 1  # top-512 of 1024+ entries from 2048 tokens on
    for family, ratio in (("indexer", 4), ("hca_attention", 128)):
        (a, b, c, e) = flops[family]
        slope = (b - a) / ((8192 - 4096) // ratio)  # affine in context / ratio
        assert c - a == pytest.approx(slope * (16384 - 4096) // ratio)
        assert e - a == pytest.approx(slope * (65536 - 4096) // ratio)
        assert slope > 0
    assert len(set(flops["routed_experts"])) == 1


def test_batch_shares_weights_not_kv():
    one, eight = decode_cost("flash", "sm90", 65536, 1), decode_cost("flash", "sm90", 65536, 8)
    # Weights are read once per step; each token still reads and writes its own activations (~1%).
    assert eight.by_family["dense_projections"].bytes_read == pytest.approx(
        one.by_family["dense_projections"].bytes_read / 8, rel=0.02)
    assert eight.by_family["hca_attention"].bytes_read == pytest.approx(one.by_family["hca_attention"].bytes_read,
                                                                        rel=0.01)


# The V4 report at 1M context, relative to DeepSeek-V3.2 (source article 003).
REPORT = {"pro": (0.27, 0.10), "flash": (0.10, 0.07)}


@pytest.mark.parametrize("model", sorted(REPORT))
def test_the_reports_1m_ratios_against_v32(model):
    v32 = decode_cost("v3.2", "sm90", 1 << 20)
    v4 = decode_cost(model, "sm90", 1 << 20)
    flops, kv = REPORT[model]
    assert v4.total.flops / v32.total.flops == pytest.approx(flops, rel=0.30)
    assert v4.kv_bytes_per_token / v32.kv_bytes_per_token == pytest.approx(kv, rel=0.30)


def test_v32_is_costed_but_never_compiled(capsys, tmp_path):
    with pytest.raises(UnsupportedModelError, match="cost-model preset"):
        resolve_model("v3.2")
    assert cli(["compile", "--model", "v3.2", "--target", "llvm", "-o", str(tmp_path / "a")]) == 2
    assert cli(["inspect", "v3.2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "inspect v3.2 --cost" in err
    assert cli(["inspect", "v3.2", "--cost", "--target", "sm90", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # 61 layers of one FP8 latent row (512 + 4 scales of 4 + 64 BF16) and one FP8 index row (128 + 4)
    assert report["bytes_per_token"] == 61 * (656 + 132)
    assert report["cost_by_family"]["indexer"]["flops"] > 0.8 * report["decode_flops_per_token"]


def test_inspect_cost_json_and_errors(capsys):
    assert cli(["inspect", "flash", "--target", "sm90", "--cost", "--context", "4096", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"decode_flops_per_token", "decode_bytes_per_token", "bytes_per_token", "cost_by_family"} <= set(report)
    assert report["bytes_per_token"] == pytest.approx(3850.2, abs=0.1)  # the pool's, as inspect reports it
    assert set(report["cost_by_family"]) == set(FAMILIES)
    assert cli(["inspect", "tiny", "--context", "10"]) == 2
    assert cli(["inspect", "tiny", "--cost", "--batch", "0"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert "add --cost" in err[0] and "batch >= 1" in err[1]
    with pytest.raises(UsageError):
        Decode(1, 0, MAIN, INDEX)


def test_speculation_prices_a_verified_block_against_a_plain_step():
    s = decode_cost("flash-0731", "sm90", 4096).speculation
    plain = decode_cost("flash-0731", "sm90", 4096).total.bytes_read
    assert s.method == "dspark" and list(s.rounds) == [1, 2, 3, 4, 5] and s.plain == pytest.approx(plain)
    verify = [s.rounds[k][0] for k in s.rounds]
    # Each more token of a verify step brings its own routed experts but shares the dense weights.
    assert all(plain < a < b for a, b in zip(verify, verify[1:]))
    assert all(v < (k + 1) * plain for k, v in zip(s.rounds, verify))
    drafting = [s.rounds[k][1] for k in s.rounds]
    assert all(0 < a < b for a, b in zip(drafting, drafting[1:]))  # one block call, then a Markov call per draft
    v, d = s.rounds[2]
    assert s.speedup(2, 1.0) == pytest.approx(3 * plain / (v + d))
    assert s.speedup(2, 0.0) == pytest.approx(plain / (v + d)) and s.speedup(2, 0.0) < 1
    report = decode_cost("flash-0731", "sm90", 4096).to_json()["speculation"]
    assert [r["drafts"] for r in report["rounds"]] == [1, 2, 3, 4, 5]
    assert decode_cost("flash", "sm90", 4096).speculation.method == "mtp"
