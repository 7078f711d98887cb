"""Device check for the sm90 target (run by `scripts/device_check` on a machine with an H200).

1. Builds the sm90 artifacts of the tiny model and of the flash slice (bench/flash_slice.py's
   config with random FP8 / FP4 weights; nvcc >= 12.0 on PATH or under $CUDA_HOME) and says
   what device code each holds: a fatbin of sm_90a machine code.
2. When a CUDA GPU of that architecture is present: runs the tensor-core GEMMs
   (``kernels.gpu_matmul``: prefill GEMMs, grouped and not, and the expert GEMM, FP8 / FP4 /
   BF16) on the GPU against the same kernels built for the CPU with the MMA emulated on its
   fragment layout (same float16 operands: only the float32 summation order differs, so a
   wrong lane layout or weight decode shows as an O(1) error), and decode's GEMVs
   (``kernels.gpu_gemv``) likewise against their phases run in turn on the CPU; then runs both artifacts on the GPU through the
   engine and compares their logits and greedy tokens with the reference backend (the IR
   interpreter in numpy) on a KV pool of the same format (FP8 rows); checks that speculative
   decoding with the MTP layer (tiny has one; the pool rows of rejected drafts put back by the artifact's
   pool functions on the device, decode steps replaying CUDA graphs) gives plain greedy's
   tokens, and so does DSpark's block drafter (``tiny-dspark``: tiny with 2 DSpark stages, block
   4), whose ``dspark_draft`` / ``dspark_markov`` outputs are also compared with the reference
   backend's after the same prompt; ``v41-tiny`` (DeepSeek-V4.1 stored as the release: FP8
   Engram tables gathered on the host each step, an fp32 pool) runs the same parity check; then prints prefill and decode timings of the GPU artifact, and what fraction of the
   GPU's memory bandwidth a decode token's weight reads reach; with ``--profile``, decode's kernel
   time by op family (a copy of the artifact without CUDA graphs).

On a host CPU with AMX-BF16 (GPU hosts often have one; the build machines do not), the bf16
GEMM's AMX tiles run against the model of TDPBF16PS (tests/test_amx_matmul.py's tile cases).

Without such a GPU it says so and stops after step 1 (and the AMX check). Budget: under 8 minutes on an H200 host.
``--target llvm`` runs the same checks on this CPU (artifacts with the same FP8 pool format; the
GEMMs emulated with sm90's fragment layout against the MFMA's), which is how the script itself
is tested where no GPU is.

    scripts/device_check [--target sm90|llvm] [--models tiny tiny-dspark v41-tiny flash-slice] [--prompt-tokens 256]
                         [--decode-steps 16] [--keep DIR] [--profile]
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
import tempfile
import time
import traceback
from importlib import resources
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

# Whole model, |logit error| / max(1, max |logit|): fp32 kernels on both sides (llvm: only the
# summation order differs). A GPU's prefill and expert GEMMs round their operands to float16
# (kernels.gpu_matmul: ~2**-11 relative per product, ~5e-4 of a GEMM's output scale); through
# the layers that may pass 1e-3, so GPUs get 1e-2, an estimate to revisit with a measured one.
PARITY_BOUND = {"llvm": 1e-3, "sm90": 1e-2}
GEMM_BOUND = 1e-5  # a tensor-core GEMM vs its CPU emulation: float32 summation order only
# Bytes per second a decode step's weight reads are measured against (H200: HBM3e, 4.8 TB/s).
PEAK_BANDWIDTH = {"sm90": 4.8e12}
# (kind, out, in, format, groups or experts): shapes of two row tiles and two column tiles; every
# format on both kernels (the FP4 decode's sign was wrong in CUDA C, right on the CPU).
GEMM_CASES = [("linear", 128, 512, "fp8_b128", 0), ("linear", 128, 256, "bf16", 2), ("linear", 128, 256, "fp4_g32", 0),
              ("expert_linear", 128, 256, "fp4_g32", 4), ("expert_linear", 128, 512, "fp8_b128", 4),
              ("expert_linear", 128, 256, "bf16", 4)]
EXPERT_ROWS = [3, 0, 70, 9]  # rows per expert: none, part of a tile, more than one
# Decode's GEMVs (kernels.gpu_gemv), the same shapes: 3 rows (linear), experts of 0-2 rows.
GEMV_CASES = [(kind, out, inp, quant, groups) for kind, out, inp, quant, groups in GEMM_CASES]
GEMV_EXPERT_ROWS = [1, 0, 2, 1]
# tiny plus a DSpark drafter: 2 stages tapping layers 2 and 3, blocks of 4 (its CSA layers make
# rejected drafts cross ratio-4 compression boundaries).
TINY_DSPARK = {"num_nextn_predict_layers": 2, "dspark_block_size": 4, "dspark_target_layer_ids": [2, 3],
               "dspark_markov_rank": 16, "dspark_noise_token_id": 511}
MODELS = ("tiny", "tiny-dspark", "v41-tiny", "flash-slice")
# DeepSeek-V4.1's pool keeps its own round-tripped rows in fp32 on every target (docs/v41.md).
KV_CACHE_DTYPE = {"v41-tiny": "auto"}


def _compile(model: Path, target: str, out: Path) -> float:
    """An artifact with an FP8 pool (the GPU default; explicit so llvm matches it), V4.1's fp32."""
    from dsv4c.compile import compile_model

    start = time.perf_counter()
    compile_model(str(model), target, out, progress=False, log=lambda *_: None,
                  kv_cache_dtype=KV_CACHE_DTYPE.get(model.name, "fp8"))
    return time.perf_counter() - start


