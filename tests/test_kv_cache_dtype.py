"""FP8 KV pools on the CPU: the pool format and kernel set GPU artifacts use, run end to end
where CI can (the llvm target with --kv-cache-dtype fp8), against the reference backend on a
pool of the same format."""

import json

import numpy as np
import pytest

from dsv4c.cli import main as cli
from dsv4c.compile import compile_model
from dsv4c.codegen.lowering import kernel_table
from dsv4c.errors import UsageError
from dsv4c.frontend.config import config_from_dict, preset
from dsv4c.frontend.trace import trace
from dsv4c.passes.pipeline import run_pipeline
from dsv4c.passes.quant_plan import plan_for
from dsv4c.runtime.engine import Engine
from dsv4c.runtime.sampling import SamplingParams

from parity_configs import PARITY_CONFIGS
from reference_harness import fp32_checkpoint

# Looser than the fp32-pool bound (1e-4): an ulp of difference in a KV value (kernel vs numpy
# summation order) can move it across an FP8 rounding boundary, which changes the stored row by
# one FP8 step, and that shows in the logits.
TOL = 1e-3


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """mixed_hc4 (sliding, CSA, HCA; hash and routed MoE) as reference and llvm artifacts with
    an fp8 pool, and the exact (fp32 pool) reference."""
    tmp = tmp_path_factory.mktemp("fp8pool")
    cfg = fp32_checkpoint(config_from_dict(PARITY_CONFIGS["mixed_hc4"], "mixed_hc4"), tmp / "ckpt")
    quiet = dict(progress=False, log=lambda *_: None)
    return cfg, {
        "ref_fp8": compile_model(str(tmp / "ckpt"), "reference", tmp / "ref8", kv_cache_dtype="fp8", **quiet),
        "cpu_fp8": compile_model(str(tmp / "ckpt"), "llvm", tmp / "cpu8", kv_cache_dtype="fp8", **quiet),
        "ref_exact": compile_model(str(tmp / "ckpt"), "reference", tmp / "ref", **quiet),
    }


def _run(artifact, prompts, max_new, chunk=None):
    engine = Engine(artifact, prefill_chunk=chunk, max_step_tokens=64)
    rids = [engine.submit(list(p), SamplingParams(max_new_tokens=max_new), record_logits=True) for p in prompts]
    engine.run()
    return engine, [engine.result(r) for r in rids]


def test_fp8_pool_matches_the_reference_on_the_same_pool_format(artifacts):
    cfg, art = artifacts
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, cfg.vocab_size, n) for n in (70, 5, 41)]
    engine, cpu = _run(art["cpu_fp8"], prompts, 24, chunk=17)
    assert engine.pool.geometry.main_storage == "fp8" and engine.pool.geometry.index_storage == "fp8"
    _, ref = _run(art["ref_fp8"], prompts, 24, chunk=17)
    for a, b in zip(ref, cpu):
        assert a.tokens == b.tokens
        assert np.abs(a.logits - b.logits).max() <= TOL


def test_fp8_pool_is_in_effect(artifacts):
    cfg, art = artifacts
    prompt = np.random.default_rng(4).integers(0, cfg.vocab_size, 80)
    _, (low,) = _run(art["cpu_fp8"], [prompt], 8)
    _, (exact,) = _run(art["ref_exact"], [prompt], 8)
    # The prompt is one step, so its window rows come from the step itself in fp32; only
    # compressed entries are read back from the pool, and the first one closes at position 3
    # (CSA ratio 4). Before it the runs agree, from it on FP8 rows change the logits.
    diff = np.abs(low.logits[:80] - exact.logits[:80]).max(axis=1)
    assert (diff[:3] <= 1e-4).all()
    assert (diff[3:] > 1e-4).all()


def test_gpu_targets_use_the_kernel_set_the_cpu_runs():
    """sm90's kernels for every node are exactly those of llvm with an fp8 pool (the GPU build
    binds them to threads), so the executor path tested above is the one a GPU takes."""
    cfg = preset("tiny")
    program = run_pipeline(trace(cfg, "exact"))
    _, cpu = kernel_table(program, plan_for(cfg, "llvm", "exact", "fp8"))
    _, sm90 = kernel_table(program, plan_for(cfg, "sm90"))
    assert cpu == sm90
    assert any("store_main_fp8" in s for roles in sm90 for s in roles.values())
    _, gfx950 = kernel_table(program, plan_for(cfg, "gfx950"))
    assert any("store_rows" in s and "fp4" in s for roles in gfx950 for s in roles.values())


def test_fp8_cache_needs_64_aligned_nope_channels():
    cfg = config_from_dict(PARITY_CONFIGS["odd_ratios_hc2"], "odd")
    with pytest.raises(UsageError, match="groups of 64.*--kv-cache-dtype fp32"):
        plan_for(cfg, "sm90")
    assert plan_for(cfg, "sm90", kv_cache_dtype="fp32").main_kv.storage == "fp32"


def test_inspect_reports_the_chosen_cache_format(capsys):
    assert cli(["inspect", "pro", "--target", "llvm", "--kv-cache-dtype", "fp8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["main_storage"], report["main_row_bytes"], report["index_row_bytes"]) == ("fp8", 584, 132)
    assert cli(["inspect", "pro", "--target", "sm90", "--kv-cache-dtype", "fp32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["main_row_bytes"] == 512 * 4
