"""The projections: ``linear`` (and ``linear_split``, one projection whose output columns are
several values), ``grouped_linear`` and the head, ``lm_head``."""

from __future__ import annotations

from math import prod

from tvm import relax, tirx

from dsv4c.codegen.ops.base import (F32, OpLowering, dense_compute, dense_quant, input_shapes, kernel,
                                    matmul_kernels)


class Linear(OpLowering):
    """y = x @ W.T over the last axis of x."""

    weights, weight_role = slice(1, 2), "gemv"

    def kernels(self, node, cfg, plan):
        return matmul_kernels("", *input_shapes(node)[1], dense_quant(node, plan), 0, dense_compute(node, plan))

    def emit(self, em, node, roles, args):
        x, w = args[0], node.inputs[1]
        shape = em.shape(x)
        out_dim = w.type.shape[0]
        y = em.matmul(roles, "", em.view(x, [prod(shape[:-1]), shape[-1]]), em.weight(w.name, roles["gemv"]), out_dim)
        return [em.view(y, shape[:-1] + [out_dim])]


class LinearSplit(Linear):
    """A linear whose output columns are split into several values (``sizes``)."""

    def emit(self, em, node, roles, args):
        (y,) = super().emit(em, node, roles, args)
        n = em.shape(y)[0]
        flat = em.view(y, [n, prod(em.shape(y)[1:])])
        outs, start = [], 0
        for size, o in zip(node.attrs["sizes"], node.outputs):
            part = em.call("slice_columns", [flat, relax.prim_value(tirx.IntImm("int64", start))], ([n, size], F32))
            outs.append(em.view(part, em.dims(o.type.shape)))
            start += size
        return outs


class LmHead(Linear):
    """The logits of the rows ``logit_rows`` names, by GEMV in every entry function: every step
    takes the logits of a few rows (one per request), prefill steps too, and the GEMV streams
    the head once per GEMV_ROWS rows, where the GEMM would decode it into panels for a block of
    8 rows, 7 of them padding."""

    def kernels(self, node, cfg, plan):
        return {"gemv": kernel("linear", *input_shapes(node)[1], dense_quant(node, plan), True, 0)}

    def emit(self, em, node, roles, args):
        rows = em.inputs["logit_rows"]
        x = em.call("gather_rows", [args[0], rows], ([em.shape(rows)[0], em.shape(args[0])[1]], F32))
        w = node.inputs[1]
        return [em.matmul(roles, "", x, em.weight(w.name, roles["gemv"]), w.type.shape[0], gemv=True)]


class GroupedLinear(OpLowering):
    """The heads' groups projected each by its own block of rows of one weight: the groups are
    independent projections, so one kernel runs them all."""

    weights, weight_role = slice(1, 2), "gemv"

    def kernels(self, node, cfg, plan):
        g, rows_in = node.attrs["groups"], input_shapes(node)[1]
        return matmul_kernels("", rows_in[0] // g, rows_in[1], dense_quant(node, plan), g if g > 1 else 0,
                              dense_compute(node, plan))

    def emit(self, em, node, roles, args):
        x, w = args[0], node.inputs[1]
        n, groups, width = em.shape(x)
        rank = w.type.shape[0] // groups
        x = em.view(x, [n, width]) if groups == 1 else x  # one group: a plain projection
        y = em.matmul(roles, "", x, em.weight(w.name, roles["gemv"]), rank)
        return [em.view(y, [n, groups, rank])]

    def weight_groups(self, node):
        return node.attrs["groups"]
