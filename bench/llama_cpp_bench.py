"""llama.cpp beside our artifact: its build, the slice's GGUF, and its decode ms/token at a depth.

llama.cpp implements DeepSeek-V4 natively (architecture ``deepseek4``). The copy used is the one
bundled in ``llama-cpp-python`` (pinned below) on PyPI: its source package carries the whole
llama.cpp tree (``vendor/llama.cpp``), so ``llama-bench`` is built from it with CMake, for this
CPU (``GGML_NATIVE``), in a cache folder outside the repository. Its own ``convert_hf_to_gguf.py``
reads our FP8 / FP4 checkpoints: FP8 (e4m3, 128 x 128 UE8M0 scales) becomes Q8_0, the FP4
experts MXFP4 (the same 32-code blocks with one power-of-two scale, repacked), BF16 stays BF16.

The converter insists on a tokenizer it knows (``get_vocab_base_pre`` hashes the token ids of a
test string and accepts only the hashes of published models); a checkpoint of ours has none. The
stand-in is a small byte-level BPE (the special tokens at the config's BOS / EOS ids, the other
ids up to ``vocab_size`` written as unused by the converter) declared as DeepSeek-V3's
pre-tokenizer, the family's: ``llama-bench`` feeds random token ids, so what text would tokenize
to never matters, only the vocabulary's size.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"

# The converter run with the stand-in tokenizer accepted: the pre-tokenizer check is the only
# part of it patched; the rest (tensor mapping, FP8 -> Q8_0, FP4 -> MXFP4) is llama.cpp's own.
_CONVERT = """
import runpy, sys
tree = sys.argv.pop(1)
sys.path[:0] = [tree, tree + "/gguf-py"]
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "deepseek-v3"
sys.argv[0] = tree + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def source_tree(cache: Path) -> Path:
    """llama.cpp's tree from ``llama-cpp-python``'s source package, downloaded and unpacked into
    ``cache`` when missing."""
    tree = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    if not tree.is_dir():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
                        "--no-binary", ":all:", "--no-deps", "-d", str(cache)], check=True)
        with tarfile.open(cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz") as archive:
            archive.extractall(cache, filter="data")
    return tree


def llama_bench(cache: Path) -> Path:
    """``llama-bench`` built for this CPU in ``cache/build`` when missing (minutes on 2 cores)."""
    binary = cache / "build" / "bin" / "llama-bench"
    if not binary.exists():
        tree = source_tree(cache)
        subprocess.run(["cmake", "-S", str(tree), "-B", str(cache / "build"), "-DCMAKE_BUILD_TYPE=Release",
                        "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                        "-DLLAMA_BUILD_SERVER=OFF"], check=True)
        subprocess.run(["cmake", "--build", str(cache / "build"), "-j", "2", "--target", "llama-bench"], check=True)
    return binary


def write_stand_in_tokenizer(model_dir: Path, config: dict) -> None:
    """A byte-level BPE of ~300 tokens, its special tokens at the config's BOS / EOS ids (0 and 1
    in our checkpoints), as ``tokenizer.json`` + ``tokenizer_config.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bos, eos = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
    specials = {config["bos_token_id"]: bos, config["eos_token_id"]: eos}
    if sorted(specials) != [0, 1]:
        raise ValueError(f"the stand-in tokenizer puts BOS / EOS at ids 0 / 1, the config has {sorted(specials)}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # A few merges: llama.cpp's BPE vocabulary requires the merges key to exist.
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[specials[0], specials[1]],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog " * 8], trainer)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos}))


def gguf_of(cache: Path, checkpoint: Path) -> Path:
    """The checkpoint converted by llama.cpp's converter, cached in ``cache`` as
    ``<parent>-<name>.gguf`` (redone when the checkpoint's weights are newer). The converter reads
    a folder of links to the checkpoint's files beside the stand-in tokenizer, so the checkpoint
    itself is left as it is."""
    checkpoint = checkpoint.resolve()
    out = cache / f"{checkpoint.parent.name}-{checkpoint.name}.gguf"
    weights = sorted(checkpoint.glob("*.safetensors"))
    if out.exists() and out.stat().st_mtime > max(w.stat().st_mtime for w in weights):
        return out
    model_dir = cache / f"{checkpoint.parent.name}-{checkpoint.name}-hf"
    model_dir.mkdir(parents=True, exist_ok=True)
    for f in [*weights, *checkpoint.glob("*.json")]:
        link = model_dir / f.name
        if not link.is_symlink():
            link.symlink_to(f)
    config = json.loads((checkpoint / "config.json").read_text())
    write_stand_in_tokenizer(model_dir, config)
    subprocess.run([sys.executable, "-c", _CONVERT, str(source_tree(cache)), str(model_dir),
                    "--outfile", str(out)], check=True)
    return out


BUILD_FIELDS = ("build_commit", "build_number", "cpu_info", "type_k", "type_v", "flash_attn", "n_batch", "n_ubatch",
                "poll", "repack", "model_type", "model_size")


def _run(bench: Path, gguf: Path, threads: int, reps: int, *test: str) -> dict:
    """One ``llama-bench`` test (``test``: its -p / -n / -d) as its JSON record. ``-lm none``:
    weights read into memory, as our engine holds them (not mapped)."""
    run = subprocess.run([str(bench), "-m", str(gguf), *test, "-t", str(threads), "-r", str(reps), "-lm", "none",
                          "-o", "json"], check=True, capture_output=True, text=True)
    (record,) = json.loads(run.stdout)
    return record


def decode_ms(bench: Path, gguf: Path, depth: int, tokens: int, threads: int, reps: int) -> dict:
    """``llama-bench``'s decode of ``tokens`` tokens after a prefill of ``depth`` (``-d``; the depth
    prefill is not timed and is done once, later repetitions restore its state): ms per token of
    each repetition (after llama-bench's own warm-up token), and what the build and run report."""
    record = _run(bench, gguf, threads, reps, "-p", "0", "-n", str(tokens), "-d", str(depth))
    return {"ms_per_rep": [ns / tokens / 1e6 for ns in record["samples_ns"]],
            **{k: record.get(k) for k in BUILD_FIELDS}}


def prefill_tok_s(bench: Path, gguf: Path, tokens: int, threads: int, reps: int) -> dict:
    """``llama-bench``'s prefill of ``tokens`` random tokens (``-p N -n 0``, in batches of its
    default ``-b 2048`` / ``-ub 512``): tok/s of each repetition (after llama-bench's own
    warm-up run), and what the build and run report."""
    record = _run(bench, gguf, threads, reps, "-p", str(tokens), "-n", "0")
    return {"tok_s_per_rep": [tokens / (ns / 1e9) for ns in record["samples_ns"]],
            **{k: record.get(k) for k in BUILD_FIELDS}}
