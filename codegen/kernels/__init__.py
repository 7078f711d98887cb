"""The TIR kernels of the compiled step, one factory per kernel shape, by family.

Every factory takes only static sizes and returns a ``PrimFunc`` whose token dimension is
symbolic, so one kernel serves every layer of that shape and every step size. Kernel names
encode their parameters; ``lowering.node_kernels`` maps an IR node to the kernels it calls (by
factory name, :data:`KERNELS`). The CPU builds these kernels as they are; ``codegen.gpu`` binds
the same kernels to GPU threads, or schedules the compute definitions (:data:`COMPUTE_DEFINITIONS`).
"""

from __future__ import annotations

from dsv4c.codegen.kernels import attention, compressor, index, matmul, mhc, norm_rope, pool_rows, routing, topk

# Every kernel factory of the package, by the name a ``lowering.KernelSpec`` gives it.
KERNELS = {f.__name__: f for f in (
    matmul.linear, matmul.expert_linear, norm_rope.embed, norm_rope.rmsnorm, norm_rope.rope, norm_rope.rmsnorm_rope,
    norm_rope.add, mhc.mhc, mhc.hc_expand, mhc.mhc_post, routing.route_scores, routing.add_bias, routing.hash_ids,
    routing.route_weights, routing.swiglu, topk.topk_rows, pool_rows.store_main_fp8, pool_rows.store_rows,
    compressor.ring_reset, compressor.ring_update, compressor.compress_pool, index.index_score, attention.sparse_attn)}

# Kernels built with TE as compute definitions: the CPU builds a written-out kernel (``schedule``),
# GPU targets schedule these definitions with dlight.
COMPUTE_DEFINITIONS = frozenset({"linear"})
# Kernels that take ``max_lanes``: GPU builds cap their vectors at GPU_MAX_LANES lanes.
VECTOR_KERNELS = frozenset({"expert_linear", "swiglu", "mhc", "rmsnorm_rope"})
GPU_MAX_LANES = 4
