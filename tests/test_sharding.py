"""The tensor / expert parallel plan (artifact/sharding.py): every weight's per-rank slices
partition it, unsplittable counts are refused in one line, and `dsv4c inspect` / `compile`
speak of it (weights per device, min_devices, --tensor-parallel)."""

import json
from pathlib import Path

import pytest

from dsv4c.artifact.pool import PoolGeometry
from dsv4c.artifact.sharding import (EXPERTS, HEADS, MIN_DEVICES_CONTEXT, O_GROUPS, ROUTED_INTER, SHARED_INTER, VOCAB,
                                     ShardingPlan)
from dsv4c.cli import main as cli
from dsv4c.codegen.lowering import weight_layouts
from dsv4c.compile import stored_weights
from dsv4c.errors import ShardingError
from dsv4c.frontend.config import config_from_dict, load_config, preset
from dsv4c.frontend.trace import trace
from dsv4c.passes.pipeline import run_pipeline
from dsv4c.passes.quant_plan import plan_for
from dsv4c.artifact.safetensors_io import STORAGE_DTYPES

from parity_configs import PARITY_CONFIGS

REFERENCE = Path(__file__).parent / "data" / "reference_configs"
CONFIGS = {**{p.stem: p for p in sorted(REFERENCE.glob("*.json"))}, **{f"parity:{k}": k for k in PARITY_CONFIGS},
           "tiny": "tiny"}


def _config(key):
    if key.startswith("parity:"):
        return config_from_dict(PARITY_CONFIGS[key.removeprefix("parity:")], key)
    return preset(key) if key == "tiny" else load_config(CONFIGS[key])


