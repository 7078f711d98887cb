"""Where a DSpark drafter comes from: the target checkpoint's own ``mtp.*`` tensors, or another
checkpoint's (``dsv4c compile --draft-model DIR``: a fine-tuned target often keeps the
``dspark_*`` fields but drops the drafter). Either way the stage count is the number of
``mtp.{i}.`` prefixes the tensors hold, not what the config says (the 0731 release says
``num_nextn_predict_layers: 1`` and ships three stages), and the drafter's confidence head is
there when its tensor is.
"""

from __future__ import annotations

import re
import sys
from dataclasses import replace
from pathlib import Path

from dsv4c.artifact.model_config import ROUTED_MOE, SLIDING, ModelConfig, v4_layer
from dsv4c.errors import CheckpointError, ConfigError, UnsupportedModelError
from dsv4c.frontend.checkpoint import Checkpoint
from dsv4c.frontend.config import load_config

_STAGE = re.compile(r"^mtp\.(\d+)\.")

# What the stages' tensors and the shared embedding / head need the two models to agree on.
_SHARED_SHAPE = ("vocab_size", "hidden_size", "num_heads", "head_dim", "rope_dim", "q_lora_rank", "o_groups",
                 "o_lora_rank", "hc_mult", "moe_intermediate_size", "sliding_window")


def _warn(message: str) -> None:
    print(f"dsv4c: warning: {message}", file=sys.stderr)


def with_checkpoint_stages(cfg: ModelConfig, ckpt: Checkpoint) -> ModelConfig:
    """``cfg`` (with DSpark fields) with the stages and confidence head ``ckpt`` holds; without
    any ``mtp.*`` tensor, ``cfg`` without a drafter (one warning line)."""
    stages = sorted({int(m[1]) for name in ckpt.names() if (m := _STAGE.match(name))})
    if not stages:
        _warn(f"{ckpt.path} holds no DSpark drafter (no mtp.* tensors) though its config has the dspark_* fields; "
              "compiling without one (--draft-model DIR takes it from another checkpoint)")
        return replace(cfg, dspark=None, mtp_layers=())
    if stages != list(range(len(stages))):
        raise CheckpointError(f"{ckpt.path}: DSpark stages mtp.{{i}} must be numbered from 0 without gaps, got "
                              f"{stages}")
    count = len(stages)
    if count != len(cfg.mtp_layers):
        _warn(f"the config counts {len(cfg.mtp_layers)} drafter stage(s) (num_nextn_predict_layers / n_mtp_layers); "
              f"{ckpt.path} holds {count}: using {count}")
    last = f"mtp.{count - 1}.confidence_head.proj."
    if last + "bias" in ckpt:
        raise UnsupportedModelError(f"{ckpt.path}: tensor {last}bias: a biased confidence head (DeepSpec's Qwen "
                                    "drafters) is not implemented; V4's drafters have none")
    n = cfg.num_layers
    return replace(cfg, mtp_layers=tuple(v4_layer(n + i, SLIDING, 0, ROUTED_MOE) for i in range(count)),
                   dspark=replace(cfg.dspark, confidence_head=last + "weight" in ckpt))


def with_draft_model(cfg: ModelConfig, draft_dir: str | Path) -> ModelConfig:
    """The target ``cfg`` with the drafter of the model in ``draft_dir`` (its DSpark fields and
    ``mtp.*`` tensors, read through ``Checkpoint(target, drafter=draft_dir)``), checked to fit."""
    draft = load_config(draft_dir)
    if draft.dspark is None:
        raise ConfigError(f"{draft_dir}: --draft-model needs a config with the DSpark fields (dspark_block_size, "
                          "dspark_target_layer_ids, dspark_noise_token_id, ...)")
    for field in _SHARED_SHAPE:
        mine, theirs = getattr(cfg, field), getattr(draft, field)
        if mine != theirs:
            raise ConfigError(f"--draft-model {draft_dir}: {field} is {theirs}, the target's is {mine}; the drafter "
                              "must be made for this target")
    beyond = [i for i in draft.dspark.target_layers if i >= cfg.num_layers]
    if beyond:
        raise ConfigError(f"--draft-model {draft_dir}: dspark_target_layer_ids has layer {beyond[0]}; the target has "
                          f"{cfg.num_layers} layers")
    if draft.num_layers != cfg.num_layers:
        _warn(f"--draft-model {draft_dir} was made for a target of {draft.num_layers} layers, this one has "
              f"{cfg.num_layers}: its taps {list(draft.dspark.target_layers)} apply to this target's layers")
    with Checkpoint(draft_dir) as ckpt:
        n = cfg.num_layers
        stages = replace(cfg, dspark=draft.dspark, mtp_layers=tuple(
            v4_layer(n + i, SLIDING, 0, ROUTED_MOE) for i in range(len(draft.mtp_layers))))
        out = with_checkpoint_stages(stages, ckpt)
    if out.dspark is None:
        raise CheckpointError(f"--draft-model {draft_dir}: holds no mtp.* tensors, no drafter to take")
    return out


def resolve_drafter(cfg: ModelConfig, checkpoint_dir: Path | None, draft_dir: str | Path | None) -> ModelConfig:
    """``cfg`` with its drafter as the checkpoints hold it: ``draft_dir``'s, or (DSpark fields and a
    checkpoint to read) the target's own; otherwise ``cfg`` unchanged."""
    if draft_dir is not None:
        return with_draft_model(cfg, draft_dir)
    if cfg.dspark is None or checkpoint_dir is None:
        return cfg
    with Checkpoint(checkpoint_dir) as ckpt:
        return with_checkpoint_stages(cfg, ckpt)
