"""What op lowerings are made of: :class:`KernelSpec` names one kernel instance, and
:class:`OpLowering` is one op's lowering (its kernels by role, its Relax emission, its matmul
weights)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from dsv4c.artifact.quant import QuantPlan, WeightFormat

I32, F32 = "int32", "float32"  # Relax dtypes of row indices and of activations


@dataclass(frozen=True)
class KernelSpec:
    """One kernel instance: a kernel factory (``kernel_factories.KERNELS``) and the positional
    arguments it is built with, as given: they spell the kernel's symbol, so a factory's default
    left out keeps it out of the name. Read them by name through :attr:`params`."""

    factory: str
    args: tuple

    @property
    def symbol(self) -> str:
        raw = "_".join([self.factory] + [str(p) for p in self.args])
        return re.sub(r"[^A-Za-z0-9_]", "p", raw)

    @property
    def params(self):
        """The arguments by the factory's parameter names, its defaults filled in (a named tuple,
        so ``factory(*spec.params)`` builds the kernel)."""
        from dsv4c.codegen.kernel_factories import kernel_params

        return kernel_params(self.factory)(*self.args)


def kernel(factory: str, *params) -> KernelSpec:
    return KernelSpec(factory, tuple(params))


def input_shapes(node) -> list:
    """The shape of each input of a node (None for one without a tensor type)."""
    return [v.type.shape if hasattr(v.type, "shape") else None for v in node.inputs]


def dense_quant(node, plan: QuantPlan) -> str:
    """The format a node's dense weights are stored and multiplied in: the plan's entry."""
    return plan.format_of(node.attrs["quant"]).name


def dense_compute(node, plan: QuantPlan) -> str:
    """What a node's dense weights are multiplied in: the plan's entry (``WeightQuant.compute``)."""
    return plan.compute_of(node.attrs["quant"])


def gemm_compute(compute: str) -> tuple:
    """The compute argument of a CPU GEMM kernel (``linear``, ``expert_linear``) in ``compute``:
    bf16 spelled out, fp32 the factories' default, left out so exact kernels keep their symbols
    (GPU targets' fp16 is their own GEMMs', not an argument)."""
    return ("bf16",) if compute == "bf16" else ()


def matmul_kernels(prefix: str, out_dim: int, in_dim: int, quant: str, groups: int = 0,
                   compute: str = "fp32") -> dict[str, KernelSpec]:
    """A weight's two matmul kernels: GEMV for decode-sized steps (fp32 in every numerics), GEMM
    (8-row blocks) for prefill, multiplying in ``compute``."""
    return {f"{prefix}gemv": kernel("linear", out_dim, in_dim, quant, True, groups),
            f"{prefix}gemm": kernel("linear", out_dim, in_dim, quant, False, groups, *gemm_compute(compute))}


def weight_quant(matmul: KernelSpec) -> str:
    """The weight format a matmul kernel (``linear`` or ``expert_linear``) reads."""
    return matmul.params.quant


class OpLowering:
    """How the compiled targets run one IR op. ``kernels`` names the kernels a node calls, by
    role: the builder compiles each distinct one once, the manifest records each role's symbol,
    and ``emit`` calls them by role from an entry function (``relax_step._Emitter``)."""

    weights = slice(0)  # the node inputs its matmul kernels read
    weight_role = ""  # the role of the kernel that reads them: its format is theirs (weight_quant)

    def kernels(self, node, cfg, plan) -> dict[str, KernelSpec]:
        raise NotImplementedError

    def emit(self, em, node, roles: dict[str, KernelSpec], args: list) -> list:
        """The Relax values of the node's outputs, given those of its inputs (``args``)."""
        raise NotImplementedError

    def matmul_weights(self, node) -> list:
        return node.inputs[self.weights]

    def weight_format(self, node, plan: QuantPlan) -> WeightFormat:
        """The format the artifact stores this node's matmul weights in, from the quantization
        plan: the one its kernels read (``dense_quant`` names the same format)."""
        return plan.format_of(node.attrs["quant"])

    def weight_groups(self, node) -> int:
        """Independent projections stacked in each matmul weight (each stored in its own tiles)."""
        return 1

    def ones_width(self, node) -> int | None:
        """The width of the ones vector the node reads as the weight it lacks (an unweighted norm)."""
        return None
