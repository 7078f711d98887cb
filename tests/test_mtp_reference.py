"""The compiled MTP function (``mtp0_decode`` / ``mtp0_prefill``) against the MTP layer of docs/v4.md written out
here: the embedding / hidden-state projections in numpy, then one V4 block, the MTP layer's
own hc_head and norm and the shared head. transformers has no MTP layer, but its V4 decoder
layer is the reference for a block: the MTP block's weights are loaded into a one-layer
transformers model (a sliding-window layer with routed experts, as the official MTP block is)
and its layer, hc_head, norm and head run on the streams the numpy part builds."""

import dataclasses

import numpy as np
import pytest

from dsv4c.frontend.checkpoint_writer import write_checkpoint
from dsv4c.frontend.random_model import random_weights
from dsv4c.artifact.model_config import ROUTED_MOE, SLIDING, v4_layer
from dsv4c.runtime.engine import Engine

TOL = 1e-4
# What the MTP layer owns besides its block; its block tensors become layer 0's.
_MTP_ONLY = ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight")


def _rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _block_as_one_layer_model(cfg, out_dir):
    """A one-layer checkpoint whose layer, hc_head and norm are the MTP layer's (embed and head
    are shared): what transformers loads to run the MTP block."""
    one = dataclasses.replace(cfg, layers=(v4_layer(0, SLIDING, 0, ROUTED_MOE),), mtp_layers=())
    weights = random_weights(cfg, 0)  # the parity checkpoint's values (fp32_checkpoint, seed 0)
    mapped = {}
    for name, value in weights.items():
        if name.startswith("mtp.0."):
            rest = name[len("mtp.0."):]
            if rest in _MTP_ONLY:
                continue
            mapped[rest if rest.startswith(("norm.", "hc_head_")) else "layers.0." + rest] = value
        elif name in ("embed.weight", "head.weight"):
            mapped[name] = value
    write_checkpoint(one, mapped, out_dir)
    return weights


def _reference_logits(cfg, ckpt_dir, weights, streams, next_tokens):
    """The MTP layer of docs/v4.md over positions 0..T-1 of one request, in one causal forward."""
    import torch
    from transformers import DeepseekV4ForCausalLM
    from transformers.masking_utils import create_sliding_window_causal_mask

    p, eps = "mtp.0.", cfg.rms_norm_eps
    e = _rmsnorm(weights["embed.weight"][next_tokens], weights[p + "enorm.weight"], eps)
    e = e @ weights[p + "e_proj.weight"].T
    g = _rmsnorm(streams, weights[p + "hnorm.weight"], eps) @ weights[p + "h_proj.weight"].T
    x = e[:, None, :] + g  # the embedding's projection broadcast to every stream

    model = DeepseekV4ForCausalLM.from_pretrained(ckpt_dir, dtype=torch.float32).eval()
    m = model.model
    t = len(next_tokens)
    with torch.no_grad():
        pos = torch.arange(t)[None]
        like = torch.zeros(1, t, cfg.hidden_size)
        mask = create_sliding_window_causal_mask(config=m.config, inputs_embeds=like, attention_mask=None,
                                                 past_key_values=None, position_ids=pos)
        rope = {kind: m.rotary_emb(like, position_ids=pos, layer_type=kind) for kind in ("main", "compress")}
        h = m.layers[0](torch.tensor(x, dtype=torch.float32)[None], position_embeddings=rope, position_ids=pos,
                        attention_mask=mask, input_ids=torch.tensor(next_tokens)[None], past_key_values=None)
        return model.lm_head(m.norm(m.hc_head(h)))[0].numpy()


@pytest.mark.parametrize("length", [3, 37])
def test_mtp_logits_match_the_spec(parity_artifacts, tmp_path, length):
    cfg, _, _, cpu = parity_artifacts
    weights = _block_as_one_layer_model(cfg, tmp_path / "mtp_block")
    rng = np.random.default_rng(length)
    tokens = rng.integers(0, cfg.vocab_size, length + 1).astype(np.int32)
    engine = Engine(cpu)
    backend = engine.backend
    engine.pool.admit(0, length)
    positions, seq = np.arange(length, dtype=np.int32), np.zeros(length, np.int32)
    backend.step(tokens[:-1], positions, seq)  # the backbone's streams of positions 0..length-1
    streams = backend.step_streams.numpy()
    ours = backend.draft(tokens[1:], positions, seq, positions, positions)  # every position's draft logits
    expected = _reference_logits(cfg, tmp_path / "mtp_block", weights, streams, tokens[1:])
    assert ours.shape == expected.shape == (length, cfg.vocab_size)
    assert np.abs(ours - expected).max() <= TOL
    # The decode function (few tokens: GEMV kernels) computes the same draft for the last position.
    engine.pool.free(0)
    engine.pool.admit(0, length)
    backend.step(tokens[:-1], positions, seq)
    if length > 1:
        backend.draft(tokens[1:-1], positions[:-1], seq[:-1], positions[:-1], positions[-2:-1])
    last = backend.draft(tokens[-1:], positions[-1:], seq[:1], positions[-1:], np.array([0], np.int32))
    assert np.abs(last[0] - expected[-1]).max() <= TOL
