"""Layer roles as data: a V4.1-shaped schedule (shared compressed KV, re-scoring index sources,
reused top-k, a two-level top-k, Engram) is read, checked and sized by the pool geometry, and
refused before the trace, which builds V4's kinds only."""

import dataclasses
import json
from importlib import resources

import pytest

from dsv4c.artifact.model_config import CSA, HASH_MOE, ROUTED_MOE, SLIDING, Candidates, LayerSpec, v4_layer
from dsv4c.artifact.pool import ENVELOPE_TOKENS, PoolGeometry
from dsv4c.errors import ConfigError, UnsupportedModelError
from dsv4c.frontend.config import config_from_dict, preset
from dsv4c.frontend.schedule import shared_kv_schedule, validate_schedule
from dsv4c.frontend.trace import Model
from dsv4c.passes.quant_plan import plan_for

RATIOS = [0, 0] + [2] * 18 + [1] * 20
V41_FIELDS = {
    "kv_source_layer_ids": [2, 8, 14, 20],
    "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "candidate_source_layer_id": 20, "candidate_block_size": 8, "candidate_topk_blocks": 2048,
    "engram_layer_ids": [1, 14],
}
MOE = [HASH_MOE] * 3 + [ROUTED_MOE] * 37


def v41_raw(**changes) -> dict:
    raw = json.loads(resources.files("dsv4c.frontend").joinpath("presets/flash.json").read_text())
    return {**raw, "num_hidden_layers": 40, "num_nextn_predict_layers": 0, "compress_ratios": RATIOS,
            **V41_FIELDS, **changes}


def v41_layers() -> tuple[LayerSpec, ...]:
    layers = shared_kv_schedule(V41_FIELDS, RATIOS, MOE)
    validate_schedule(layers)
    return layers


def test_v41_roles():
    layers = v41_layers()
    assert [l.indexer_role for l in layers[:4]] == ["none", "none", "own_keys", "reuse_topk"]
    assert layers[0].attention == SLIDING and layers[5].attention == CSA
    assert [l.kv_source for l in (layers[7], layers[8], layers[39])] == [2, 8, 20]
    assert layers[24].indexer_role == "rescore" and layers[24].kv_source == 20
    assert layers[27].indexer_role == "reuse_topk" and layers[27].topk_source == 24
    assert layers[20].is_candidate_source and layers[20].candidates == Candidates(20, 8, 2048)
    assert layers[28].candidates == layers[20].candidates and not layers[28].is_candidate_source
    assert layers[21].candidates is None and layers[8].candidates is None
    assert [l.index for l in layers if l.engram] == [1, 14]
    assert not any(l.is_v4 for l in layers[2:])


def test_v4_kinds_are_role_values():
    csa, hca, sliding = v4_layer(3, CSA, 4, ROUTED_MOE), v4_layer(4, "hca", 128, ROUTED_MOE), \
        v4_layer(5, SLIDING, 0, ROUTED_MOE)
    assert csa.indexer_role == "own_keys" and csa.overlap and csa.is_kv_source and csa.owns_index_keys
    assert hca.indexer_role == "none" and hca.is_kv_source and not hca.overlap and hca.attention == "hca"
    assert not sliding.is_compressed and sliding.kv_source is None
    assert all(l.is_v4 for l in preset("flash").layers + preset("pro").layers)


def test_v41_geometry_counts_a_group_once():
    cfg = dataclasses.replace(preset("flash"), layers=v41_layers(), mtp_layers=())
    g = PoolGeometry.build(cfg, plan_for(cfg, "llvm"))
    # Four groups: three of ratio 2 (128 rows an envelope), one of ratio 1 (one row per token).
    assert [(c.layer, c.ratio, c.rows_per_envelope) for c in g.compressed] == [(2, 2, 128), (8, 2, 128),
                                                                               (14, 2, 128), (20, 1, 256)]
    assert g.rows_per_envelope == g.index_rows_per_envelope == 3 * 128 + ENVELOPE_TOKENS
    assert g.compressed[3].readers == tuple(range(20, 40)) and g.compressed[0].readers == tuple(range(2, 8))
    assert g.rows_of(33) == g.compressed[3] and g.rows_of(5).offset == 0 and g.rows_of(9).offset == 128
    with pytest.raises(KeyError):
        g.rows_of(1)
    assert g.window_rows_per_request == 40 * cfg.sliding_window  # a window in every layer
    # One compressor (main and index rings, windows not overlapping) per KV source only.
    assert [(s.layer, s.stream, s.rows, s.width) for s in g.states[-2:]] == [(20, "main", 1, 512),
                                                                          (20, "index", 1, 128)]
    assert len(g.states) == 8
    per_token = g.bytes_per_token()
    assert per_token["index"] == 640 / ENVELOPE_TOKENS * g.index_row_bytes
    assert PoolGeometry.from_summary(g.summary(), cfg) == g


def test_v41_config_is_read_checked_then_refused():
    with pytest.raises(UnsupportedModelError, match="kv_source_layer_ids"):
        config_from_dict(v41_raw())
    with pytest.raises(ConfigError, match="candidate_source_layer_id = 21"):
        config_from_dict(v41_raw(candidate_source_layer_id=21))
    with pytest.raises(ConfigError, match=r"compress_ratios\[2\] = 2: .* no kv_source_layer_ids"):
        config_from_dict(v41_raw(kv_source_layer_ids=[8, 14, 20]))
    with pytest.raises(ConfigError, match="'index_source_layer_ids' must be an increasing list"):
        config_from_dict(v41_raw(index_source_layer_ids=[8, 2]))


BAD_SCHEDULES = {
    "later_kv_source": ((LayerSpec(0, 4, ROUTED_MOE, kv_source=1), LayerSpec(1, 4, ROUTED_MOE, kv_source=1)),
                        "kv_source 1 is not this or an earlier layer"),
    "reader_of_a_reader": ((LayerSpec(0, 4, ROUTED_MOE, kv_source=0), LayerSpec(1, 4, ROUTED_MOE, kv_source=0),
                            LayerSpec(2, 4, ROUTED_MOE, kv_source=1)), "kv_source 1 owns no compressor"),
    "ratio_in_group": ((LayerSpec(0, 4, ROUTED_MOE, kv_source=0), LayerSpec(1, 2, ROUTED_MOE, kv_source=0)),
                       "compress ratio 2 differs from its KV source 0's 4"),
    "topk_of_other_group": ((v4_layer(0, CSA, 4, ROUTED_MOE),
                             LayerSpec(1, 4, ROUTED_MOE, kv_source=1, topk_source=0)),
                            "topk_source 0 runs no indexer over the rows of KV source 1"),
    "rescore_without_keys": ((v4_layer(0, "hca", 4, ROUTED_MOE),
                              LayerSpec(1, 4, ROUTED_MOE, kv_source=0, topk_source=1)),
                             "KV source 0 publishes no index keys"),
    "sliding_with_source": ((LayerSpec(0, 0, ROUTED_MOE, kv_source=0),), "a sliding-window layer reads no"),
}


@pytest.mark.parametrize("name", BAD_SCHEDULES)
def test_bad_schedules_are_config_errors(name):
    layers, message = BAD_SCHEDULES[name]
    with pytest.raises(ConfigError, match=message):
        validate_schedule(layers)


def test_only_v4_layers_trace_and_serialise():
    cfg = dataclasses.replace(preset("flash"), layers=v41_layers(), mtp_layers=())
    with pytest.raises(UnsupportedModelError, match="layer 1: shared compressed KV"):
        Model(cfg)
    with pytest.raises(ConfigError, match="layer 1: both config spellings"):
        cfg.to_json_dict()
