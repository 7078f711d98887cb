"""KV pool: geometry against docs/v4.md ("KV pool"), allocator properties, the device's attention rows, paged reference execution."""

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4c.cli import main as cli
from dsv4c.frontend.checkpoint import load_weights
from dsv4c.frontend.config import config_from_dict, preset
from dsv4c.frontend.trace import trace
from dsv4c.ir.interpreter import Interpreter
from dsv4c.passes.quant_plan import plan_for
from dense_cache import DenseCache
from dsv4c.artifact.pool import ENVELOPE_TOKENS, PoolGeometry
from dsv4c.runtime.kv_pool import KVPool, PagedStore, PoolExhausted

from parity_configs import PARITY_CONFIGS
from reference_harness import fp32_checkpoint


# ----------------------------------------------------------------------------- geometry


def test_pro_geometry_on_gfx950_matches_spec():
    g = PoolGeometry.build(preset("pro"), plan_for(preset("pro"), "gfx950"))
    assert g.rows_per_envelope == 30 * 64 + 31 * 2 == 1982
    assert g.main_row_bytes == 584 and g.index_row_bytes == 68
    assert sum(g.bytes_per_token().values()) <= 5032
    assert g.bytes_per_token()["index"] == 7.5 * 68
    assert g.window_rows_per_request == (61 + 1) * 128 == 7936  # 61 layers and the MTP layer
    # 64 KiB + 16 KiB per CSA layer, 512 KiB per HCA layer.
    assert g.state_bytes_per_request == 30 * (64 + 16) * 1024 + 31 * 512 * 1024
    assert abs(g.state_bytes_per_request / 2**20 - 17.8) < 0.1


def test_flash_geometry_and_index_row_sizes():
    flash = preset("flash")
    assert PoolGeometry.build(flash, plan_for(flash, "llvm")).rows_per_envelope == 21 * 64 + 20 * 2 == 1384
    assert PoolGeometry.build(flash, plan_for(flash, "gfx942")).index_row_bytes == 132
    assert PoolGeometry.build(flash, plan_for(flash, "sm90")).index_row_bytes == 132
    assert PoolGeometry.build(flash, plan_for(flash, "gfx950")).index_row_bytes == 68


