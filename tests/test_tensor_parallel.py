"""Tensor parallel on the CPU: ``compile --tensor-parallel 2`` runs as two processes joined by gloo
(runtime/tensor_parallel/) and computes what one device computes: the same greedy tokens,
logits within 1e-5 (the all-reduces add the ranks' partial sums in another order): V4's parity
configs, and DeepSeek-V4.1 traced without its fake-quant round trips (with them, see
``without_fake_quant``; at TP 2 V4.1's parity case matches the reference's logits and greedy
tokens, whole and in prefill chunks). A dead rank ends generation with one line, quickly, and
leaves no process behind."""

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import dsv4c
from dsv4c.compile import compile_model
from dsv4c.errors import ShardingError
from dsv4c.runtime.engine import Engine
from dsv4c.runtime.sampling import SamplingParams

# At TP 2 the V4.1 case's logits and greedy tokens are held to the reference; its ragged batches,
# prefix-cache hits, preemption and speculation run on tensor parallelism's V4-generic paths, which
# the tests below check for V4 (and test_v41_in_the_release_s_storage_splits_in_two for V4.1's
# ragged chunked batches): held to the reference on one device by test_v41_compiled.py.
from v41_case import compile_case
from v41_case import test_logits_and_greedy_tokens_match_the_reference  # noqa: F401  (run here at TP 2)

TOLERANCE = 1e-5
# The parity configs whose heads, output groups, experts and expert width split in two.
SPLIT_IN_TWO = ("mixed_hc4", "official_hc2", "csa_only_hc4")


def _compile_tp2(ckpt: Path, out: Path, expert_parallel: bool = True) -> Path:
    return compile_model(str(ckpt), "llvm", out, progress=False, log=lambda *_: None, tensor_parallel=2,
                         expert_parallel=expert_parallel)


def _run(engine: Engine, prompts: list[list[int]], new_tokens: list[int]):
    """Every prompt submitted at once (one ragged batch), run to the end: tokens and logits."""
    ids = [engine.submit(p, SamplingParams(max_new_tokens=n), record_logits=True) for p, n in zip(prompts, new_tokens)]
    engine.run()
    return [engine.result(i) for i in ids]


def _assert_same(got, expected) -> None:
    for g, e in zip(got, expected, strict=True):
        assert g.tokens == e.tokens
        assert g.logits.shape == e.logits.shape
        np.testing.assert_allclose(g.logits, e.logits, rtol=0, atol=TOLERANCE)


def test_two_ranks_compute_what_one_device_does(parity_artifacts, tmp_path):
    """On every parity config that splits in two: one long prompt (past the window and the
    compressed windows), then a ragged batch of 8 with chunked prefill. A config that does not
    split (3 heads) is refused at compile time in one line, before anything is written."""
    cfg, ckpt, _ref, one_device = parity_artifacts
    if cfg.name not in SPLIT_IN_TWO:
        with pytest.raises(ShardingError, match="num_attention_heads = 3 is not a multiple of 2"):
            _compile_tp2(ckpt, tmp_path / "tp2")
        assert not (tmp_path / "tp2").exists()
        return
    two = _compile_tp2(ckpt, tmp_path / "tp2")
    rng = np.random.default_rng(len(cfg.name))
    long = [rng.integers(0, cfg.vocab_size, 70).tolist()]
    ragged = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (1, 5, 9, 17, 23, 31, 40, 47)]
    new = [3, 8, 5, 1, 7, 4, 6, 2]
    options = {"max_requests": 8, "max_context": 512, "prefill_chunk": 7, "max_step_tokens": 48}
    with Engine(two, **options) as split:
        got_long, got_ragged = _run(split, long, [16]), _run(split, ragged, new)
        if cfg.name == "mixed_hc4":
            _speculation_and_prefix_cache(split, one_device, cfg, rng)
    if cfg.name == "mixed_hc4":  # every expert's intermediate dim split (--no-expert-parallel) too
        with Engine(_compile_tp2(ckpt, tmp_path / "split_experts", expert_parallel=False), **options) as split:
            got_ep = _run(split, ragged, new)
    with Engine(one_device, **options) as whole:
        _assert_same(got_long, _run(whole, long, [16]))
        _assert_same(got_ragged, _run(whole, ragged, new))
        if cfg.name == "mixed_hc4":
            _assert_same(got_ep, _run(whole, ragged, new))


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    """DeepSeek-V4.1's parity case at --tensor-parallel 2 (its heads, output groups, experts and
    expert width split in two; the compressors, indexers, candidate blocks, mHC and Engram are
    replicated), for the tests imported from tests/v41_case.py."""
    return compile_case(tmp_path_factory.mktemp("v41_tp2"), "llvm", "--tensor-parallel", "2")