def build(work: Path, target: str, models: list[str]) -> None:
    """The checkpoints (random weights) and the target's artifacts."""
    from flash_slice import FLASH_SLICE

    from dsv4c.frontend.byte_tokenizer import write_byte_tokenizer
    from dsv4c.frontend.checkpoint_writer import write_checkpoint
    from dsv4c.frontend.random_model import random_weights
    from dsv4c.frontend.config import config_from_dict, preset, with_weights

    tiny = json.loads(resources.files("dsv4c.frontend").joinpath("presets/tiny.json").read_text())
    configs = {"tiny": preset("tiny"), "tiny-dspark": config_from_dict({**tiny, **TINY_DSPARK}, "tiny-dspark"),
               # stored as the release stores V4.1: FP8 32 x 32 dense, FP4 experts, FP8 Engram tables
               "v41-tiny": with_weights(preset("v41-tiny"), dense="fp8", experts="fp4", fp8_block=32),
               "flash-slice": config_from_dict(FLASH_SLICE, "flash-slice")}
    for label in models:
        start = time.perf_counter()
        write_checkpoint(configs[label], random_weights(configs[label], 0), work / label)
        if configs[label].engram is not None:  # Engram's hash needs the tokenizer make-tiny writes
            write_byte_tokenizer(work / label, configs[label].vocab_size)
        seconds = _compile(work / label, target, work / f"{label}-{target}")
        note = ""
        if target == "sm90":
            from dsv4c.artifact.device_code import device_modules
            from dsv4c.artifact.manifest import read_manifest

            library = read_manifest(work / f"{label}-sm90").vm.library
            (_, module), = device_modules(work / f"{label}-sm90" / library)
            note = f"; device code: {module.fmt} of {len(module.functions)} kernels (nvcc, sm_90a)"
        print(f"{label}: checkpoint in {time.perf_counter() - start - seconds:.1f} s, {target} artifact in "
              f"{seconds:.1f} s{note}")


def _weight_parts(rng, quant: str, out_dim: int, in_dim: int, lead: tuple) -> list[np.ndarray]:
    """Random stored parts of a weight (finite values: BF16 from normal floats, E8M0 scales near 1)."""
    from dsv4c.codegen.kernels.formats import tir_format

    parts = []
    for shape, dtype in tir_format(quant).parts(out_dim, in_dim):
        shape = lead + shape
        if dtype == "float32":
            parts.append(rng.uniform(0.5, 2, shape).astype(np.float32) if parts else
                         rng.standard_normal(shape).astype(np.float32))
        elif dtype == "uint16":
            parts.append((rng.standard_normal(shape).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16))
        elif dtype == "int32":
            parts.append(rng.integers(-2**31, 2**31, shape, dtype=np.int64).astype(np.int32))
        else:  # FP8 codes (0x7F / 0xFF decode as +-480), or FP4 groups' E8M0 scales
            parts.append(rng.integers(120, 134, shape, dtype=np.uint8) if parts else
                         rng.integers(0, 256, shape, dtype=np.uint8))
    return parts


