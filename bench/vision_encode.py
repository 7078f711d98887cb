"""``encode_image`` on the CPU at the released vision tower's widths, against the same tower in
eager PyTorch, in one run.

The tower is DeepSeek-V4.1-Flash's (width 1024, MLP 2816, 16 heads, patch 14, ratio 3, aligner
into a 5120-wide text model) with fewer blocks than its 32 (``--layers``, default 4: random
weights, and the bench compiles a whole model around it; the text model is v41-tiny at width
5120). Both run one image of ``--size`` pixels (default 546 x 546: the release's min_pixels
image, 39 x 39 patches, a 13 x 13 token grid, 184 span tokens), float32, on every core torch and
TVM take by default. Reported: the best of ``--repeats`` runs each, their ratio, image tokens per
second, the 32-block time scaled from the whole run by 32 / ``--layers`` (an upper bound:
the patch embedding and the aligner do not grow with the blocks), and one more call's time by
kernel. ``--attention 4,8,12`` times the attention kernel alone instead (at those query blocks,
beside the per-(query, head) kernel of GPU builds, both built for this CPU).

    PYTHONPATH=.. python bench/vision_encode.py [--layers 4] [--size 546] [--repeats 3] [--attention 8]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from matmul import _best as best_of, cpu_model  # noqa: E402
from vision_reference import reference_rows, write_vision_model  # noqa: E402

RELEASE_TOWER = {"model_type": "deepseek_v41_vision", "hidden_size": 1024, "intermediate_size": 2816,
                 "num_attention_heads": 16, "patch_size": 14, "downsample_ratio": 3, "rope_theta": 10000.0,
                 "max_image_tokens": 1024, "min_pixels": 295936}
RELEASE_TEXT_HIDDEN = 5120
RELEASE_LAYERS = 32


def kernel_times(backend, pixels: np.ndarray) -> dict[str, float]:
    """Seconds of one encode_image call by the symbol the VM called (kernels and builtins),
    largest first; the instrument is removed afterwards."""
    spent: dict[str, float] = {}
    start = [0.0]

    def instrument(_func, symbol, before, _ret, *_args):
        if before:
            start[0] = time.perf_counter()
        else:
            spent[symbol] = spent.get(symbol, 0.0) + time.perf_counter() - start[0]
        return 0

    backend.vm.set_instrument(instrument)
    try:
        backend.encode_image(pixels)
    finally:
        backend.vm.set_instrument(lambda *_: 0)
    return dict(sorted(spent.items(), key=lambda kv: -kv[1]))


def attention_kernels(patches: int, query_blocks: list[int], repeats: int) -> None:
    """``vision_attention`` alone at the released heads (16 of 64) over ``patches`` patches: the
    CPU kernel at each query block and the per-(query, head) kernel GPU builds take, built for
    this CPU, against float64 softmax attention."""
    import tvm

    from dsv4c.codegen.kernels.cpu import CPU_PASS_CONFIG, cpu_target
    from dsv4c.codegen.kernels.vision import padded_keys, vision_attention

    heads, head_dim, n = 16, 64, patches
    rng = np.random.default_rng(0)
    qv = rng.standard_normal((2, n, heads, head_dim)).astype(np.float32)
    k = rng.standard_normal((n, heads, head_dim)).astype(np.float32)
    kt = np.zeros((heads, head_dim, padded_keys(n)), np.float32)
    kt[:, :, :n] = k.transpose(1, 2, 0)
    s = np.einsum("qhd,khd->hqk", qv[0].astype(np.float64), k.astype(np.float64)) / np.sqrt(head_dim)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), qv[1].astype(np.float64)).reshape(n, -1)
    variants = {f"CPU kernel, {qb} queries a task": {"query_block": qb} for qb in query_blocks}
    variants["a (query, head) a task (GPU builds' kernel)"] = {"max_lanes": 4}
    target = cpu_target()
    print(f"CPU: {cpu_model()}; vision_attention, 16 heads of 64, {n} patches ({4 * n * n * 1024 / 1e9:.1f} GFLOP)")
    for name, options in variants.items():
        with target, tvm.transform.PassContext(config=CPU_PASS_CONFIG):
            kernel = tvm.compile(tvm.IRModule({"main": vision_attention(heads, head_dim, **options)}), target=target)
        out = tvm.runtime.tensor(np.zeros((n, heads * head_dim), np.float32))
        args = (tvm.runtime.tensor(qv), tvm.runtime.tensor(kt), out)
        seconds = best_of(lambda: kernel["main"](*args), repeats)
        print(f"{name}: {seconds * 1e3:.0f} ms, {4 * n * n * 1024 / seconds / 1e9:.0f} GFLOP/s, "
              f"max |out - float64| {np.abs(out.numpy() - want).max():.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--size", type=int, default=546, help="image height and width in pixels (a multiple of 14)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--attention", type=lambda v: [int(x) for x in v.split(",")], metavar="QUERY_BLOCKS",
                        help="time the attention kernel alone instead, at these query blocks (e.g. 4,8,12)")
    args = parser.parse_args()
    if args.attention:
        return attention_kernels((args.size // 14) ** 2, args.attention, args.repeats)

    import torch

    from dsv4c.compile import compile_model
    from dsv4c.runtime.engine import Engine

    with tempfile.TemporaryDirectory(prefix="dsv4c-vision-bench-") as tmp:
        model = Path(tmp) / "model"
        # v41-tiny's vocabulary (the tower never reads it): its last id stands for the image token.
        weights = write_vision_model(model, {**RELEASE_TOWER, "num_hidden_layers": args.layers}, 271,
                                     text={"hidden_size": RELEASE_TEXT_HIDDEN})
        start = time.perf_counter()
        compile_model(str(model), "llvm", Path(tmp) / "art", progress=False, log=lambda *_: None)
        compile_seconds = time.perf_counter() - start
        backend = Engine(Path(tmp) / "art").backend
        geometry, tower, _ = backend.vision
        pixels = np.random.default_rng(0).uniform(-1, 1, (3, args.size, args.size)).astype(np.float32)
        tokens = geometry.token_count(args.size, args.size)
        rows = backend.encode_image(pixels)
        ours = best_of(lambda: backend.encode_image(pixels), args.repeats)
        torch.set_grad_enabled(False)
        by_kernel = kernel_times(backend, pixels)
        reference = best_of(lambda: reference_rows(weights, geometry, tower, pixels, torch.float32), args.repeats)
        error = float(np.abs(rows - reference_rows(weights, geometry, tower, pixels)).max())

    patches = (args.size // 14) ** 2
    print(f"CPU: {cpu_model()} ({torch.get_num_threads()} torch threads)")
    print(f"tower: width 1024, MLP 2816, 16 heads, {args.layers} of {RELEASE_LAYERS} blocks, aligner to "
          f"{RELEASE_TEXT_HIDDEN}; image {args.size} x {args.size}: {patches} patches, {tokens} span tokens; "
          f"compile {compile_seconds:.0f} s; max |rows - float64 reference| {error:.2e}")
    print(f"encode_image {ours * 1e3:.0f} ms, eager PyTorch {reference * 1e3:.0f} ms: "
          f"{reference / ours:.2f}x; {tokens / ours:.0f} image tokens/s (torch {tokens / reference:.0f})")
    total = sum(by_kernel.values())
    print("one encode_image call by kernel (the VM's instrument, summed over calls): " + ", ".join(
        f"{symbol} {seconds * 1e3:.0f} ms ({seconds / total:.0%})" for symbol, seconds in list(by_kernel.items())[:10]))
    scale = RELEASE_LAYERS / args.layers
    print(f"32 blocks, scaled (an upper bound): encode_image {ours * scale:.2f} s, {tokens / ours / scale:.0f} "
          f"image tokens/s; eager PyTorch {reference * scale:.2f} s")


if __name__ == "__main__":
    main()