def test_inspect_json_contract(capsys):
    # The memory holds the device's weights first (pro needs 8 devices for them, see test_sharding.py).
    assert cli(["inspect", "pro", "--target", "gfx950", "--tensor-parallel", "8", "--memory", "141GiB", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["rows_per_envelope"] == 1982
    assert report["bytes_per_token"] <= 5032
    assert report["window_rows_per_request"] == 7936
    assert abs(report["state_bytes_per_request"] / 2**20 - 17.8) < 0.1
    assert report["max_tokens"] > 1_000_000
    assert report["fp8_format"] == "e4m3fn" and report["expert_format"] == "fp4"
    assert cli(["inspect", "flash", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows_per_envelope"] == 1384


def test_inspect_bad_model_is_one_line_error(capsys):
    assert cli(["inspect", "no-such-model"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dsv4c: error:") and "\n" not in err


# ----------------------------------------------------------------------------- allocator


def _small_pool(total_rows=None):
    cfg = config_from_dict(PARITY_CONFIGS["mixed_hc4"], "m")
    g = PoolGeometry.build(cfg, plan_for(cfg, "llvm"))
    return KVPool(g, total_rows or 8 * g.rows_per_envelope + 6 * g.window_rows_per_request)


def _owned_rows(pool):
    owners = {}
    for seq, req in pool.requests.items():
        spans = [pool.slot_rows(req.slot)] + [pool.envelope_rows(b) for b in req.blocks]
        for a, b in spans:
            for r in range(a, b):
                assert r not in owners, f"row {r} owned by {owners[r]} and {seq}"
                assert 0 <= r < pool.total_rows
                owners[r] = seq
    return owners


def _snapshot(pool):
    return (pool._env_high, pool._slot_high, sorted(pool._env_free), sorted(pool._slot_free),
            {s: (r.slot, list(r.blocks)) for s, r in pool.requests.items()})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["admit", "extend", "free"]), st.integers(0, 7),
                          st.integers(0, 3 * ENVELOPE_TOKENS)), max_size=60))
def test_allocator_properties(ops):
    pool = _small_pool()
    lengths = {}
    for op, seq, tokens in ops:
        before = _snapshot(pool)
        try:
            if op == "admit" and seq not in pool.requests:
                pool.admit(seq, reserve_tokens=tokens)
                lengths[seq] = tokens
            elif op == "extend" and seq in pool.requests:
                lengths[seq] += tokens
                pool.ensure(seq, lengths[seq])
            elif op == "free" and seq in pool.requests:
                pool.free(seq)
        except PoolExhausted:
            assert _snapshot(pool) == before, "exhaustion changed the pool"
            if op == "extend":
                lengths[seq] -= tokens
        owners = _owned_rows(pool)
        # Windows (slots) never touch envelopes: the two regions are separated by the boundary.
        env_top = pool._env_high * pool.geometry.rows_per_envelope
        slot_bottom = pool.total_rows - pool._slot_high * pool.geometry.window_rows_per_request
        assert env_top <= slot_bottom
        for seq_, req in pool.requests.items():
            assert pool.slot_rows(req.slot)[0] >= slot_bottom
            assert all(pool.envelope_rows(b)[1] <= env_top for b in req.blocks)
            assert len(req.blocks) * ENVELOPE_TOKENS >= lengths[seq_]
        assert len(owners) <= pool.total_rows
    for seq in list(pool.requests):
        pool.free(seq)
    assert _snapshot(pool) == (0, 0, [], [], {}), "something leaked after freeing everything"


def test_exhaustion_is_typed_and_changes_nothing():
    pool = _small_pool()
    pool.admit(1, reserve_tokens=ENVELOPE_TOKENS)
    before = _snapshot(pool)
    with pytest.raises(PoolExhausted, match="exhausted"):
        pool.admit(2, reserve_tokens=10**7)
    with pytest.raises(PoolExhausted):
        pool.ensure(1, 10**7)
    assert _snapshot(pool) == before


def test_freed_rows_move_the_boundary_back():
    pool = _small_pool()
    g = pool.geometry
    pool.admit(1, reserve_tokens=4 * ENVELOPE_TOKENS)
    pool.admit(2)
    pool.free(1)
    # All envelopes are free again: a new request can take nearly the whole row space.
    most = (pool.total_rows - 2 * g.window_rows_per_request) // g.rows_per_envelope
    pool.admit(3, reserve_tokens=most * ENVELOPE_TOKENS)
    assert len(pool.requests[3].blocks) == most


# ----------------------------------------------------------------------------- paged execution


def _run(cfg, weights, store, schedule, tokens, numerics="exact", hook=None, pool=None):
    """schedule: list of steps; a step is a list of (seq, n_tokens). Returns {seq: logits}."""
    interp = Interpreter(trace(cfg, numerics), weights, store, hook=hook)
    done, out = {}, {}
    for step in schedule:
        toks, pos, seqs = [], [], []
        for seq, n in step:
            start = done.get(seq, 0)
            if pool is not None:
                if seq not in pool.requests:
                    pool.admit(seq)
                pool.ensure(seq, start + n)
            toks += list(tokens[seq][start:start + n])
            pos += list(range(start, start + n))
            seqs += [seq] * n
            done[seq] = start + n
        logits, _ = interp.run("step", tokens=np.array(toks), positions=np.array(pos), seq_ids=np.array(seqs))
        for i, seq in enumerate(seqs):
            out.setdefault(seq, []).append(logits[i])
    return {s: np.stack(v) for s, v in out.items()}


@pytest.fixture(scope="module", params=["mixed_hc4", "odd_ratios_hc2", "official_hc2"])
def model(request, tmp_path_factory):
    cfg = config_from_dict(PARITY_CONFIGS[request.param], request.param)
    path = tmp_path_factory.mktemp(request.param) / "ckpt"
    cfg = fp32_checkpoint(cfg, path)
    return cfg, load_weights(cfg, path)


def _pool_for(cfg, numerics="exact", requests=4, tokens=600):
    g = PoolGeometry.build(cfg, plan_for(cfg, "llvm", numerics))
    envs = requests * -(-tokens // ENVELOPE_TOKENS)
    return KVPool(g, envs * g.rows_per_envelope + requests * g.window_rows_per_request)


def test_paged_equals_dense_bit_for_bit(model):
    cfg, weights = model
    tokens = {0: np.random.default_rng(1).integers(0, cfg.vocab_size, 300)}
    schedule = [[(0, 100)], [(0, 37)], [(0, 91)]] + [[(0, 1)]] * 20
    dense = _run(cfg, weights, DenseCache(cfg), schedule, tokens)
    pool = _pool_for(cfg)
    paged = _run(cfg, weights, PagedStore(pool), schedule, tokens, pool=pool)
    assert np.array_equal(dense[0], paged[0])


def test_ragged_batches_match_requests_run_alone(model):
    cfg, weights = model
    rng = np.random.default_rng(2)
    tokens = {s: rng.integers(0, cfg.vocab_size, 260) for s in range(4)}
    # Prefill chunks of different requests mixed with decode tokens of others.
    schedule = [[(0, 70), (1, 5)], [(0, 1), (1, 60), (2, 33)], [(2, 1), (0, 1), (3, 130), (1, 1)],
                [(3, 1), (2, 90), (0, 1)]] + [[(0, 1), (1, 1), (2, 1), (3, 1)]] * 12
    pool = _pool_for(cfg)
    paged = _run(cfg, weights, PagedStore(pool), schedule, tokens, pool=pool)
    for seq in tokens:
        alone = [[(s, n)] for step in schedule for s, n in step if s == seq]
        dense = _run(cfg, weights, DenseCache(cfg), alone, tokens)
        assert np.abs(dense[seq] - paged[seq]).max() <= 1e-5


def test_qat_pool_in_storage_formats_reproduces_qat_exactly(tmp_path):
    cfg = fp32_checkpoint(preset("tiny"), tmp_path / "c")
    weights = load_weights(cfg, tmp_path / "c")
    tokens = {0: np.random.default_rng(3).integers(0, cfg.vocab_size, 200)}
    schedule = [[(0, 150)]] + [[(0, 1)]] * 10
    pool = _pool_for(cfg, "qat")
    assert pool.geometry.main_storage == "fp8" and pool.geometry.index_storage == "fp4"
    dense = _run(cfg, weights, DenseCache(cfg), schedule, tokens, "qat")
    paged = _run(cfg, weights, PagedStore(pool), schedule, tokens, "qat", pool=pool)
    assert np.array_equal(dense[0], paged[0])


def test_steady_state_decode_allocates_no_pool_arrays(model):
    cfg, weights = model
    pool = _pool_for(cfg)
    arrays = [id(a) for a in pool.planes.values()] + [id(pool.index_plane)] + \
             [id(a) for pair in pool.state.values() for a in pair]
    tokens = {0: np.random.default_rng(4).integers(0, cfg.vocab_size, 80)}
    _run(cfg, weights, PagedStore(pool), [[(0, 40)]] + [[(0, 1)]] * 30, tokens, pool=pool)
    after = [id(a) for a in pool.planes.values()] + [id(pool.index_plane)] + \
            [id(a) for pair in pool.state.values() for a in pair]
    assert arrays == after


def _attention_rows(pool, layer, seqs, pos, topk):
    """What the compiled step's attention_rows kernel lists for this layer (step_kernels)."""
    import tvm

    from dsv4c.codegen import step_kernels
    from dsv4c.runtime.backend_tvm import step_inputs

    g = pool.geometry
    kind = {"sliding": "none", "hca": "all", "csa": "topk"}[layer.attention]
    kernel = step_kernels.attention_rows(g.window, g.window_rows_per_request, layer.compress_ratio, kind)
    run = tvm.compile(tvm.IRModule({"k": kernel.with_attr("global_symbol", "k")}), target="llvm")["k"]
    ratios = sorted({c.ratio for c in g.compressed})
    token_request, requests, blocks, extents = step_inputs(pool, pos.astype(np.int32), seqs, ratios)
    t = tvm.runtime.tensor
    args = [t(pos.astype(np.int32)), t(token_request), t(requests)]
    width = g.window
    if kind != "none":
        args.append(t(blocks))
        if kind == "topk":
            args.append(t(np.ascontiguousarray(topk, np.int32)))
            width += topk.shape[1]
        else:
            width += extents[ratios.index(layer.compress_ratio)]
    scalars = [layer.index, pool.total_rows]
    if kind != "none":
        rows_of = g.rows_of(layer.index)
        scalars += [g.rows_per_envelope, rows_of.offset]
    out = t(np.zeros((len(pos), width), np.int32))
    run(*args, *scalars, out)
    return out.numpy()


def test_attention_rows_list_exactly_the_rows_attention_reads(model):
    cfg, weights = model
    pool = _pool_for(cfg)
    store = PagedStore(pool)
    rng = np.random.default_rng(5)
    tokens = {s: rng.integers(0, cfg.vocab_size, 200) for s in range(2)}
    captured = []

    def hook(node, args, result):
        if node.op == "sparse_attn":
            captured.append((node.attrs, args))

    _run(cfg, weights, store, [[(0, 150), (1, 60)]], tokens, pool=pool)
    # Second step: both requests continue from where the first left the pool.
    interp = Interpreter(trace(cfg), weights, store, hook=hook)
    seqs = np.array([1] * 30 + [0] * 3)
    pos = np.concatenate([np.arange(60, 90), np.arange(150, 153)])
    for s, p in ((1, 90), (0, 153)):
        pool.ensure(s, p)
    toks = np.concatenate([tokens[1][60:90], tokens[0][150:153]])
    interp.run("step", tokens=toks, positions=pos, seq_ids=seqs)
    assert len(captured) == cfg.num_layers
    step_start = np.where(seqs == 1, 60, 150)
    layers = {l.index: l for l in cfg.layers}
    for attrs, args in captured:
        layer = layers[attrs["layer"]]
        topk = args[6] if len(args) > 6 else None
        lists = _attention_rows(pool, layer, seqs, pos, topk)
        kv = args[1]
        table = np.concatenate([pool.read_main(np.arange(pool.total_rows)), kv])
        for t in range(len(seqs)):
            rows = table[lists[t][lists[t] >= 0]]
            # Rebuild what the kernel attends to for this query from the store.
            p, s0 = pos[t], step_start[t]
            lo = max(0, p - cfg.sliding_window + 1)
            window = np.concatenate([store.window_rows(layer.index, int(seqs[t]), lo, s0) if lo < s0 else
                                     np.zeros((0, cfg.head_dim), np.float32),
                                     kv[t - (p - max(lo, s0)):t + 1]])
            expect = [window]
            if layer.attention == "hca":
                expect.append(store.entries(layer.index, "main", int(seqs[t]), (p + 1) // layer.compress_ratio))
            elif layer.attention == "csa":
                sel = topk[t][topk[t] >= 0]
                expect.append(store.entries(layer.index, "main", int(seqs[t]), int(sel.max()) + 1 if len(sel) else 0)[sel])
            assert np.array_equal(rows, np.concatenate(expect))