def _operands(rng, kind: str, out_dim: int, in_dim: int, quant: str, groups: int, rows: int, expert_rows: list[int]):
    """Random inputs of a ``kind`` kernel (x, [offsets,] weight parts, y)."""
    if kind == "linear":
        lead = (groups,) if groups else ()
        return [rng.standard_normal(lead + (rows, in_dim)).astype(np.float32),
                *_weight_parts(rng, quant, out_dim, in_dim, lead)]
    offsets = np.concatenate([[0], np.cumsum(expert_rows)]).astype(np.int32)
    return [rng.standard_normal((offsets[-1], in_dim)).astype(np.float32), offsets,
            *_weight_parts(rng, quant, out_dim, in_dim, (groups,))]


def _compare(target: str, label: str, device_func, cpu_func, inputs: list[np.ndarray], out_shape: tuple) -> bool:
    """``device_func`` on the target's device (llvm: the CPU) against ``cpu_func`` on the CPU,
    the same inputs: max |difference| / max |y| within GEMM_BOUND."""
    import tvm

    from dsv4c.targets import target_info

    device = tvm.cpu() if target == "llvm" else target_info(target).device()
    outputs = []
    for func, tvm_target, dev in ((device_func, target_info(target).tvm_target(), device),
                                  (cpu_func, target_info("llvm").tvm_target(), tvm.cpu())):
        kernel = tvm.compile(tvm.IRModule({"main": func}), target=tvm_target)["main"]
        tensors = [tvm.runtime.tensor(a, device=dev) for a in inputs + [np.zeros(out_shape, np.float32)]]
        kernel(*tensors)
        outputs.append(tensors[-1].numpy())
    err = float(np.abs(outputs[0] - outputs[1]).max() / max(np.abs(outputs[1]).max(), 1e-30))
    good = err <= GEMM_BOUND
    print(f"{label}: max |{target} - cpu emulation| / max |y| = {err:.1e} -> {'PASS' if good else 'FAIL'}")
    return good


def gemm_kernels(target: str) -> bool:
    """Each GEMM_CASES kernel on ``target``'s tensor cores (llvm: emulated with sm90's layout)
    against its CPU emulation (the MFMA's layout on llvm), on the same random operands."""
    from dsv4c.codegen.kernels import gpu_matmul as gm
    from dsv4c.targets import target_info

    if target == "llvm":
        layout, reference_layout = gm.CUDA_LAYOUT, gm.ROCM_LAYOUT
    else:
        layout = reference_layout = gm.target_layout(target_info(target).tvm_target())
    rng = np.random.default_rng(3)
    ok = True
    for kind, out_dim, in_dim, quant, groups in GEMM_CASES:
        inputs = _operands(rng, kind, out_dim, in_dim, quant, groups, 9 * 8, EXPERT_ROWS)
        if kind == "linear":
            lead = (groups,) if groups else ()
            inputs[0] = inputs[0].reshape(lead + (9, 8, in_dim))
            out_shape = (9, 8) + lead + (out_dim,)
            make = functools.partial(gm.mma_linear, out_dim, in_dim, quant, groups)
        else:
            out_shape = (len(inputs[0]), out_dim)
            make = functools.partial(gm.mma_expert_linear, out_dim, in_dim, quant, groups)
        ok &= _compare(target, f"{kind} {out_dim}x{in_dim} {quant} ({groups})",
                       make(layout, emulate=target == "llvm"), make(reference_layout, emulate=True), inputs, out_shape)
    return ok


def gemv_kernels(target: str) -> bool:
    """Each GEMV_CASES decode GEMV on ``target`` (llvm: its phases emulated) against its CPU
    emulation, on the same random operands."""
    from dsv4c.codegen.kernels import gpu_gemv

    rng = np.random.default_rng(5)
    ok = True
    for kind, out_dim, in_dim, quant, groups in GEMV_CASES:
        inputs = _operands(rng, kind, out_dim, in_dim, quant, groups, 3, GEMV_EXPERT_ROWS)
        if kind == "linear":
            if groups:
                inputs[0] = np.ascontiguousarray(inputs[0].transpose(1, 0, 2))  # x [N, G, I]
            out_shape = inputs[0].shape[:-1] + (out_dim,)
            make = functools.partial(gpu_gemv.linear_gemv, out_dim, in_dim, quant, groups)
        else:
            out_shape = (len(inputs[0]), out_dim)
            make = functools.partial(gpu_gemv.expert_gemv, out_dim, in_dim, quant, groups)
        ok &= _compare(target, f"{kind} gemv {out_dim}x{in_dim} {quant} ({groups})", make(emulate=target == "llvm"),
                       make(emulate=True), inputs, out_shape)
    return ok


