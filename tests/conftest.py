"""Fixtures several test files share."""

import pytest

from dsv4c.cli import main as cli
from dsv4c.compile import compile_model
from dsv4c.frontend.config import config_from_dict

from parity_configs import PARITY_CONFIGS
from reference_harness import fp32_checkpoint
from serving import write_tokenizer


def compile_pair(tmp, ckpt):
    """The reference and the llvm artifact of a checkpoint."""
    ref = compile_model(str(ckpt), "reference", tmp / "ref", progress=False, log=lambda *_: None)
    cpu = compile_model(str(ckpt), "llvm", tmp / "cpu", progress=False, log=lambda *_: None)
    return ref, cpu


@pytest.fixture(scope="session", params=sorted(PARITY_CONFIGS))
def parity_artifacts(request, tmp_path_factory):
    """(config, fp32 checkpoint, reference artifact, llvm artifact) of each parity config,
    compiled once for the whole run (the compiled-step and the speculative tests share them)."""
    tmp = tmp_path_factory.mktemp(request.param)
    cfg = fp32_checkpoint(config_from_dict(PARITY_CONFIGS[request.param], request.param), tmp / "ckpt")
    return cfg, tmp / "ckpt", *compile_pair(tmp, tmp / "ckpt")


@pytest.fixture(scope="session")
def v41_fp8_model(tmp_path_factory):
    """v41-tiny as the release stores it (FP8 32 x 32 dense weights and Engram rows with E8M0
    scales, FP4 experts; random weights, a byte-level tokenizer) and its weights."""
    from dsv4c.frontend.byte_tokenizer import write_byte_tokenizer
    from dsv4c.frontend.checkpoint_writer import write_checkpoint
    from dsv4c.frontend.config import preset, with_weights
    from dsv4c.frontend.random_model import random_weights

    cfg = with_weights(preset("v41-tiny"), dense="fp8", experts="fp4", fp8_block=32)
    weights = random_weights(cfg, seed=3)
    out = write_checkpoint(cfg, weights, tmp_path_factory.mktemp("v41_fp8") / "model")
    write_byte_tokenizer(out, cfg.vocab_size)
    return out, weights


@pytest.fixture(scope="session")
def v41_fp8_artifacts(v41_fp8_model, tmp_path_factory):
    """``v41_fp8_model`` compiled for the reference target and for llvm, once for the whole run
    (tests that change an artifact copy it first)."""
    root = tmp_path_factory.mktemp("v41_fp8_artifacts")
    for target in ("reference", "llvm"):
        assert cli(["compile", "--model", str(v41_fp8_model[0]), "--target", target, "-o", str(root / target)]) == 0
    return {target: root / target for target in ("reference", "llvm")}


@pytest.fixture(scope="session")
def v41_case_artifacts(tmp_path_factory):
    """The V4.1 parity case (tests/v41_case.py) as a model that sees images, compiled once for the
    reference target and for llvm: the V4.1 parity tests run its text prompts (image-span inputs
    unused), tests/test_v41_images.py its image spans."""
    from v41_case import compile_case

    return {target: compile_case(tmp_path_factory.mktemp(f"v41_case_{target}"), target, images=True)
            for target in ("reference", "llvm")}


@pytest.fixture(scope="session")
def tiny_llvm(tmp_path_factory):
    """The quick start's artifact: ``dsv4c make-tiny`` then ``dsv4c compile --target llvm``,
    built once for the tests that only read it (the model directory lies beside it, ``model``)."""
    root = tmp_path_factory.mktemp("tiny_llvm")
    assert cli(["make-tiny", "--out", str(root / "model")]) == 0
    assert cli(["compile", "--model", str(root / "model"), "--target", "llvm", "-o", str(root / "art")]) == 0
    return root / "art"


@pytest.fixture(scope="session")
def serve_artifacts_tp2(tmp_path_factory):
    """``serve_artifacts`` with the llvm artifact at ``--tensor-parallel 2``: the tiny model with
    BF16 weights (its FP8 output projection has fewer columns than two 128-column scale blocks, so
    it does not split), the same tokenizer and chat template."""
    import json
    from pathlib import Path

    import dsv4c

    root = tmp_path_factory.mktemp("serve_tp2")
    config = json.loads((Path(dsv4c.__file__).parent / "frontend" / "presets" / "tiny.json").read_text())
    del config["quantization_config"], config["expert_dtype"]
    (root / "config.json").write_text(json.dumps(config))
    assert cli(["make-tiny", "--config", str(root / "config.json"), "--out", str(root / "model")]) == 0
    assert cli(["compile", "--model", str(root / "model"), "--target", "reference", "-o", str(root / "ref")]) == 0
    write_tokenizer(root / "model")
    assert cli(["compile", "--model", str(root / "model"), "--target", "llvm", "-tp", "2", "-o", str(root / "cpu")]) == 0
    return root


@pytest.fixture(scope="session")
def serve_artifacts(tmp_path_factory):
    """The tiny model compiled for the reference interpreter (without a tokenizer) and for llvm (with
    the word-level tokenizer and chat template)."""
    root = tmp_path_factory.mktemp("serve")
    model = root / "model"
    assert cli(["make-tiny", "--out", str(model), "--seed", "0"]) == 0
    # The reference artifact is compiled before the tokenizer exists: a model without one.
    assert cli(["compile", "--model", str(model), "--target", "reference", "-o", str(root / "ref")]) == 0
    write_tokenizer(model)
    assert cli(["compile", "--model", str(model), "--target", "llvm", "-o", str(root / "cpu")]) == 0
    assert (root / "cpu" / "tokenizer_config.json").is_file() and not (root / "ref" / "tokenizer.json").exists()
    return root


# A small random vision tower for v41-tiny (hidden 64, like the text model): the release's
# vision_config fields, its ratio 3 and its span layout, at widths a test compiles in seconds.
V41_VISION_CONFIG = {"model_type": "deepseek_v41_vision", "hidden_size": 64, "intermediate_size": 96,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "patch_size": 4, "downsample_ratio": 3,
                     "rope_theta": 10000.0, "max_image_tokens": 64, "min_pixels": 1024}
V41_VISION_IMAGE_TOKEN_ID = 271  # v41-tiny's last id: its byte-level tokenizer leaves 259 .. 271 unused


@pytest.fixture(scope="session")
def v41_vision_model(tmp_path_factory):
    """v41-tiny (random text weights, a byte-level tokenizer) with a random vision tower, aligner
    and span rows (V41_VISION_CONFIG, stored BF16 as the release stores them) in the release's
    composite config.json: (model directory, the tower's tensors as float32 by name)."""
    from vision_reference import write_vision_model

    out = tmp_path_factory.mktemp("v41_vision") / "model"
    return out, write_vision_model(out, V41_VISION_CONFIG, V41_VISION_IMAGE_TOKEN_ID)


@pytest.fixture(scope="session")
def v41_vision_artifact(v41_vision_model, tmp_path_factory):
    """``v41_vision_model`` compiled for llvm (with encode_image), once for the whole run."""
    out = tmp_path_factory.mktemp("v41_vision_artifact") / "llvm"
    compile_model(str(v41_vision_model[0]), "llvm", out, progress=False, log=lambda *_: None)
    return out
