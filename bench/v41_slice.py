"""Benchmark: DeepSeek-V4.1 decode on a slice at the released widths, beside the V4 flash slice.

The V4.1 slice (``V41_SLICE``) has v41-flash's widths (hidden 5120, 64 heads x 512, q_lora
1280, o_groups 8 x 1024, index 32 x 128, top-k 512, hc 4, FP8 32 x 32 dense weights, FP4
experts) with the experts cut to 16 top-6 of width 2304 and the vocabulary to 32000, and four
layers, one of each kind the release has: a ratio-2 KV source (index keys, top-k), a layer
that reuses its rows and top-k, a ratio-1 KV source that is also the candidate source, and an
Engram layer whose table is ``--engram-rows`` rows of 256 FP8 columns (default 8.4 M: 2.15 GB,
with its E8M0 scales). The V4 flash slice is ``flash_slice.py``'s, built in the same workdir.

Per slice, in one run, rounds alternating (a shared machine drifts): decode steps at each
context, each between two reads of the weights a decode token reads in full
(``flash_slice.decode_beside_read``: decode's GB/s of weights over the GB/s those reads reach,
the target >= 75%), and the machine's read bandwidth (``flash_slice``'s streaming-sum child).
Then, for the V4.1 slice: a profile of its decode step by op family (``Engine(profile=True)``)
with the Engram tables' pages warm and cold: before each cold step the tables' pages are
dropped from this process's mappings and from the page cache (``drop_pages``: madvise
MADV_DONTNEED, then posix_fadvise DONTNEED). The tables are those of the manifest's
``engram.tables`` (files of their own, mapped by default).

    python bench/v41_slice.py [--contexts 2048 8192] [--decode-steps 8] [--rounds 2]
                              [--engram-rows 8400000] [--workdir DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from dsv4c.artifact.file_names import MANIFEST

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flash_slice import best, decode_beside_read, decode_weight_bytes, _param_part, weight_read_probe  # noqa: E402

V41_SLICE = {
    "model_type": "deepseek_v41_text", "vocab_size": 32000, "hidden_size": 5120, "num_hidden_layers": 4,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
    "q_lora_rank": 1280, "o_groups": 8, "o_lora_rank": 1024, "n_routed_experts": 16, "n_shared_experts": 1,
    "num_experts_per_tok": 6, "moe_intermediate_size": 2304, "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus", "gate_temp": 1.0, "swiglu_limit": 10.0, "index_n_heads": 32,
    "index_head_dim": 128, "index_topk": 512, "sliding_window": 128, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-06, "rms_norm_eps": 1e-20, "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 65536},
    "max_position_embeddings": 1048576, "compress_ratios": [2, 2, 1, 0], "kv_source_layer_ids": [0, 2],
    "index_source_layer_ids": [0, 2], "candidate_source_layer_id": 2, "candidate_topk_blocks": 2048,
    "candidate_block_size": 8, "engram_layer_ids": [3], "engram_max_ngram_size": 4, "engram_n_heads": 8,
    "engram_head_dim": 256, "engram_pad_id": 2, "num_nextn_predict_layers": 0, "bos_token_id": 0,
    "eos_token_id": 1, "tie_word_embeddings": False,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                            "weight_block_size": [32, 32]},
}
SLICES = ("v4", "v41")
MADV_DONTNEED = 4


def v41_config(table_rows: int, tokenizer_dir: Path):
    """The V4.1 slice's config with an Engram table of at least ``table_rows`` rows: its hash
    primes (n-gram sizes x heads of them, the first above engram_vocab_size - 1) sum to the
    table's rows, and the byte-level tokenizer in ``tokenizer_dir`` gives its compressed vocabulary."""
    from dsv4c.frontend.config import config_from_dict, with_weights
    from dsv4c.frontend.engram import compressed_token_map, hash_primes

    raw = dict(V41_SLICE)
    primes_per_layer = (raw["engram_max_ngram_size"] - 1) * raw["engram_n_heads"]
    vocab = math.ceil(table_rows / primes_per_layer)
    raw["engram_vocab_size"] = vocab
    raw["engram_num_embeddings"] = [int(hash_primes(1, vocab, raw["engram_max_ngram_size"],
                                                    raw["engram_n_heads"]).sum())]
    raw["engram_compressed_vocab_size"] = compressed_token_map(tokenizer_dir)[1]
    return with_weights(config_from_dict(raw, "v41-slice"), dense="fp8", experts="fp4", fp8_block=32)


def prepare(workdir: Path, stage: str, table_rows: int) -> None:
    """One stage per child process: the V4.1 slice's FP8 / FP4 checkpoint (with its byte-level
    tokenizer), or its compile."""
    model = workdir / "v41-fp8"
    if stage == "make":
        from dsv4c.frontend.byte_tokenizer import write_byte_tokenizer
        from dsv4c.frontend.checkpoint_writer import write_checkpoint
        from dsv4c.frontend.random_model import iter_random_weights

        with tempfile.TemporaryDirectory() as tokenizer_dir:
            write_byte_tokenizer(tokenizer_dir, V41_SLICE["vocab_size"])
            cfg = v41_config(table_rows, Path(tokenizer_dir))
        write_checkpoint(cfg, iter_random_weights(cfg, 0), model)
        write_byte_tokenizer(model, cfg.vocab_size)
    else:
        from dsv4c.compile import compile_model

        start = time.perf_counter()
        compile_model(str(model), "llvm", workdir / "v41-artifact", progress=False)
        print(f"compile: {time.perf_counter() - start:.1f} s", file=sys.stderr)