def _greedy(artifact: Path, prompt: list[int], steps: int):
    from dsv4c.runtime.engine import Engine
    from dsv4c.runtime.sampling import SamplingParams

    engine = Engine(artifact, max_step_tokens=len(prompt), max_requests=1, max_context=len(prompt) + steps + 1)
    return engine.generate(prompt, SamplingParams(max_new_tokens=steps), record_logits=True)


def parity(work: Path, target: str, label: str, steps: int) -> bool:
    """The target's artifact vs the reference backend on the same FP8 pool format, same prompt."""
    from dsv4c.artifact.directory import open_artifact

    vocab = open_artifact(work / f"{label}-{target}").config.vocab_size
    prompt = np.random.default_rng(1).integers(0, vocab, 40).tolist()
    reference = work / f"{label}-reference"
    _compile(work / label, "reference", reference)  # the same weights as fp32, the same pool format
    ours = _greedy(work / f"{label}-{target}", prompt, steps)
    ref = _greedy(reference, prompt, steps)
    shutil.rmtree(reference)
    err = float(np.abs(ours.logits - ref.logits).max())
    scale = float(np.abs(ref.logits).max())
    same = ours.tokens == ref.tokens
    ok = err <= PARITY_BOUND[target] * max(1.0, scale) and same
    print(f"{label}: prompt 40 + {steps} greedy tokens: max |{target} - reference| logit = {err:.2e} "
          f"(max |logit| {scale:.1f}), same tokens: {same} -> {'PASS' if ok else 'FAIL'}")
    return ok


def _drafter(work: Path, target: str, label: str) -> str | None:
    """The speculative method the artifact's drafter runs: mtp, dspark or None."""
    from dsv4c.artifact.manifest import read_manifest

    functions = read_manifest(work / f"{label}-{target}").vm.functions
    return "dspark" if "dspark_draft_decode" in functions else "mtp" if "mtp0_decode" in functions else None


def speculation(work: Path, target: str, label: str, steps: int) -> bool:
    """Greedy decoding with the artifact's drafter (2 MTP drafts, or DSpark's block) against plain
    greedy on the target's artifact: the same tokens, whatever the drafts (rejected ones' pool rows
    are put back)."""
    from dsv4c.artifact.directory import open_artifact
    from dsv4c.runtime.engine import Engine
    from dsv4c.runtime.sampling import SamplingParams

    artifact = work / f"{label}-{target}"
    method = _drafter(work, target, label)
    vocab = open_artifact(artifact).config.vocab_size
    prompt = np.random.default_rng(4).integers(0, vocab, 40).tolist()
    outs = [Engine(artifact, max_requests=1, max_context=len(prompt) + steps + 8, speculative=speculative,
                   num_draft_tokens=2 if speculative == "mtp" else None).generate(
                       prompt, SamplingParams(max_new_tokens=steps)).tokens
            for speculative in (None, method)]
    ok = outs[0] == outs[1]
    print(f"{label}: {steps} greedy tokens with {method} drafts equal plain greedy's: {ok} -> {'PASS' if ok else 'FAIL'}")
    return ok


def _block_outputs(artifact: Path, prompt: list[int]) -> list[np.ndarray]:
    """DSpark's outputs for a block after ``prompt``: base logits, then per row its Markov bias and
    confidence logit (each row's previous token: the anchor, then the base logits' argmax). The
    prompt goes in steps of decode's width, whose GEMVs compute in fp32 on every target (prefill's
    GEMMs round operands to fp16 on GPUs), so that the comparison isolates the drafter's kernels."""
    from dsv4c.codegen.relax_step import GEMV_MAX_ROWS
    from dsv4c.runtime.engine import Engine

    engine = Engine(artifact, max_step_tokens=len(prompt), max_requests=1, max_context=len(prompt) + 16)
    backend, n, dspark = engine.backend, len(prompt), engine.config.dspark
    engine.pool.admit(0, n + dspark.block_size)
    for start in range(0, n, GEMV_MAX_ROWS):
        chunk = prompt[start:start + GEMV_MAX_ROWS]
        backend.step(np.array(chunk, np.int32), np.arange(start, start + len(chunk), dtype=np.int32),
                     np.zeros(len(chunk), np.int32), np.array([len(chunk) - 1], np.int32))
    b = dspark.block_size
    base = backend.dspark_draft(np.array(prompt[-1:] + [dspark.noise_token_id] * (b - 1), np.int32),
                                np.arange(n - 1, n - 1 + b, dtype=np.int32), np.zeros(b, np.int32))
    prev = np.array([prompt[-1]] + [int(t) for t in base[:-1].argmax(axis=1)], np.int32)
    bias, confidence = backend.dspark_markov(prev, np.arange(b, dtype=np.int32))
    return [base, bias, confidence]


