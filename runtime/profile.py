"""Time a compiled step by op family (``dsv4c generate --profile``, ``Engine(profile=True)``).

The VM's instrument hook is called before and after every call its functions make; the calls
to kernels (the manifest's ``vm.profile.kernels``) are timed, and each is attributed to the
families of the IR node that emitted it: the compiler records, per entry function, the
families of its kernel calls in the order the VM runs them (``vm.profile.calls``, see
``codegen.relax_step``). A step whose kernel calls do not match that record is refused, not
misattributed. Profiling only observes: the kernels, their inputs and the pool are the same, so
a profiled run generates the same tokens.

Beside the measured times, :func:`predicted` prices the same steps with the cost model
(``token_cost``, imported only here: the runtime itself does not load the compiler) at this
machine's measured read bandwidth and fp32 matmul rate.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dsv4c.artifact.manifest import Manifest
from dsv4c.errors import ArtifactError, UsageError
from dsv4c.runtime import tvm_runtime as rt


@dataclass
class StepTimes:
    function: str
    tokens: int
    context: float  # tokens each token of the step sees, its own included (mean over the step's tokens)
    wall_s: float  # the whole VM call
    families: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # kernel seconds

    @property
    def kernel_s(self) -> float:
        return sum(self.families.values())


def _expand(runs: list[list]) -> list[dict[str, float]]:
    """``vm.profile.calls`` runs, one entry per kernel call."""
    return [{key: 1.0} if isinstance(key, str) else key for key, count in runs for _ in range(count)]


class StepProfiler:
    """Attached to a :class:`~dsv4c.runtime.backend_tvm.TvmBackend`: its VM's instrument and its
    entry functions (wrapped, so that each call is one :class:`StepTimes` in ``steps``)."""

    def __init__(self, backend, manifest: Manifest, artifact: Path):
        vm = manifest.vm
        if vm is None:  # the reference target: no compiled step, interpreted
            raise UsageError(f"{artifact}: profiling times the compiled step's kernels; a {manifest.target} "
                             "artifact has none (compile for llvm or a GPU target)")
        if vm.profile is None:
            raise ArtifactError(f"{artifact}: the manifest has no 'vm.profile' (compiled by an older dsv4c); "
                                "recompile to profile it")
        if vm.cuda_graph:
            raise UsageError(f"{artifact}: its decode steps replay CUDA graphs, whose kernels cannot be timed one by "
                             "one; profile an artifact without CUDA graphs")
        self.kernels = frozenset(vm.profile.kernels)
        self.calls = {name: _expand(runs) for name, runs in vm.profile.calls.items()}
        self.device, self.on_host = backend.device, backend.on_host
        self.steps: list[StepTimes] = []
        self._step: StepTimes | None = None
        self._call, self._start = 0, 0.0
        backend.vm.set_instrument(self._instrument)
        backend.functions = {name: self._timed(name, fn) for name, fn in backend.functions.items()}

    def _sync(self) -> None:
        if not self.on_host:  # GPU kernels run asynchronously: wait for them before reading the clock
            self.device.sync()

    def _instrument(self, _func, symbol: str, before: bool, _ret, *_args) -> int:
        if symbol in self.kernels and self._step is not None:
            self._sync()
            if before:
                self._start = time.perf_counter()
            else:
                elapsed = time.perf_counter() - self._start
                calls = self.calls[self._step.function]
                if self._call < len(calls):
                    for family, share in calls[self._call].items():
                        self._step.families[family] += elapsed * share
                self._call += 1
        return 0  # VMInstrumentReturnKind.NO_OP: run the call

    def _timed(self, name: str, fn):
        def run(*args):
            positions = rt.to_numpy(args[1])  # the step's inputs: tokens, positions, ...
            self._step, self._call = StepTimes(name, len(positions), float(np.mean(positions)) + 1, 0.0), 0
            start = time.perf_counter()
            out = fn(*args)
            self._sync()
            step, self._step = self._step, None
            step.wall_s = time.perf_counter() - start
            if self._call != len(self.calls[name]):
                raise ArtifactError(f"profiling {name}: the VM made {self._call} kernel calls where the manifest "
                                    f"records {len(self.calls[name])}; the artifact's library and manifest disagree")
            self.steps.append(step)
            return out

        return run

    def summary(self, function: str = "decode") -> dict | None:
        """Per step of ``function`` (mean over its profiled steps): wall and kernel ms, kernel ms by
        family; None when none ran."""
        steps = [s for s in self.steps if s.function == function]
        if not steps:
            return None
        n = len(steps)
        families: dict[str, float] = defaultdict(float)
        for s in steps:
            for family, seconds in s.families.items():
                families[family] += 1e3 * seconds / n
        return {"function": function, "steps": n, "tokens": [s.tokens for s in steps],
                "contexts": [s.context for s in steps], "wall_ms": 1e3 * sum(s.wall_s for s in steps) / n,
                "kernel_ms": 1e3 * sum(s.kernel_s for s in steps) / n, "families_ms": dict(families)}


# --------------------------------------------------------------------------- this machine's rates


def stream_sum_kernel(dtype: str, chunks: int = 64, lanes: int = 16):
    """A TVM kernel that sums ``a [chunks, per, lanes]`` (any ``per``) into ``out [chunks, lanes]``:
    a vectorised streaming read, in parallel over the chunks, built for this CPU and run on
    TVM's thread pool (TVM_NUM_THREADS threads, as the decode kernels)."""
    import tvm
    from tvm.script import tirx as T

    from dsv4c.targets import target_info

    @T.prim_func
    def stream_sum(a: T.handle, out: T.Buffer((chunks, lanes), dtype)):
        per = T.int32()
        A = T.match_buffer(a, (chunks, per, lanes), dtype)
        for c in T.parallel(chunks):
            acc = T.alloc_buffer((lanes,), dtype, scope="local")
            for l in T.vectorized(lanes):
                acc[l] = T.Cast(dtype, 0)
            for i in range(per):
                for l in T.vectorized(lanes):
                    acc[l] = acc[l] + A[c, i, l]
            for l in T.vectorized(lanes):
                out[c, l] = acc[l]

    return tvm.compile(tvm.IRModule({"main": stream_sum}), target=target_info("llvm").tvm_target())["main"]


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """GB/s of a streaming read (``stream_sum_kernel``) over ``gib`` GiB of fresh memory, far beyond
    the last-level cache; the best of ``repeats``."""
    import tvm

    from dsv4c.runtime.kv_pool import aligned_empty

    kernel = stream_sum_kernel("float32")
    buf = aligned_empty((64, int(gib * 2**30) // 4 // 64 // 16, 16), np.float32)
    buf[...] = 1.0  # touch every page before timing
    a, out = tvm.runtime.from_dlpack(buf), tvm.runtime.tensor(np.zeros((64, 16), np.float32))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        kernel(a, out)
        times.append(time.perf_counter() - start)
    if float(out.numpy().sum()) != buf.size:
        raise RuntimeError("the streaming read did not read every element")
    return buf.nbytes / min(times) / 1e9


def matmul_rate(a, b, repeats: int = 3) -> float:
    """GFLOP/s of ``a @ b`` (square fp32 matrices of numpy or torch: their BLAS, their threads), the
    best of ``repeats`` after a warm-up: the fp32 rate this machine reaches on dense work."""
    a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * a.shape[0] ** 3 / min(times) / 1e9


def matmul_gflop_s(size: int = 2048, repeats: int = 3) -> float:
    """:func:`matmul_rate` of numpy on size^3."""
    rng = np.random.default_rng(0)
    return matmul_rate(rng.standard_normal((size, size), np.float32), rng.standard_normal((size, size), np.float32),
                       repeats)


# --------------------------------------------------------------------------- prediction and report


def predicted_ms(artifact: Path, config, geometry, summary: dict, read_gb_s: float,
                 gflop_s: float) -> dict[str, float]:
    """The cost model's ms by family for the profiled steps (mean over them; each step a decode of
    its tokens as requests at its mean context), at ``read_gb_s`` and ``gflop_s``."""
    from dsv4c.token_cost import artifact_step_costs, roofline_seconds

    out: dict[str, float] = defaultdict(float)
    for tokens, context in zip(summary["tokens"], summary["contexts"]):
        parts = artifact_step_costs(artifact, config, geometry, tokens, max(1, round(context)))
        for family, seconds in roofline_seconds(parts, read_gb_s * 1e9, gflop_s * 1e9).items():
            out[family] += 1e3 * seconds / summary["steps"]
    return dict(out)


def format_profile(summary: dict, predicted: dict[str, float] | None, read_gb_s: float | None = None,
                   gflop_s: float | None = None) -> list[str]:
    """The table ``dsv4c generate --profile`` prints: measured ms and shares by family beside the
    predicted ones (shares of the kernels' time)."""
    from dsv4c.ir.cost import FAMILIES
    from dsv4c.token_cost import share_text

    contexts = summary["contexts"]
    lines = [f"profile: {summary['steps']} {summary['function']} step(s), context {min(contexts):.0f}-"
             f"{max(contexts):.0f}, {summary['wall_ms']:.2f} ms per step, {summary['kernel_ms']:.2f} ms in kernels",
             f"  {'family':<34} {'measured ms':>11} {'share':>6}" + (f" {'predicted ms':>12} {'share':>6}"
                                                                    if predicted else "")]
    measured = summary["families_ms"]
    predicted_total = sum(predicted.values()) if predicted else 0.0
    for family, title in FAMILIES.items():
        ms, pred = measured.get(family, 0.0), (predicted or {}).get(family, 0.0)
        if ms or pred:
            line = f"  {title:<34} {ms:>11.3f} {share_text(ms, summary['kernel_ms']):>6}"
            if predicted:
                line += f" {pred:>12.3f} {share_text(pred, predicted_total):>6}"
            lines.append(line)
    lines.append(f"  {'outside kernels (VM, host)':<34} {summary['wall_ms'] - summary['kernel_ms']:>11.3f}")
    if predicted:
        lines.append(f"  predicted: each node the longer of its bytes at {read_gb_s:.1f} GB/s (streaming read) and "
                     f"its FLOPs at {gflop_s:.1f} GFLOP/s (numpy fp32 matmul), measured now")
    return lines


def report_lines(engine) -> list[str]:
    """What ``dsv4c generate --profile`` prints: each entry function's profile, and for ``decode``
    on a CPU artifact the cost model's prediction at this machine's rates, measured now."""
    lines = []
    for function in dict.fromkeys(s.function for s in engine.profiler.steps):
        summary = engine.profiler.summary(function)
        predicted = read_gb_s = gflop_s = None
        if function == "decode" and engine.backend.on_host:
            read_gb_s, gflop_s = read_bandwidth(gib=0.5), matmul_gflop_s()
            predicted = predicted_ms(engine.path, engine.config, engine.pool.geometry, summary, read_gb_s,
                                     gflop_s)
        lines += format_profile(summary, predicted, read_gb_s, gflop_s)
    return lines or ["profile: no step ran"]