def artifact_of(workdir: Path, name: str) -> Path:
    return workdir / ("v4" if name == "v4" else "") / ("artifact" if name == "v4" else "v41-artifact")


class Slice:
    """An engine over one slice's artifact and one request at a time, fed random tokens (the
    Engram rows hashed from the request's tokens as the engine hashes them)."""

    def __init__(self, artifact: Path, max_context: int, **engine_args):
        from dsv4c.runtime.engine import Engine

        self.engine = Engine(artifact, max_step_tokens=2048, max_context=max_context, max_requests=1, **engine_args)
        self.rng = np.random.default_rng(0)
        self.tokens: list[int] = []

    def forward(self, tokens) -> None:
        engine, start = self.engine, len(self.tokens)
        self.tokens += [int(t) for t in tokens]
        engine.pool.ensure(0, len(self.tokens))
        rows = None if engine.engram is None else engine.engram.request_rows(self.tokens, start, len(self.tokens))
        engine.backend.step(np.asarray(tokens, np.int32), np.arange(start, len(self.tokens), dtype=np.int32),
                            np.zeros(len(tokens), np.int32), np.array([len(tokens) - 1], np.int32),
                            engram_rows=None if rows is None else rows.astype(np.int32))

    def new_request(self, context: int) -> None:
        if self.tokens:
            self.engine.pool.free(0)
        self.tokens = []
        self.engine.pool.admit(0)
        for start in range(0, context, 2048):
            self.forward(self.rng.integers(3, 32000, min(2048, context - start)))

    def decode(self) -> float:
        start = time.perf_counter()
        self.forward([int(self.rng.integers(3, 32000))])
        return time.perf_counter() - start


def measure_decode(artifact: Path, contexts: list[int], steps: int) -> dict:
    """Median decode ms at each context, and each context's steps beside reads of their weights."""
    s = Slice(artifact, max(contexts) + 2 * steps + 64)
    params = s.engine.manifest.vm.params
    probe = weight_read_probe(s.engine.backend.params, {i for i, name in enumerate(params)
                                                       if _param_part(name) not in ("head", "dense")})
    weight_bytes = decode_weight_bytes(artifact)["total"]
    s.new_request(16)  # untimed: pages in what is mapped, warms the kernels
    out: dict = {}
    for ctx in contexts:
        s.new_request(ctx)
        out[f"decode_ms_at_{ctx}"] = float(np.median([s.decode() for _ in range(steps)]) * 1e3)
        out.setdefault("beside_read", {})[str(ctx)] = decode_beside_read(lambda _: s.decode(), steps, probe,
                                                                         weight_bytes)
    return out


def table_spans(engine) -> list[tuple[int, int]]:
    """(address, bytes) of this process's mappings of the Engram tables (the manifest's
    ``engram.tables`` files)."""
    manifest = json.loads((engine.path / MANIFEST).read_text())
    files = {str((engine.path / t["file"]).resolve()) for t in manifest["engram"]["tables"]}
    return [(lo, hi - lo) for lo, hi, _, path in _file_mappings() if path in files]