def drafter_parity(work: Path, target: str, label: str) -> bool:
    """DSpark's compiled drafter on the target vs the reference backend after the same prompt (a
    block of at most decode's width: fp32 GEMVs, so the GEMM bound of fp32 summation order holds)."""
    from dsv4c.artifact.directory import open_artifact

    vocab = open_artifact(work / f"{label}-{target}").config.vocab_size
    prompt = np.random.default_rng(5).integers(0, vocab, 30).tolist()
    reference = work / f"{label}-reference"
    _compile(work / label, "reference", reference)
    ours, ref = _block_outputs(work / f"{label}-{target}", prompt), _block_outputs(reference, prompt)
    shutil.rmtree(reference)
    errors = [float(np.abs(a - b).max()) / max(1.0, float(np.abs(b).max())) for a, b in zip(ours, ref)]
    ok = max(errors) <= GEMM_BOUND
    print(f"{label}: DSpark block after 30 tokens, relative max |{target} - reference|: base logits {errors[0]:.2e}, "
          f"Markov bias {errors[1]:.2e}, confidence {errors[2]:.2e} -> {'PASS' if ok else 'FAIL'}")
    return ok


def timings(work: Path, target: str, label: str, prompt_tokens: int, steps: int) -> None:
    from dsv4c.runtime.engine import Engine

    engine = Engine(work / f"{label}-{target}", max_step_tokens=prompt_tokens, max_requests=1,
                    max_context=prompt_tokens + steps + 1)
    last_row = np.array([0], np.int32)  # decode reads back one row of logits, as the engine does
    backend, pool = engine.backend, engine.pool
    tokens = np.random.default_rng(2).integers(0, engine.config.vocab_size, prompt_tokens).astype(np.int32)

    fed: dict[int, list[int]] = {}  # each sequence's tokens by position, for V4.1's Engram rows

    def forward(seq: int, start: int, toks: np.ndarray) -> None:
        pool.ensure(seq, start + len(toks))
        fed[seq] = fed.get(seq, [])[:start] + toks.tolist()
        rows = None if engine.engram is None else \
            engine.engram.request_rows(fed[seq], start, start + len(toks)).astype(np.int32)
        backend.step(toks, np.arange(start, start + len(toks), dtype=np.int32), np.full(len(toks), seq, np.int32),
                     last_row + len(toks) - 1, engram_rows=rows)

    pool.admit(0)
    forward(0, 0, tokens[:16])  # warm-up: loads every kernel once
    pool.free(0)
    pool.admit(1)
    start = time.perf_counter()
    forward(1, 0, tokens)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(steps):
        forward(1, prompt_tokens + i, tokens[i:i + 1])
    decode = (time.perf_counter() - start) / steps
    from flash_slice import decode_weight_bytes

    rate = decode_weight_bytes(work / f"{label}-{target}")["total"] / decode
    share = f", {rate / PEAK_BANDWIDTH[target]:.1%} of the GPU's {PEAK_BANDWIDTH[target] / 1e12:.1f} TB/s" \
        if target in PEAK_BANDWIDTH else ""
    print(f"{label}: prefill {prompt_tokens} tokens {prefill:.3f} s ({prompt_tokens / prefill:,.0f} tok/s); "
          f"decode at {prompt_tokens} context {decode * 1e3:.2f} ms/token, weights read at {rate / 1e9:.1f} GB/s"
          f"{share}")


