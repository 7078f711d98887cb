"""RMSNorm and rotary embedding: ``rmsnorm``, ``rope`` and the fused ``rmsnorm_rope``. An
unweighted norm reads a ones vector of the params tuple (``const.ones.<width>``), so its
kernel shares the weighted one's signature."""

from __future__ import annotations

from math import prod

from dsv4c.codegen.ops.base import F32, OpLowering, input_shapes, kernel


def rope_call(em, rope: str, x, *rest):
    """A rope kernel (``rope`` its symbol) over x [n, (heads,) dim], seen as [n, heads, dim]."""
    shape = em.shape(x)
    heads = [shape[0], shape[1] if len(shape) == 3 else 1, shape[-1]]
    return em.view(em.call(rope, [em.view(x, heads), *rest], (heads, F32)), shape)


def rope_table(em, name: str):
    """The frequency table ``name`` (main / compress) from the params tuple."""
    return em.param(f"const.rope.{name}")


class NormLowering(OpLowering):
    """An op whose norm weight is its second input, when it has ``weighted_arity`` inputs."""

    weighted_arity = 2

    def weighted(self, node) -> bool:
        return len(node.inputs) == self.weighted_arity

    def norm_weight(self, em, node):
        """The norm's weight, or the ones vector of its width."""
        width = self.ones_width(node)
        return em.param(node.inputs[1].name if width is None else f"const.ones.{width}")

    def ones_width(self, node):
        return None if self.weighted(node) else node.inputs[0].type.shape[-1]


class RmsNorm(NormLowering):
    def kernels(self, node, cfg, plan):
        return {"main": kernel("rmsnorm", input_shapes(node)[0][-1], node.attrs["eps"], self.weighted(node))}

    def emit(self, em, node, roles, args):
        x = args[0]
        shape = em.shape(x)
        flat = [prod(shape[:-1]), shape[-1]]
        w = self.norm_weight(em, node)
        return [em.view(em.call(roles["main"], [em.view(x, flat), w], (flat, F32)), shape)]


def _heads(shape) -> int:
    return shape[1] if len(shape) == 3 else 1


class Rope(OpLowering):
    def kernels(self, node, cfg, plan):
        a, shape = node.attrs, input_shapes(node)[0]
        return {"main": kernel("rope", _heads(shape), shape[-1], a["rope_dim"], a["inverse"])}

    def emit(self, em, node, roles, args):
        return [rope_call(em, roles["main"], args[0], args[1], rope_table(em, node.attrs["rope"]))]


class RmsNormRope(NormLowering):
    weighted_arity = 3  # x, the norm weight, positions

    def kernels(self, node, cfg, plan):
        a, shape = node.attrs, input_shapes(node)[0]
        return {"main": kernel("rmsnorm_rope", _heads(shape), shape[-1], a["rope_dim"], a["eps"], self.weighted(node))}

    def emit(self, em, node, roles, args):
        return [rope_call(em, roles["main"], args[0], self.norm_weight(em, node), args[-1],
                          rope_table(em, node.attrs["rope"]))]
