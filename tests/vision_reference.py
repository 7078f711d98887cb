"""DeepSeek-V4.1's vision tower re-derived in torch from the release's ops (docs/vision.md), and a
random model that has one: the parity tests' reference and the bench's baseline."""

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F


def reference_rows(w: dict, geometry, tower, pixels: np.ndarray, dtype=torch.float64) -> np.ndarray:
    """The span rows of ``pixels`` [3, H, W] in ``dtype``, written from the release's ops."""
    t = {k: torch.from_numpy(v).to(dtype) for k, v in w.items()}
    p, r, d, heads = geometry.patch_size, geometry.downsample_ratio, tower.hidden_size, tower.num_heads
    _, height, width = pixels.shape
    gh, gw = height // p, width // p
    x = torch.from_numpy(pixels).to(dtype)
    patches = x.reshape(3, gh, p, gw, p).permute(1, 3, 0, 2, 4).reshape(gh * gw, 3 * p * p)
    h = patches @ t["vision.patch_embed.proj.weight"].T + t["vision.patch_embed.proj.bias"]
    half = d // heads // 2
    inv = 1.0 / tower.rope_theta ** (torch.arange(0, half, 2, dtype=dtype) / half)
    rows, cols = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
    freqs = (torch.stack([rows, cols], -1).reshape(-1, 2, 1).to(dtype) * inv).flatten(1)
    cos, sin = freqs.cos()[:, None], freqs.sin()[:, None]

    def rope(v):
        a, b = v.chunk(2, dim=-1)
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    def rms(v, weight):
        return weight * v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + tower.norm_eps)

    n = gh * gw
    for layer in range(tower.num_layers):
        b = f"vision.blocks.{layer}."
        qkv = rms(h, t[b + "norm1.weight"]) @ t[b + "attn.wqkv.weight"].T + t[b + "attn.wqkv.bias"]
        q, k, v = (z.reshape(n, heads, -1) for z in qkv.chunk(3, dim=-1))
        o = F.scaled_dot_product_attention(rope(q).transpose(0, 1), rope(k).transpose(0, 1), v.transpose(0, 1))
        h = h + o.transpose(0, 1).reshape(n, d) @ t[b + "attn.wo.weight"].T + t[b + "attn.wo.bias"]
        gate, up = (rms(h, t[b + "norm2.weight"]) @ t[b + "mlp.w1.weight"].T).chunk(2, dim=-1)
        h = h + (F.silu(gate) * up) @ t[b + "mlp.w2.weight"].T
    h = rms(h, t["vision.norm.weight"])
    grid = F.pad(h.reshape(gh, gw, d).permute(2, 0, 1), (0, -gw % r, 0, -gh % r))
    merged = F.unfold(grid[None], r, stride=r)[0].T
    e = F.gelu(merged @ t["aligner.w1.weight"].T + t["aligner.w1.bias"]) @ t["aligner.w2.weight"].T \
        + t["aligner.w2.bias"]
    mh, mw = -(-gh // r), -(-gw // r)
    span = [t["image_start"][None]]
    for y in range(mh):
        span += [e[y * mw:(y + 1) * mw], t["image_newline"][None]]
    return torch.cat(span + [t["image_end"][None]]).numpy()


def write_vision_model(out: Path, vision_config: dict, image_token_id: int, seed: int = 11,
                       text: dict | None = None) -> dict[str, np.ndarray]:
    """v41-tiny (random text weights, a byte-level tokenizer; ``text`` overrides its config's
    fields) with a random tower, aligner and span rows of ``vision_config``, stored BF16 as the
    release stores them, in the release's composite config.json at ``out``; the tower's tensors
    as float32 by name."""
    from safetensors.torch import save_file

    from dsv4c.artifact.vision import vision_tensors
    from dsv4c.frontend.byte_tokenizer import write_byte_tokenizer
    from dsv4c.frontend.checkpoint_writer import write_checkpoint
    from dsv4c.frontend.config import config_from_dict, preset
    from dsv4c.frontend.random_model import random_weights
    from dsv4c.frontend.vision import raw_config, read_vision

    raw = {**raw_config("v41-tiny"), **(text or {})}
    cfg = config_from_dict(raw, "v41-tiny") if text else preset("v41-tiny")
    write_checkpoint(cfg, random_weights(cfg, seed=5), out)
    write_byte_tokenizer(out, cfg.vocab_size)
    composite = {"model_type": "deepseek_v41", "architectures": ["DeepseekV41ForCausalLM"],
                 "text_config": json.loads((out / "config.json").read_text()), "vision_config": vision_config,
                 "image_token_id": image_token_id}
    (out / "config.json").write_text(json.dumps(composite, indent=2))
    geometry, tower = read_vision(composite, cfg.hidden_size)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (shape, multiplied) in vision_tensors(geometry, tower).items():
        if multiplied:  # about unit-variance outputs
            value = torch.randn(shape, generator=gen) / shape[1] ** 0.5
        elif name.endswith("norm.weight") or name.endswith(("norm1.weight", "norm2.weight")):
            value = 1 + 0.1 * torch.randn(shape, generator=gen)
        else:
            value = 0.5 * torch.randn(shape, generator=gen)
        tensors[name] = value.to(torch.bfloat16)
    save_file(tensors, str(out / "vision.safetensors"), metadata={"format": "pt"})
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["weight_map"].update({name: "vision.safetensors" for name in tensors})
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return {name: t.float().numpy() for name, t in tensors.items()}
