"""The ops that join the ranks of a tensor-parallel program (``frontend.trace``,
docs/tensor_parallel.md): ``shard_ids`` is a kernel; ``all_reduce`` and ``all_gather`` call the
collectives the runtime registers (``runtime.tensor_parallel``) as packed functions in
destination-passing style, so a step stays one VM call per rank."""

from __future__ import annotations

from math import prod

from dsv4c.artifact.sharding import ALL_GATHER, ALL_REDUCE
from dsv4c.codegen.ops.base import F32, I32, OpLowering, kernel


class ShardIds(OpLowering):
    def kernels(self, node, cfg, plan):
        return {"main": kernel("shard_ids", node.attrs["size"])}

    def emit(self, em, node, roles, args):
        shape = em.shape(args[0])
        flat = [shape[0], prod(shape[1:])]
        out = em.call(roles["main"], [em.view(args[0], flat), em.param(node.inputs[1].name)], (flat, I32))
        return [em.view(out, shape)]


class AllReduce(OpLowering):
    def kernels(self, node, cfg, plan):
        return {}

    def emit(self, em, node, roles, args):
        return [em.call_packed(ALL_REDUCE, args, (em.shape(args[0]), F32))]


class AllGather(OpLowering):
    def kernels(self, node, cfg, plan):
        return {}

    def emit(self, em, node, roles, args):
        return [em.call_packed(ALL_GATHER, args, ([em.shape(args[0])[0], node.attrs["size"]], F32))]
