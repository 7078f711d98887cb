"""Benchmark: the compiled CPU artifact vs transformers eager fp32 on a "flash slice".

Flash widths (hidden 4096, 64 heads x 512, q_lora 1024, o_groups 8, index 64 x 128,
top-k 512), 2 layers (HCA + CSA), 16 experts top-6, vocab 32000. Our artifact keeps the
checkpoint's FP8 / FP4 weights and decodes them inside the kernels; transformers runs the
same (dequantized) weights in fp32. Each system runs in its own child process with the same
thread count, so peak RSS is per system, and serves one short untimed request before the timed
ones; our engine holds its weights as its default ``weights="auto"`` does (read into memory
where they fit, see ``runtime.weights``). The script prints ratios (ours / transformers),
which is what to compare on a noisy shared machine.

It also prints what bounds decode: the weight bytes one decode token reads (from the
artifact: every tensor the step takes in full, except the embedding's one row and the routed
experts' top-k share), the GB/s decode achieves on them, and this machine's read bandwidth
measured in the same run by a streaming-sum kernel that TVM builds for this CPU (the decode
kernels' compiler and thread pool), with one thread and with the bench's threads; the
fraction compares decode with the latter. The machine's bandwidth also drifts within seconds,
so our process then runs as many decode steps again, each between two reads of the weights a
token reads in full (the same pages), and compares each step with the reads around it.
Likewise what bounds prefill: the matmul FLOPs of a
prefill token (from the artifact's weight shapes; attention, the head and the small kernels not
counted), the GFLOP/s each system achieves on them, and this machine's fp32 matmul peak
measured in the same run (torch's BLAS on 4096^3, the kernels transformers runs on).
A shared machine's speed drifts by tens of percent over minutes, so everything runs ``--rounds``
times (default 2), the systems alternating, and each figure keeps its best. ``--json PATH``
writes all of it.

``--cpu NAME`` builds the artifact for another x86 CPU level (e.g. x86-64-v3, any AVX2
machine). An artifact without AVX-512 on an AVX-512 host is measured as on an AVX2-only
machine (``--baseline-isa``, default ``auto``): transformers and the matmul peak then run with
AVX2 at most (ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA), so that
neither system uses instructions the other lacks. The memory system stays this machine's.

    python bench/flash_slice.py [--contexts 2048 8192] [--prefill 2048] [--decode-steps 8] [--rounds 2]
                                [--cpu x86-64-v3] [--baseline-isa auto|host|avx2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

FLASH_SLICE = {
    "model_type": "deepseek_v4", "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 2,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
    "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "n_routed_experts": 16, "n_shared_experts": 1,
    "num_experts_per_tok": 6, "moe_intermediate_size": 2048, "routed_scaling_factor": 1.5,
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "sliding_window": 128, "hc_mult": 4,
    "num_hash_layers": 0, "num_nextn_predict_layers": 0, "compress_ratios": [128, 4],
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                            "weight_block_size": [128, 128]},
    "expert_dtype": "fp4",
}


# The checkpoint's copies at other precisions, by stage: the folder each is written to in the
# workdir (``bf16`` is bf16_prefill.py's artifact there).
CHECKPOINT_COPIES = {"fp32": "fp32", "bf16": "bf16-checkpoint"}


class _Dequantized(dict):
    """The FP8 / FP4 checkpoint's tensors as fp32, read one at a time (never all in memory)."""

    def __init__(self, cfg, path):
        from dsv4c.frontend.checkpoint import Checkpoint
        from dsv4c.frontend.tensor_inventory import inventory

        super().__init__({spec.name: spec for spec in inventory(cfg)})
        self.checkpoint = Checkpoint(path)
        self.n_experts = cfg.n_routed_experts

    def __getitem__(self, name):
        return self.checkpoint.read(dict.__getitem__(self, name), self.n_experts)


# What limits torch (its ATen kernels, MKL, oneDNN) to AVX2, as on a machine without AVX-512.
AVX2_BASELINE_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def baseline_isa(choice: str, artifact_features: list[str], host_flags) -> str:
    """The instructions the baseline may use: ``host`` (all this machine has) or ``avx2``;
    ``auto`` takes avx2 where the artifact's kernels have no AVX-512 and this machine does."""
    if choice != "auto":
        return choice
    host_avx512 = host_flags is not None and "avx512f" in host_flags
    return "avx2" if host_avx512 and "avx512f" not in artifact_features else "host"


