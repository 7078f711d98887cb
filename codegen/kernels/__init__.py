"""The TIR kernels of the compiled step, one factory per kernel shape, by family.

Every factory takes only static sizes and returns a ``PrimFunc`` whose token dimension is
symbolic, so one kernel serves every layer of that shape and every step size. Kernel names
encode their parameters; ``lowering.node_kernels`` maps an IR node to the kernels it calls (by
factory name, ``codegen.kernel_factories.KERNELS``, which lists these factories and the step's
bookkeeping kernels). The CPU builds these kernels as they are; ``codegen.gpu`` binds the same
kernels to GPU threads, or schedules the compute definitions (:data:`COMPUTE_DEFINITIONS`).
"""

from __future__ import annotations

# Kernels built with TE as compute definitions: the CPU builds a written-out kernel (``schedule``),
# GPU targets schedule these definitions with dlight.
COMPUTE_DEFINITIONS = frozenset({"linear"})
# Kernels that take ``max_lanes``: GPU builds cap their vectors at GPU_MAX_LANES lanes.
VECTOR_KERNELS = frozenset({"expert_linear", "swiglu", "mhc", "rmsnorm_rope"})
GPU_MAX_LANES = 4
