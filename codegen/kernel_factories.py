"""Every kernel the compiled step calls, by the factory name a ``ops.base.KernelSpec`` gives it,
and the names of each factory's parameters.

Two kinds of TIR kernels, one table: the model's kernels (``codegen.kernels``: matmuls, norms,
attention, pool rows, ...) and the step's bookkeeping kernels (``codegen.step_kernels``: the
row arithmetic of pool rows, compressor windows and expert groups, and the generic row copies).
"""

from __future__ import annotations

import functools
import inspect
from collections import namedtuple

from dsv4c.codegen import step_kernels as step
from dsv4c.codegen.kernels import (attention, compressor, index, matmul, mhc, norm_rope, pool_rows, routing, topk, v41,
                                   vision)

KERNELS = {f.__name__: f for f in (
    matmul.linear, matmul.expert_linear, norm_rope.embed, norm_rope.rmsnorm, norm_rope.rope, norm_rope.rmsnorm_rope,
    norm_rope.add, norm_rope.concat_columns, mhc.mhc, mhc.hc_expand, mhc.hc_mean, mhc.mhc_post, routing.route_scores,
    routing.add_bias, routing.add_image_bias, routing.hash_ids, routing.route_weights, routing.swiglu, topk.topk_rows, pool_rows.store_main_fp8,
    pool_rows.store_rows, compressor.ring_reset, compressor.ring_update, compressor.compress_pool, index.index_score,
    attention.sparse_attn, step.window_rows, step.compress_windows, step.entry_rows, step.attention_rows,
    step.block_attention_rows, step.moe_group, step.moe_combine, step.shard_ids, step.gather_rows, step.scatter_rows,
    step.pad_rows, step.copy_rows, step.slice_columns, v41.v41_roundtrip, v41.hc_collapse, v41.image_splice,
    v41.candidate_block_scores, v41.candidate_mask, v41.engram_gather, v41.engram_gate, vision.vision_patches,
    vision.vision_gelu, vision.vision_rope, vision.vision_attention, vision.vision_merge, vision.vision_span)}


@functools.cache
def kernel_params(name: str) -> type:
    """The named tuple of a kernel factory's parameters (those a :class:`KernelSpec` gives it; its
    keyword-only build options, such as a GPU build's ``max_lanes``, are not), with its defaults."""
    fields = [p for p in inspect.signature(KERNELS[name]).parameters.values()
              if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    return namedtuple(f"{name}_params", [p.name for p in fields],
                      defaults=[p.default for p in fields if p.default is not inspect.Parameter.empty])