def prepare(workdir: Path, stage: str, cpu: str | None = None) -> None:
    """One stage per child process, so that no process holds two copies of 1.4 G parameters:
    make the FP8 / FP4 checkpoint, write the same values as fp32 for transformers or as BF16
    (safetensors, official names) for vLLM (``bf16_prefill.py --vllm``), compile (for ``cpu``,
    default this machine's)."""
    from dsv4c.frontend.checkpoint_writer import write_checkpoint
    from dsv4c.frontend.random_model import random_weights
    from dsv4c.frontend.config import config_from_dict, with_weights

    cfg = config_from_dict(FLASH_SLICE, "flash-slice")
    if stage == "make":
        write_checkpoint(cfg, random_weights(cfg, 0), workdir / "fp8")
    elif stage in CHECKPOINT_COPIES:
        out = write_checkpoint(with_weights(cfg, dense=stage, experts=stage), _Dequantized(cfg, workdir / "fp8"),
                               workdir / CHECKPOINT_COPIES[stage])
        if stage == "bf16":  # vLLM gives the gate its bias only with the released configs' routing field
            config = json.loads((out / "config.json").read_text())
            (out / "config.json").write_text(json.dumps({**config, "topk_method": "noaux_tc"}, indent=2))
    else:
        from dsv4c.compile import compile_model

        start = time.perf_counter()
        compile_model(str(workdir / "fp8"), "llvm", workdir / "artifact", progress=False, cpu=cpu)
        print(f"compile: {time.perf_counter() - start:.1f} s", file=sys.stderr)


def _step_weights(artifact: Path, rank: int = 0):
    """(name, array, part, share) of every tensor the compiled step takes (the manifest's
    ``vm.params``, constants included; memory-mapped, only headers are read): ``share`` is the
    fraction a token reads, 1 except for the embedding and hash-routing tables (one row) and
    the routed experts' stacked tensors (``num_experts_per_tok`` of ``n_routed_experts``; a rank
    of a ``--tensor-parallel`` artifact holds a share of every expert, or with ``--expert-parallel``
    a share of the experts, and reads that share of the token's on average). The MTP layer's own weights (which only its draft function reads) are part
    ``mtp``. Of a multi-rank artifact, rank ``rank``'s."""
    from dsv4c.artifact.directory import open_artifact
    from dsv4c.artifact.safetensors_io import SafetensorsFile
    from dsv4c.runtime.weights import open_weights

    opened = open_artifact(artifact)
    manifest, cfg, vm = opened.manifest, opened.config, opened.manifest.vm
    tensors = dict(open_weights(artifact, manifest, rank=rank))
    with SafetensorsFile(artifact / vm.constants) as st:
        tensors.update((name, st.read_raw(name)) for name in st.names())
    for name in vm.params:
        a = tensors[name]
        part = _param_part(name)
        if part == "routed_experts":
            ranks = manifest.tensor_parallel if manifest.expert_parallel else 1
            assert a.shape[0] == cfg.n_routed_experts // ranks, (name, a.shape)
            share = cfg.n_experts_per_tok / cfg.n_routed_experts
        else:
            share = 1 / a.shape[0] if part == "embedding_rows" else 1.0
        yield name, a, "mtp" if name.startswith("mtp.") else part, share


def _param_part(name: str) -> str:
    """The part of step parameter ``name`` (the MTP layer's apart): a token reads the routed
    experts' top-k share of ``routed_experts``, one row of ``embedding_rows`` (the embedding,
    hash-routing tables), all of ``head`` and ``dense``."""
    if ".ffn.experts." in name:
        return "routed_experts"
    if name == "embed.weight" or name.endswith(".tid2eid"):
        return "embedding_rows"
    return "head" if name.startswith("head.") else "dense"