@pytest.fixture
def without_fake_quant(monkeypatch):
    """V4.1 traced without its fake-quant round trips (``ModelConfig.activation_fake_quant``, a
    research config's switch) while a test compiles. With them, the ranks' partial sums, added in
    another order than one device's, put a value within a rounding error of a midpoint on the
    other side now and then (docs/tensor_parallel.md, "DeepSeek-V4.1"), and the logits differ
    from there on by up to 1e-2; without them they agree within 1e-5 as V4's do."""
    from dsv4c.artifact import model_config

    monkeypatch.setitem(model_config.V41_NUMERICS, "activation_fake_quant", False)


def _v41_same_on_two_ranks(two: Path, one: Path, vocab: int) -> None:
    """A V4.1 artifact at TP 2 against one device: a long prompt (past the window, through ratio-2
    and ratio-1 groups and the candidate blocks), then a ragged batch in prefill chunks; every
    rank's step takes the Engram rows rank 0 hashed."""
    rng = np.random.default_rng(0)
    long = [rng.integers(3, vocab, 70).tolist()]
    ragged = [rng.integers(3, vocab, n).tolist() for n in (1, 5, 9, 17, 23, 31, 40, 47)]
    new = [3, 8, 5, 1, 7, 4, 6, 2]
    options = {"max_requests": 8, "max_context": 512, "prefill_chunk": 7, "max_step_tokens": 48}
    with Engine(two, **options) as split:
        got_long, got_ragged = _run(split, long, [16]), _run(split, ragged, new)
    with Engine(one, **options) as whole:
        _assert_same(got_long, _run(whole, long, [16]))
        _assert_same(got_ragged, _run(whole, ragged, new))


def test_v41_in_the_release_s_storage_splits_in_two(without_fake_quant, tmp_path):
    """V4.1's structure at TP 2 (v41-tiny is the parity case's shape: shared compressors of ratio 2
    and 1, re-index and reuse layers, candidate blocks, Engram, the delayed mHC collapse) against
    one device. v41-tiny (shared expert widened to 64, so that its FP8 columns split between 32-column blocks)
    stored as the release stores V4.1: FP8 32 x 32 dense weights cut by rows and by columns, FP4
    experts whole, the FP8 Engram tables and their scales replicated."""
    from dsv4c.frontend.byte_tokenizer import write_byte_tokenizer
    from dsv4c.frontend.checkpoint_writer import write_checkpoint
    from dsv4c.frontend.config import config_from_dict, preset, with_weights
    from dsv4c.frontend.random_model import random_weights

    fields = {**preset("v41-tiny").to_json_dict("hf"), "moe_intermediate_size": 64}
    cfg = with_weights(config_from_dict(fields, "v41-fp8"), dense="fp8", experts="fp4", fp8_block=32)
    model = write_checkpoint(cfg, random_weights(cfg, seed=1), tmp_path / "model")
    write_byte_tokenizer(model, cfg.vocab_size)  # make-tiny's: the one v41-tiny's Engram ids are sized for
    one = compile_model(str(model), "llvm", tmp_path / "tp1", progress=False, log=lambda *_: None)
    _v41_same_on_two_ranks(_compile_tp2(model, tmp_path / "tp2"), one, cfg.vocab_size)


def test_a_call_s_model_inputs_reach_the_other_ranks_as_they_are():
    """What rank 0 passes on of a call beyond the common step inputs (V4.1's Engram inputs):
    positional and keyword arrays of any dtype and shape, and None, decode as they were."""
    from dsv4c.runtime.tensor_parallel.messages import pack_inputs, unpack_inputs

    rows = np.arange(24, dtype=np.int32).reshape(2, 3, 4)
    table = np.linspace(0, 1, 10, dtype=np.float32).reshape(5, 2)
    codes = np.arange(6, dtype=np.uint8)
    inputs, named = unpack_inputs(pack_inputs((rows, None), {"table": table, "codes": codes, "none": None}))
    assert len(inputs) == 2 and inputs[1] is None and set(named) == {"table", "codes", "none"}
    for got, want in ((inputs[0], rows), (named["table"], table), (named["codes"], codes)):
        assert got.dtype == want.dtype and np.array_equal(got, want)
    assert named["none"] is None
    assert unpack_inputs(pack_inputs((), {})) == ([], {}) and pack_inputs((), {}) == b""


