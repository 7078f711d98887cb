"""The TIR kernels of the compiled step, one factory per kernel shape, by family.

Every factory takes only static sizes and returns a ``PrimFunc`` whose token dimension is
symbolic, so one kernel serves every layer of that shape and every step size. Kernel names
encode their parameters; ``lowering.node_kernels`` maps an IR node to the kernels it calls (by
factory name, ``codegen.kernel_factories.KERNELS``, which lists these factories and the step's
bookkeeping kernels). The CPU builds these kernels as they are; ``codegen.gpu`` binds the same
kernels to GPU threads, or replaces or schedules them (``codegen.gpu.SCHEDULE_RULES``).
"""
