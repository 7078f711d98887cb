"""The ops with plain row kernels or none: ``embed``, ``add``, ``concat``, ``reshape``."""

from __future__ import annotations

from math import prod

from dsv4c.codegen.ops.base import F32, OpLowering, input_shapes, kernel


class Embed(OpLowering):
    def kernels(self, node, cfg, plan):
        return {"main": kernel("embed", *input_shapes(node)[1])}

    def emit(self, em, node, roles, args):
        table = node.inputs[1]
        return [em.call(roles["main"], [args[0], em.param(table.name)], ([em.t, table.type.shape[1]], F32))]


class Add(OpLowering):
    """Rows of the input's trailing width; a width known only at run time (V4.1's index scores
    plus the candidate mask, [T, entries]) adds value by value."""

    @staticmethod
    def _width(shape) -> int:
        return prod(shape[1:]) if all(isinstance(d, int) for d in shape[1:]) else 1

    def kernels(self, node, cfg, plan):
        return {"main": kernel("add", self._width(input_shapes(node)[0]))}

    def emit(self, em, node, roles, args):
        shape = em.shape(args[0])
        width = self._width(node.inputs[0].type.shape)
        flat = [prod(shape), 1] if width == 1 else [shape[0], width]
        out = em.call(roles["main"], [em.view(args[0], flat), em.view(args[1], flat)], (flat, F32))
        return [em.view(out, shape)]


class Concat(OpLowering):
    """Along the last axis, one input at a time: the first k inputs side by side, then the next."""

    def kernels(self, node, cfg, plan):
        widths = [shape[1] for shape in input_shapes(node)]
        return {f"join{i}": kernel("concat_columns", sum(widths[:i]), widths[i]) for i in range(1, len(widths))}

    def emit(self, em, node, roles, args):
        out = args[0]
        for i in range(1, len(args)):
            shape = em.shape(out)
            out = em.call(roles[f"join{i}"], [out, args[i]], ([shape[0], shape[1] + em.shape(args[i])[1]], F32))
        return [out]


class Reshape(OpLowering):
    """A view: no kernel."""

    def kernels(self, node, cfg, plan):
        return {}

    def emit(self, em, node, roles, args):
        return [em.view(args[0], em.dims(node.attrs["shape"]))]