def _speculation_and_prefix_cache(split: Engine, one_device: Path, cfg, rng) -> None:
    """The pool changes rank 0 makes outside the step reach the other rank (runtime.tensor_parallel
    PoolJournal): a cached prefix's slot copy and the restored rows of rejected drafts. Wrong rows
    on rank 1 would change its partial sums, so the tokens would differ from one device's."""
    shared = rng.integers(0, cfg.vocab_size, 300).tolist()  # one whole 256-token block to cache
    prompts = [shared + [5, 6, 7], shared + [9]]
    params = SamplingParams(max_new_tokens=10)
    cached = [split.generate(p, params).tokens for p in prompts]
    assert split.prefix_cache.hit_tokens >= 256
    with Engine(split.path, speculative="mtp", num_draft_tokens=2, max_context=512) as spec_split, \
            Engine(one_device, speculative="mtp", num_draft_tokens=2, max_context=512) as spec_whole:
        prompt = rng.integers(0, cfg.vocab_size, 40).tolist()
        a, b = spec_split.generate(prompt, SamplingParams(max_new_tokens=24)), \
            spec_whole.generate(prompt, SamplingParams(max_new_tokens=24))
        assert a.tokens == b.tokens and a.speculative == b.speculative
        assert a.speculative["draft_tokens"] > a.speculative["accepted_tokens"]  # some drafts were put back
    with Engine(one_device, max_context=512) as whole:
        assert cached == [whole.generate(p, params).tokens for p in prompts]


def test_the_pool_journal_makes_another_pool_the_same():
    """What rank 0 changes outside the step (a new request's slot cleared, a cached slot copied,
    drafted rows put back: fp32 and fp8 rows, -inf ring scores) replays on a copy of its pool."""
    from dsv4c.artifact.pool import PoolGeometry
    from dsv4c.frontend.config import preset
    from dsv4c.passes.quant_plan import plan_for
    from dsv4c.runtime.kv_pool import KVPool
    from dsv4c.runtime.tensor_parallel.messages import PoolJournal, apply_journal

    cfg = preset("tiny")
    for kv in ("fp32", "fp8"):
        g = PoolGeometry.build(cfg, plan_for(cfg, "llvm", kv_cache_dtype=kv))
        pools = [KVPool(g, 8 * g.rows_per_envelope + 6 * g.window_rows_per_request) for _ in range(2)]
        rng = np.random.default_rng(0)
        for name, a in pools[0].tensors.items():
            a[...] = rng.integers(0, 200, a.shape) if a.dtype.kind == "u" else rng.standard_normal(a.shape)
            pools[1].tensors[name][...] = a
        source, pools[0].journal = pools[0], PoolJournal(pools[0])
        source.admit(0, reserve_tokens=300)
        saved = source.save(source.position_state(0, [257, 258]))
        for array, index in source.position_state(0, [257, 258]):
            array[index] = 0  # a step overwrote them
            pools[1].tensors[next(n for n, t in source.tensors.items() if t is array)][index] = 0
        source.restore(saved)
        source.admit(1, reserve_tokens=10)
        source.copy_slot(source.requests[0].slot, source.requests[1].slot, at_block_boundary=True)
        apply_journal(pools[1], source.journal.take())
        assert source.journal.take() == b""
        for name, a in source.tensors.items():
            np.testing.assert_array_equal(pools[1].tensors[name], a, err_msg=f"{kv} {name}")


class _Work:
    """A collective's work that completes after ``polls`` calls of is_completed (never: None)."""

    def __init__(self, polls):
        self.polls, self.asked, self.waited_done = polls, 0, None

    def is_completed(self) -> bool:
        self.asked += 1
        return self.polls is not None and self.asked >= self.polls

    def wait(self) -> None:
        self.waited_done = self.polls is not None and self.asked >= self.polls


def test_a_cpu_rank_polls_its_collectives_before_sleeping_in_the_wait():
    """A rank keeps its core while the other ranks catch up (a VM halts an idle vCPU, and the
    message ending the wait must wake it first: bench/tensor_parallel.py); an idle rank polls
    only briefly."""
    from dsv4c.runtime.tensor_parallel.collectives import poll_then_wait

    work = _Work(polls=50)
    poll_then_wait(work, 10.0)
    assert work.waited_done and work.asked == 50  # polled until done, then wait() returned at once
    work = _Work(polls=50)
    poll_then_wait(work, 0.0)
    assert work.waited_done is False and work.asked == 0  # a GPU rank: straight to the wait
    work, start = _Work(polls=None), time.monotonic()
    poll_then_wait(work, 0.05)
    assert 0.05 <= time.monotonic() - start < 2 and work.asked > 1 and work.waited_done is False