def _file_mappings() -> list[tuple[int, int, int, str]]:
    """(start, end, file offset, path) of this process's file mappings (/proc/self/maps)."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            lo, hi = (int(v, 16) for v in fields[0].split("-"))
            out.append((lo, hi, int(fields[2], 16), fields[5]))
    return out


def drop_pages(spans: list[tuple[int, int]]) -> None:
    """Make the pages of the mapped ranges ``spans`` cold: unmapped from this process (madvise
    MADV_DONTNEED) and dropped from the page cache (posix_fadvise DONTNEED on the file range
    behind each mapping, found in /proc/self/maps)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = os.sysconf("SC_PAGE_SIZE")
    maps = _file_mappings()
    for address, nbytes in spans:
        start, stop = address // page * page, -(-(address + nbytes) // page) * page
        for lo, hi, offset, path in maps:
            a, b = max(start, lo), min(stop, hi)
            if a >= b:
                continue
            if libc.madvise(a, b - a, MADV_DONTNEED) != 0:
                raise OSError(ctypes.get_errno(), f"madvise of {path}")
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, offset + a - lo, b - a, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def measure_engram(artifact: Path, context: int, steps: int) -> dict:
    """The V4.1 slice's decode step profiled by op family, with the Engram tables' pages warm
    and cold (dropped before each step). The tables are mapped whatever the weights mode."""
    s = Slice(artifact, context + 3 * steps + 64, profile=True)
    spans = table_spans(s.engine)
    s.new_request(context)
    for _ in range(steps):  # untimed: pages in the weights
        s.decode()
    profiler = s.engine.profiler
    out = {"table_bytes": sum(n for _, n in spans)}
    for state in ("warm", "cold"):
        profiler.steps.clear()
        for _ in range(steps):
            if state == "cold":
                drop_pages(spans)
            s.decode()
        summary = profiler.summary("decode")
        out[state] = {"wall_ms": summary["wall_ms"], "kernel_ms": summary["kernel_ms"],
                      "families_ms": summary["families_ms"]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--engram-rows", type=int, default=8_400_000,
                   help="rows of the Engram table (256 FP8 columns each; default 8.4 M: 2.15 GB)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--workdir", type=Path)
    p.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    p.add_argument("--stage", choices=["make", "compile"], help=argparse.SUPPRESS)
    p.add_argument("--system", choices=[*SLICES, "engram"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.stage:
        prepare(args.workdir, args.stage, args.engram_rows)
        return
    if args.system == "engram":  # child processes, TVM_NUM_THREADS set
        print(json.dumps(measure_engram(artifact_of(args.workdir, "v41"), args.contexts[0], args.decode_steps)))
        return
    if args.system:
        print(json.dumps(measure_decode(artifact_of(args.workdir, args.system), args.contexts, args.decode_steps)))
        return

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="dsv4c-v41-bench-"))
    here = Path(__file__).resolve().parent
    (workdir / "v4").mkdir(parents=True, exist_ok=True)
    for stage, done in (("make", "v41-fp8"), ("compile", "v41-artifact")):
        if not (workdir / done).exists():
            subprocess.run([sys.executable, __file__, "--stage", stage, "--workdir", str(workdir),
                            "--engram-rows", str(args.engram_rows)], check=True)
    for stage, done in (("make", "fp8"), ("compile", "artifact")):
        if not (workdir / "v4" / done).exists():
            subprocess.run([sys.executable, str(here / "flash_slice.py"), "--stage", stage, "--workdir",
                            str(workdir / "v4")], check=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TVM_NUM_THREADS": str(args.threads)}

    def child(cmd: list[str]) -> dict:
        done = subprocess.run([sys.executable] + cmd, check=True, capture_output=True, text=True, env=env)
        return json.loads(done.stdout.strip().splitlines()[-1])

    common = ["--workdir", str(workdir), "--decode-steps", str(args.decode_steps), "--contexts",
              *map(str, args.contexts)]
    measurements = {name: (lambda name=name: child([__file__, "--system", name] + common)) for name in SLICES}
    measurements["read"] = lambda: child([str(here / "flash_slice.py"), "--system", "bandwidth"])
    runs: dict[str, list[dict]] = {name: [] for name in measurements}
    for r in range(args.rounds):
        for name in list(measurements)[::1 if r % 2 == 0 else -1]:
            runs[name].append(measurements[name]())
    engram = child([__file__, "--system", "engram"] + common)

    from dsv4c.targets import host_cpu, host_cpu_flags

    host = host_cpu_flags()
    report = {"cpu": {"model": host.model if host else None, "llvm_cpu": host_cpu()}, "threads": args.threads,
              "rounds": args.rounds, "engram_rows": args.engram_rows,
              "read_gb_s": best(runs["read"])["read_gb_s"], "engram": engram}
    print(f"V4.1 slice beside the V4 flash slice on {report['cpu']['model']} (LLVM {report['cpu']['llvm_cpu']}), "
          f"{args.threads} threads, best of {args.rounds} alternating round(s); read bandwidth "
          f"{report['read_gb_s']:.1f} GB/s (TVM streaming sum over 1 GiB)")
    for name in SLICES:
        beside = [figures.pop("beside_read") for figures in runs[name]]
        figures = report[name] = best(runs[name])
        weights = report[name + "_decode_weight_bytes"] = decode_weight_bytes(artifact_of(workdir, name))
        report[name + "_beside_read"] = beside
        for ctx in args.contexts:
            ms = figures[f"decode_ms_at_{ctx}"]
            gb_s = weights["total"] / ms * 1e-6
            pair = max((r[str(ctx)] for r in beside), key=lambda r: r["share"])
            print(f"{name:>4} decode at {ctx}: {ms:.1f} ms, {weights['total'] / 1e9:.3f} GB of weights a token "
                  f"= {gb_s:.2f} GB/s = {gb_s / report['read_gb_s']:.1%} of the read bandwidth; beside reads of "
                  f"its own weights: {pair['share']:.1%} of {pair['read_gb_s']:.1f} GB/s")
    print(f"Engram tables: {engram['table_bytes'] / 1e9:.2f} GB; the V4.1 decode step at {args.contexts[0]} "
          "by op family (ms, profiled):")
    for state in ("warm", "cold"):
        e = engram[state]
        share = e["families_ms"].get("engram", 0.0) / e["wall_ms"]
        top = sorted(e["families_ms"].items(), key=lambda kv: -kv[1])[:8]
        print(f"  {state}: wall {e['wall_ms']:.1f}, kernels {e['kernel_ms']:.1f}, engram {share:.1%} of the step; "
              + ", ".join(f"{k} {v:.2f}" for k, v in top))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