def decode_weight_bytes(artifact: Path, rank: int = 0) -> dict[str, float]:
    """Bytes of weights one decode token reads (on rank ``rank``), by part (``_step_weights``); KV
    pool reads, which grow with context, are not weights and not counted. ``mtp`` is outside ``total``."""
    parts = dict.fromkeys(("dense", "head", "routed_experts", "embedding_rows", "mtp"), 0.0)
    for _, a, part, share in _step_weights(artifact, rank):
        parts[part] += a.nbytes * share
    return {"total": sum(v for k, v in parts.items() if k != "mtp"), **parts}


def prefill_matmul_flops(artifact: Path) -> float:
    """FLOPs per prefill token of the step's matmuls: 2 per weight a token multiplies, over the
    matmul weights (stored as column tiles, ``kernels.formats.TirFormat.parts``: 3 or more dims,
    scales apart; FP4 holds two weights per byte) of the dense layers and the routed
    experts' top-k share. The head (prefill takes logits of one row), attention and the
    mHC / norm kernels are not counted: a lower bound of the work."""
    from dsv4c.artifact.manifest import read_manifest

    fp4_experts = read_manifest(artifact).quant_plan["weights"]["expert"]["storage"] == "fp4"
    flops = 0.0
    for name, a, part, share in _step_weights(artifact):
        if part in ("dense", "routed_experts") and a.ndim >= 3 and not name.endswith(".scale"):
            flops += 2 * share * (2 * a.nbytes if part == "routed_experts" and fp4_experts else a.size)
    return flops


def matmul_peak(threads: int, size: int = 4096, repeats: int = 3) -> float:
    """GFLOP/s of torch's fp32 matmul (its BLAS) on size^3 with ``threads`` threads, the best of
    ``repeats`` after one warm-up: this machine's practical fp32 FMA peak."""
    import torch

    from dsv4c.runtime.profile import matmul_rate

    torch.set_num_threads(threads)
    return matmul_rate(torch.randn(size, size), torch.randn(size, size), repeats)