def _splittable_counts(cfg, expert_parallel=False):
    """Every N > 1 the plan accepts for ``cfg`` (powers of two until the first refusal)."""
    out, n = [], 2
    while True:
        try:
            ShardingPlan.build(cfg, n, expert_parallel)
        except ShardingError:
            return out
        out.append(n)
        n *= 2


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["experts_split", "expert_parallel"])
@pytest.mark.parametrize("key", CONFIGS)
def test_every_weight_is_partitioned_across_ranks(key, expert_parallel):
    cfg = _config(key)
    weights = {name: tuple(v.type.shape) for fn in trace(cfg).functions.values() for name, v in fn.weights.items()}
    counts = _splittable_counts(cfg, expert_parallel)
    if key.startswith("v4-"):  # the official models split at least 8 ways (one node)
        assert counts[:3] == [2, 4, 8], counts
    expected_units = {HEADS, O_GROUPS, EXPERTS if expert_parallel else ROUTED_INTER, SHARED_INTER, VOCAB}
    for n in counts:
        plan = ShardingPlan.build(cfg, n, expert_parallel)
        units = set()
        for name, shape in weights.items():
            shards = [plan.shard(name, shape, r) for r in range(n)]
            if shards[0].axis is None:
                assert all(s.held_shape(shape) == shape for s in shards), name
                continue
            units.add(plan.split_of(name)[1])
            axis = shards[0].axis
            assert [s.start for s in shards[1:]] == [s.stop for s in shards[:-1]], (name, n)
            assert shards[0].start == 0 and shards[-1].stop == shape[axis], (name, n)
            assert len({s.extent for s in shards}) == 1 and all(s.stop - s.start <= s.extent for s in shards)
            if plan.split_of(name)[1] != VOCAB:  # only the vocab pads
                assert all(s.stop - s.start == shape[axis] // n for s in shards), (name, n)
        assert units == expected_units, (n, units)
        # the indexer's query side stays whole (one score summed over all its heads)
        assert all(plan.split_of(name) is None for name in weights if ".indexer." in name)


@pytest.mark.parametrize("model, target", [("pro", "gfx950"), ("flash", "sm90")])
def test_device_bytes_add_up_to_what_the_artifact_stores(model, target):
    cfg = preset(model)
    plan = plan_for(cfg, target)
    stored = stored_weights(cfg, plan)
    # TP 1 holds exactly the artifact's weight tensors (merged projections counted by their parts).
    layouts = weight_layouts(run_pipeline(trace(cfg)), plan)
    artifact_bytes = sum(STORAGE_DTYPES[dtype].itemsize * _prod(shape)
                         for layout in layouts.values() for dtype, shape in layout.stored().values())
    assert ShardingPlan.build(cfg, 1).device_weight_bytes(stored) == artifact_bytes
    # At 8 ranks a split weight's bytes sum to the whole (FP8 columns cut between scale blocks).
    sharding = ShardingPlan.build(cfg, 8)
    for name, shape, fmt in stored:
        held = [fmt.nbytes(sharding.shard(name, shape, r).held_shape(shape)) for r in range(8)]
        split = sharding.split_of(name)
        if split is None:
            assert held == [fmt.nbytes(shape)] * 8, name
        elif split[1] != VOCAB:
            assert sum(held) == fmt.nbytes(shape), name


def _prod(shape):
    out = 1
    for n in shape:
        out *= n
    return out


@pytest.mark.parametrize("cfg, n, says", [
    (preset("pro"), 3, "power of two"),
    (preset("pro"), 0, "power of two"),
    (preset("flash"), 16, "o_groups = 8"),
    (preset("pro"), 16, "FP8 128-column scale blocks"),  # 3072 / 16 = 192 columns of shared w2
    (config_from_dict(PARITY_CONFIGS["mixed_hc4"]), 4, "o_groups = 2"),
    (config_from_dict({**PARITY_CONFIGS["mixed_hc4"], "o_groups": 4, "n_routed_experts": 6}), 4,
     "n_routed_experts = 6"),
])
def test_unsplittable_counts_are_refused_in_one_line(cfg, n, says):
    with pytest.raises(ShardingError) as e:
        ShardingPlan.build(cfg, n)
    assert says in str(e.value) and "\n" not in str(e.value)


def _inspect(capsys, *args):
    assert cli(["inspect", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_pro_at_tensor_parallel_8_holds_a_fifth_of_the_weights_or_less(capsys):
    whole = _inspect(capsys, "pro", "--target", "gfx950")["weight_bytes_per_device"]
    split = _inspect(capsys, "pro", "--target", "gfx950", "-tp", "8")
    assert split["tensor_parallel"] == 8 and 0 < split["weight_bytes_per_device"] <= 0.2 * whole


@pytest.mark.parametrize("model, memory", [("flash", "141GiB"), ("pro", "141GiB"), ("pro", "288GiB")])
def test_min_devices_is_the_fewest_that_fit(capsys, model, memory):
    """min_devices ranks hold their weights and one 131,072-token request; half as many do not
    (read from the memory report at each count, not from min_devices' own search)."""
    n = _inspect(capsys, model, "--target", "sm90", "--memory", memory)["min_devices"]
    assert n is not None and n > 1  # neither model's weights fit on one such device

    def fits(count):
        report = _inspect(capsys, model, "--target", "sm90", "-tp", str(count), "--memory", memory)
        return report["max_requests_at_context"][str(MIN_DEVICES_CONTEXT)] >= 1

    assert fits(n) and not fits(n // 2)


def test_memory_report_subtracts_the_weights(capsys):
    report = _inspect(capsys, "flash", "--target", "sm90", "-tp", "2", "--memory", "141GiB")
    assert report["pool_memory_bytes"] == report["memory_bytes"] - report["weight_bytes_per_device"] > 0
    g = PoolGeometry.build(preset("flash"), plan_for(preset("flash"), "sm90"))
    assert report["max_tokens"] == g.budget(report["pool_memory_bytes"])["max_tokens"] < g.budget(
        report["memory_bytes"])["max_tokens"]
    assert cli(["inspect", "flash", "--target", "sm90", "-tp", "2", "--memory", "141GiB"]) == 0
    text = capsys.readouterr().out
    assert f"{report['weight_bytes_per_device'] / 2**30:,.2f} GiB" in text and "fewest devices" in text


@pytest.mark.parametrize("argv, says", [
    (["inspect", "pro", "-tp", "3"], "power of two"),
    (["inspect", "flash", "--tensor-parallel", "16"], "o_groups = 8"),
    (["compile", "--model", "flash", "--target", "llvm", "-tp", "16"], "o_groups = 8"),
    (["compile", "--model", "tiny", "--target", "llvm", "--tensor-parallel", "2"], "inside its FP8 128-column"),
    (["compile", "--model", "flash", "--target", "reference", "-tp", "2"], "compile for llvm or a GPU target"),
])
def test_cli_refuses_in_one_line(capsys, tmp_path, argv, says):
    out = tmp_path / "artifact"
    assert cli(argv + (["-o", str(out)] if argv[0] == "compile" else [])) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dsv4c: error:") and says in err and "\n" not in err
    assert not out.exists()
