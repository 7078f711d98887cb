"""Fixtures several test files share."""

import pytest

from dsv4c.codegen.compile import compile_model
from dsv4c.frontend.config import config_from_dict

from parity_configs import PARITY_CONFIGS
from reference_harness import fp32_checkpoint


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