def weight_read_probe(params, skip: set[int]):
    """A callable giving the GB/s of one streaming read (``runtime.profile.stream_sum_kernel``, int32 words) over the
    step's own weights, ``params`` (the backend's tensors, read or mapped as its weights mode
    says) except those at the indices ``skip`` (what a token reads only part of, the routed
    experts and embedding rows, and the MTP layer's): the same pages the decode step reads, and
    no new memory. Each tensor is read whole
    except a tail under 4 KiB."""
    import tvm

    from dsv4c.runtime.profile import stream_sum_kernel

    kernel = stream_sum_kernel("int32")
    out = tvm.runtime.tensor(np.zeros((64, 16), np.int32))
    views = []
    for i, tensor in enumerate(params):
        if i in skip:
            continue
        raw = np.from_dlpack(tensor).reshape(-1).view(np.uint8)
        words = raw[:raw.nbytes // 4096 * 4096].view(np.int32).reshape(64, -1, 16)
        if words.size:
            views.append(tvm.runtime.from_dlpack(words.__dlpack__(max_version=(1, 0))))
    nbytes = sum(4 * v.shape[0] * v.shape[1] * v.shape[2] for v in views)

    def probe() -> float:
        start = time.perf_counter()
        for v in views:
            kernel(v, out)
        return nbytes / (time.perf_counter() - start) / 1e9

    return probe


def run_system(system: str, workdir: Path, prefill: int, contexts: list[int], steps: int, threads: int) -> dict:
    rng = np.random.default_rng(0)
    out: dict = {}
    if system == "dsv4c":
        from dsv4c.runtime.engine import Engine

        engine = Engine(workdir / "artifact", max_step_tokens=2048,
                        max_context=max(contexts + [prefill]) + steps + 256, max_requests=1)
        backend = engine.backend

        def forward(tokens, start, seq):
            # The last position's logits only, as transformers below (logits_to_keep=1).
            engine.pool.ensure(seq, start + len(tokens))
            return backend.step(np.asarray(tokens, np.int32), np.arange(start, start + len(tokens), dtype=np.int32),
                                np.full(len(tokens), seq, np.int32), np.array([len(tokens) - 1], np.int32))

        def new_request(seq):
            engine.pool.admit(seq)

        def end_request(seq):
            engine.pool.free(seq)

        # Read probes beside the decode steps: the machine's bandwidth drifts within seconds.
        params = engine.manifest.vm.params
        probe = weight_read_probe(backend.params, {i for i, name in enumerate(params)
                                                   if _param_part(name) not in ("head", "dense") or name.startswith("mtp.")})
        weight_bytes = decode_weight_bytes(workdir / "artifact")["total"]
    else:
        import torch
        from transformers import DeepseekV4ForCausalLM, DynamicCache

        torch.set_num_threads(threads)
        model = DeepseekV4ForCausalLM.from_pretrained(workdir / "fp32", dtype=torch.float32).eval()
        caches = {}

        def new_request(seq):
            caches[seq] = DynamicCache(config=model.config)

        def end_request(seq):
            caches.pop(seq)

        def forward(tokens, start, seq):
            with torch.no_grad():
                ids = torch.tensor(np.asarray(tokens)[None])
                return model(ids, past_key_values=caches[seq], use_cache=True, logits_to_keep=1).logits[0].numpy()

    def prefill_to(seq, n):
        # Chunks of 2048 keep transformers' indexer scores ([S, H, E] floats) within memory.
        for start in range(0, n, 2048):
            forward(rng.integers(0, 32000, min(2048, n - start)), start, seq)

    # A short request first, untimed: mapped weights (a weights mode our engine may choose) page
    # in as kernels first read them; time both systems warm.
    new_request(0)
    prefill_to(0, 16)
    end_request(0)
    new_request(0)
    start = time.perf_counter()
    prefill_to(0, prefill)
    out["prefill_tok_s"] = prefill / (time.perf_counter() - start)
    end_request(0)
    for i, ctx in enumerate(contexts, start=1):
        new_request(i)
        prefill_to(i, ctx)
        times = []
        for s in range(steps):
            t = time.perf_counter()
            forward([int(rng.integers(0, 32000))], ctx + s, i)
            times.append(time.perf_counter() - t)
        out[f"decode_ms_at_{ctx}"] = float(np.median(times) * 1e3)
        if system == "dsv4c":
            out.setdefault("beside_read", {})[str(ctx)] = decode_beside_read(
                lambda s, ctx=ctx, i=i: forward([int(rng.integers(0, 32000))], ctx + steps + s, i), steps, probe,
                weight_bytes)
        end_request(i)
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def decode_beside_read(step, steps: int, probe, weight_bytes: float) -> dict:
    """``steps`` more decode steps (``step(s)``), each between two runs of ``probe`` (a read of
    the step's own weights, ``weight_read_probe``), so that each step meets the bandwidth the
    machine gives around it. The probe reads the weights in the step's order, so what it leaves
    in the last-level cache is what the step reads last, long evicted by then. Medians over the
    steps: the probe's GB/s (each step's is the mean of the reads either side), decode's GB/s of
    weights, and ``share``, decode's GB/s over its own probe's."""
    probe()
    before = probe()
    reads, times, shares = [], [], []
    for s in range(steps):
        start = time.perf_counter()
        step(s)
        times.append(time.perf_counter() - start)
        after = probe()
        reads.append((before + after) / 2)
        shares.append(weight_bytes / times[-1] / 1e9 / reads[-1])
        before = after
    return {"read_gb_s": float(np.median(reads)), "decode_gb_s": weight_bytes / float(np.median(times)) / 1e9,
            "share": float(np.median(shares))}


def best(figures: list[dict]) -> dict:
    """Each figure's best over the rounds: the lowest ms, otherwise the highest (tok/s, GB/s,
    GFLOP/s; peak RSS, the highest, is memory a round needed, not noise)."""
    return {key: (min if key.startswith("decode_ms") else max)(f[key] for f in figures) for key in figures[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--prefill", type=int, default=2048)
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--workdir", type=Path)
    p.add_argument("--rounds", type=int, default=2,
                   help="run every measurement this many times, the systems alternating, and keep each figure's best")
    p.add_argument("--cpu", help="build the artifact for this LLVM CPU name (default: this machine's), e.g. x86-64-v3")
    p.add_argument("--baseline-isa", choices=["auto", "host", "avx2"], default="auto",
                   help="instructions transformers and the matmul peak may use (auto: avx2 when the artifact "
                        "has no AVX-512 and this machine has)")
    p.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    p.add_argument("--system", choices=["dsv4c", "transformers", "bandwidth", "matmul"], help=argparse.SUPPRESS)
    p.add_argument("--stage", choices=["make", "fp32", "bf16", "compile"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, not {args.rounds}")
    if args.stage:
        prepare(args.workdir, args.stage, args.cpu)
        return
    if args.system == "bandwidth":  # child process, with TVM_NUM_THREADS set
        from dsv4c.runtime.profile import read_bandwidth

        print(json.dumps({"read_gb_s": read_bandwidth()}))
        return
    if args.system == "matmul":  # child process
        print(json.dumps({"gflop_s": matmul_peak(args.threads)}))
        return
    if args.system:  # child process
        print(json.dumps(run_system(args.system, args.workdir, args.prefill, args.contexts, args.decode_steps,
                                    args.threads)))
        return
    from dsv4c.artifact.manifest import read_manifest
    from dsv4c.errors import UsageError
    from dsv4c.targets import checked_cpu_name, host_cpu, host_cpu_flags

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="dsv4c-bench-"))
    artifact = workdir / "artifact"
    try:
        wanted_cpu = host_cpu() if args.cpu in (None, "native") else checked_cpu_name(args.cpu)
    except UsageError as e:
        sys.exit(f"error: {e}")
    if artifact.exists():
        built_for = read_manifest(artifact).kernels.mcpu
        if built_for != wanted_cpu:
            sys.exit(f"error: {artifact} was built for {built_for}, not {wanted_cpu}: "
                     "remove it or use another --workdir")
    for stage, done in (("make", "fp8"), ("fp32", "fp32"), ("compile", "artifact")):
        if not (workdir / done).exists():
            subprocess.run([sys.executable, __file__, "--stage", stage, "--workdir", str(workdir)]
                           + (["--cpu", args.cpu] if args.cpu else []), check=True)
    manifest = read_manifest(artifact)
    host = host_cpu_flags()
    isa = baseline_isa(args.baseline_isa, manifest.kernels.cpu_features, host.flags if host else None)

    def child(system: str, threads: int) -> dict:
        cmd = [sys.executable, __file__, "--system", system, "--workdir", str(workdir), "--prefill", str(args.prefill),
               "--decode-steps", str(args.decode_steps), "--threads", str(threads), "--contexts",
               *map(str, args.contexts)]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TVM_NUM_THREADS": str(threads),
               **(AVX2_BASELINE_ENV if isa == "avx2" and system in ("transformers", "matmul") else {})}
        done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
        return json.loads(done.stdout.strip().splitlines()[-1])

    report = {"cpu": {"model": host.model if host else None, "llvm_cpu": host_cpu(),
                      "artifact_cpu": manifest.kernels.mcpu, "baseline_isa": isa}, "threads": args.threads}
    # Rounds: a shared machine's speed drifts over minutes, so each system (and each baseline
    # measurement) runs once a round, in alternating order, and every figure keeps its best.
    # Each thread count's bandwidth in its own process (TVM sizes its pool once), alone.
    measurements = {system: (lambda system=system: child(system, args.threads)) for system in ("dsv4c", "transformers")}
    measurements.update((f"read_gb_s_{t}", lambda t=t: child("bandwidth", t)) for t in dict.fromkeys((1, args.threads)))
    measurements["matmul"] = lambda: child("matmul", args.threads)
    runs: dict[str, list[dict]] = {name: [] for name in measurements}
    for r in range(args.rounds):
        for name in list(measurements)[::1 if r % 2 == 0 else -1]:
            runs[name].append(measurements[name]())
    report["rounds"] = args.rounds
    beside_read = [figures.pop("beside_read") for figures in runs["dsv4c"]]
    report.update((system, best(runs[system])) for system in ("dsv4c", "transformers"))
    report["read_gb_s"] = {str(t): best(runs[f"read_gb_s_{t}"])["read_gb_s"] for t in dict.fromkeys((1, args.threads))}
    report["matmul_peak_gflop_s"] = best(runs["matmul"])["gflop_s"]
    ours, ref = report["dsv4c"], report["transformers"]
    cpu = report["cpu"]
    print(f"flash slice on {cpu['model']} (LLVM {cpu['llvm_cpu']}; artifact built for {cpu['artifact_cpu']}), "
          f"{args.threads} threads, best of {args.rounds} alternating round(s) "
          "(ratios: higher is better for tok/s, lower for ms and MiB)")
    if isa == "avx2":
        print("transformers and the matmul peak ran with AVX2 at most ("
              + ", ".join(f"{k}={v}" for k, v in AVX2_BASELINE_ENV.items()) + "), as on an AVX2-only machine")
    print(f"{'metric':<22}{'dsv4c':>12}{'transformers':>14}{'ratio':>9}")
    report["ratios"] = {}
    for key in ours:
        better = report["ratios"][key] = ours[key] / ref[key] if key.endswith("tok_s") else ref[key] / ours[key]
        print(f"{key:<22}{ours[key]:>12.1f}{ref[key]:>14.1f}{better:>8.2f}x")
    # What bounds decode: bytes of weights each token reads against the measured read bandwidth.
    weights = report["decode_weight_bytes"] = decode_weight_bytes(artifact)
    on_disk = sum((artifact / f).stat().st_size for f in manifest.weight_files())
    print(f"weights a decode token reads: {weights['total'] / 1e9:.3f} GB (dense {weights['dense'] / 1e9:.3f}, head "
          f"{weights['head'] / 1e9:.3f}, routed experts' top-k share {weights['routed_experts'] / 1e9:.3f}, embedding "
          f"rows {weights['embedding_rows'] / 1e3:.1f} KB) of {on_disk / 1e9:.2f} GB on disk")
    bandwidth = report["read_gb_s"][str(args.threads)]
    print("read bandwidth (TVM streaming sum over 1 GiB, best of 5): "
          + ", ".join(f"{gb_s:.1f} GB/s with {t} thread(s)" for t, gb_s in report["read_gb_s"].items()))
    report["decode_gb_s"], report["decode_fraction_of_read"] = {}, {}
    for ctx in args.contexts:
        gb_s = report["decode_gb_s"][str(ctx)] = weights["total"] / (ours[f"decode_ms_at_{ctx}"] / 1e3) / 1e9
        fraction = report["decode_fraction_of_read"][str(ctx)] = gb_s / bandwidth
        print(f"decode at {ctx}: {gb_s:.2f} GB/s of weights = {fraction:.1%} of the {args.threads}-thread read bandwidth")
    # The same, each decode step beside a read of its own weights (the best round's medians;
    # every round's in the JSON).
    report["decode_beside_read"], report["decode_beside_read_rounds"] = {}, beside_read
    for ctx in map(str, args.contexts):
        pair = report["decode_beside_read"][ctx] = max((r[ctx] for r in beside_read), key=lambda r: r["share"])
        print(f"decode at {ctx}, each step between two reads of the dense and head weights: {pair['decode_gb_s']:.2f} "
              f"GB/s of weights = {pair['share']:.1%} of the {pair['read_gb_s']:.1f} GB/s those reads reach "
              f"(medians of {args.decode_steps} steps; rounds: "
              + ", ".join(f"{r[ctx]['share']:.1%} of {r[ctx]['read_gb_s']:.1f}" for r in beside_read) + ")")
    # What bounds prefill: its matmul FLOPs against the machine's fp32 matmul peak.
    flops = report["prefill_matmul_gflop_per_token"] = prefill_matmul_flops(artifact) / 1e9
    peak = report["matmul_peak_gflop_s"]
    print(f"prefill matmuls: {flops:.3f} GFLOP per token (attention, head and small kernels not counted); fp32 "
          f"matmul peak (torch 4096^3, {args.threads} threads, best of 3): {peak:.1f} GFLOP/s")
    report["prefill_fraction_of_peak"] = {}
    for system, figures in (("dsv4c", ours), ("transformers", ref)):
        gflop_s = figures["prefill_tok_s"] * flops
        fraction = report["prefill_fraction_of_peak"][system] = gflop_s / peak
        print(f"prefill {system}: {gflop_s:.1f} GFLOP/s of matmuls = {fraction:.1%} of that peak")
    print(f"prefill at 2x transformers would need {2 * report['prefill_fraction_of_peak']['transformers']:.1%} of it")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