def _dsv4c(*args: str, launcher: tuple[str, ...] = ()) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(dsv4c.__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, *launcher, "-m", "dsv4c", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, text=True)


def _ranks_of(pid: int) -> list[int]:
    """The rank processes a generate process started (its children running a rank)."""
    out = subprocess.run(["pgrep", "-P", str(pid), "-f", "dsv4c.runtime.tensor_parallel"], capture_output=True,
                         text=True).stdout
    return [int(p) for p in out.split()]


@pytest.fixture(scope="module")
def tp2(serve_artifacts_tp2):
    """The tiny model (BF16 weights) at --tensor-parallel 2, with a tokenizer: generate --prompt
    streams text, so the tests below see decoding start."""
    return serve_artifacts_tp2 / "cpu"


def _generating(*args: str) -> tuple[subprocess.Popen, list[int]]:
    """``dsv4c generate`` started and its rank processes, once it has streamed its first text."""
    proc = _dsv4c("generate", *args, "--max-new-tokens", "20000")
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    assert ready and proc.stdout.read(1), proc.stderr.read()
    ranks = _ranks_of(proc.pid)
    assert len(ranks) == 1
    return proc, ranks


def test_a_dead_rank_ends_generate_in_one_line_and_leaves_nothing_behind(tp2):
    """SIGKILL of rank 1 mid-generation: generate exits non-zero with one line naming the rank,
    well within the 90 s the collective timeout allows, and no rank process is left."""
    proc, ranks = _generating(str(tp2), "--prompt", "w10 w20 w30")
    killed = time.monotonic()
    os.kill(ranks[0], signal.SIGKILL)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 2 and time.monotonic() - killed < 90
    assert err == f"dsv4c: error: tensor-parallel rank 1 (pid {ranks[0]}) died (killed by SIGKILL) while running " \
                  "a step\n"
    assert not _ranks_of(proc.pid)


def test_rank_0_stopped_by_a_signal_takes_its_ranks_with_it(tp2):
    """SIGTERM ends rank 0 without Python's exit handlers; its ranks die with it (PR_SET_PDEATHSIG)."""
    proc, ranks = _generating(str(tp2), "--prompt", "w40 w41")
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
              for pid in ranks):
        assert time.monotonic() < deadline, f"rank processes {ranks} outlived rank 0"
        time.sleep(0.1)


def test_generate_checks_the_rank_count(tp2, capsys):
    from dsv4c.cli import main as cli

    assert cli(["generate", str(tp2), "--token-ids", "1,2", "--max-new-tokens", "2", "-tp", "4"]) == 2
    err = capsys.readouterr().err
    assert err == f"dsv4c: error: --tensor-parallel 4: {tp2} is compiled for 2 rank(s); run it with " \
                  "--tensor-parallel 2, or compile it again with --tensor-parallel 4\n"


def test_torchrun_runs_every_rank_from_one_command_line(tp2, capsys):
    """``torchrun --nproc-per-node 2 -m dsv4c generate ...``: rank 0 runs the engine, rank 1 its
    share of each step; the tokens are those rank 0 gets with the ranks it starts itself, and
    every rank exits 0 (rank 0 tells rank 1 to stop)."""
    from dsv4c.cli import main as cli

    args = ["generate", str(tp2), "--token-ids", "7,8,9,10", "--max-new-tokens", "8"]
    assert cli(args) == 0
    expected = capsys.readouterr().out
    proc = _dsv4c(*args, launcher=("-m", "torch.distributed.run", "--nproc-per-node", "2"))
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    assert out == expected and len(expected.split()) == 8


def test_idle_ranks_wait_and_a_hung_rank_times_out(tp2):
    """Between calls the ranks wait as long as the engine is idle (a server between requests),
    not the collective timeout; inside a step a rank that stops answering (SIGSTOP) is given up
    on after --distributed-timeout, in one line."""
    from dsv4c.runtime.tensor_parallel.collectives import TensorParallelError

    params = SamplingParams(max_new_tokens=4)
    with Engine(tp2, max_context=256, distributed_timeout=1.0) as engine:
        first = engine.generate([5, 6, 7], params).tokens
        time.sleep(2.5)
        assert engine.generate([5, 6, 7], params).tokens == first
        (rank,) = engine.backend.ranks.procs.values()
        rank.send_signal(signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="running a step failed on rank 0: .*[Tt]imed out") as e:
            engine.generate([5, 6, 7], params)
        assert time.monotonic() - start < 30 and "\n" not in str(e.value)
        assert rank.poll() is not None  # killed: a stopped rank cannot be told to stop
