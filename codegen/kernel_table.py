"""Every kernel factory of the compiled step, by the name a ``ops.base.KernelSpec`` gives it,
and the names of each factory's parameters."""

from __future__ import annotations

import functools
import inspect
from collections import namedtuple


def kernel_factory(name: str):
    """The factory of a kernel named in a :class:`KernelSpec`."""
    from dsv4c.codegen import step_kernels
    from dsv4c.codegen.kernels import KERNELS

    return KERNELS.get(name) or getattr(step_kernels, name)


@functools.cache
def kernel_params(name: str) -> type:
    """The named tuple of a kernel factory's parameters (those a :class:`KernelSpec` gives it; its
    keyword-only build options, such as a GPU build's ``max_lanes``, are not), with its defaults."""
    fields = [p for p in inspect.signature(kernel_factory(name)).parameters.values()
              if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    return namedtuple(f"{name}_params", [p.name for p in fields],
                      defaults=[p.default for p in fields if p.default is not inspect.Parameter.empty])