def profile(work: Path, target: str, label: str, prompt_tokens: int, steps: int) -> None:
    """Decode's kernel time by op family (``dsv4c generate --profile``) on the target. A GPU's
    decode replays CUDA graphs, whose kernels cannot be timed one by one, so a GPU profile runs
    a copy of the artifact compiled without them (the same kernels, launched one at a time)."""
    from unittest import mock

    from dsv4c.runtime.engine import Engine
    from dsv4c.runtime.profile import report_lines
    from dsv4c.runtime.sampling import SamplingParams

    artifact = work / f"{label}-{target}"
    if target != "llvm":
        artifact = work / f"{label}-{target}-no-graphs"
        if not artifact.exists():
            with mock.patch("dsv4c.codegen.build.replays_cuda_graphs", lambda *_: False):
                _compile(work / label, target, artifact)
    engine = Engine(artifact, max_step_tokens=prompt_tokens, max_requests=1, max_context=prompt_tokens + steps + 1,
                    profile=True)
    prompt = np.random.default_rng(6).integers(0, engine.config.vocab_size, prompt_tokens).tolist()
    engine.generate(prompt, SamplingParams(max_new_tokens=steps))
    print(f"{label}: profile of prefill {prompt_tokens} tokens and {steps} decode steps on {target}")
    for line in report_lines(engine):
        print(line)


def host_amx() -> bool:
    """The bf16 GEMM's AMX tiles on this host's CPU, where it has AMX-BF16 (GPU hosts often do;
    the build machines do not): tests/test_amx_matmul.py's cases that run the tiles, against the
    TDPBF16PS model bit for bit and the exact sums."""
    import subprocess

    from dsv4c.targets import host_cpu_flags

    host = host_cpu_flags()
    if host is None or "amx_bf16" not in host.flags:
        print(f"host CPU ({host.model if host else 'unknown'}): no AMX-BF16, the AMX kernels stay checked by "
              "tests/test_amx_matmul.py's model")
        return True
    tests = Path(__file__).resolve().parents[1] / "tests" / "test_amx_matmul.py"
    run = subprocess.run([sys.executable, "-m", "pytest", str(tests), "-q", "-p", "no:cacheprovider", "-k",
                          "tiles_of_this_cpu"], capture_output=True, text=True, timeout=600)
    print(f"host CPU ({host.model}), AMX tiles: {run.stdout.strip().splitlines()[-1]}")
    return run.returncode == 0


def _checked(name: str, check, *args) -> bool:
    """Run one check; an exception fails that check alone (the GPU run is one try: every other
    check still reports), with its traceback for the record."""
    start = time.perf_counter()
    try:
        return check(*args) is not False
    except Exception as error:  # noqa: BLE001 - reported, and the run fails
        traceback.print_exc()
        print(f"{name}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''} -> FAIL")
        return False
    finally:
        print(f"{name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=("sm90", "llvm"), default="sm90")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--keep", help="build in this directory and keep it")
    parser.add_argument("--profile", action="store_true", help="also time decode's kernels by op family")
    args = parser.parse_args(argv)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="dsv4c-device-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        build(work, args.target, args.models)
        amx = _checked("host AMX tiles", host_amx)
        if args.target == "sm90":
            from dsv4c.targets import target_info

            device = target_info("sm90").device()
            if device is None:
                print("no sm_90 CUDA GPU on this machine: built and checked the artifacts only")
                return 0 if amx else 1
            print(f"GPU: {device.device_name}")
        drafters = {label: _drafter(work, args.target, label) for label in args.models}
        drafting = [label for label in args.models if drafters[label]]
        checks = [("gemm kernels", gemm_kernels, (args.target,)), ("gemv kernels", gemv_kernels, (args.target,))]
        checks += [(f"{label}: parity", parity, (work, args.target, label, 8)) for label in args.models]
        checks += [(f"{label}: drafter parity", drafter_parity, (work, args.target, label)) for label in drafting
                   if drafters[label] == "dspark"]
        checks += [(f"{label}: speculation", speculation, (work, args.target, label, 8)) for label in drafting]
        checks += [(f"{label}: timings", timings, (work, args.target, label, args.prompt_tokens, args.decode_steps))
                   for label in args.models]
        if args.profile:
            checks += [(f"{label}: profile", profile, (work, args.target, label, args.prompt_tokens, args.decode_steps))
                       for label in args.models]
        results = [_checked(name, check, *check_args) for name, check, check_args in checks]
        return 0 if amx and all(results) else 1
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
