"""IR op name -> its lowering for the compiled targets."""

from __future__ import annotations

from dsv4c.codegen.ops.attention import Compress, IndexScore, IndexTopk, KvWrite, SparseAttn
from dsv4c.codegen.ops.base import OpLowering
from dsv4c.codegen.ops.linear import GroupedLinear, Linear, LinearSplit, LmHead
from dsv4c.codegen.ops.mhc import HcExpand, HcMean, Mhc, MhcPost
from dsv4c.codegen.ops.misc import Add, Concat, Embed, Reshape
from dsv4c.codegen.ops.moe import Experts, MoeRoute, SharedExpert
from dsv4c.codegen.ops.norm import RmsNorm, RmsNormRope, Rope
from dsv4c.codegen.ops.v41 import (CandidateMask, Engram, HcCollapse, ImageSplice, MhcMix, SharedCompress,
                                   V41Roundtrip)
from dsv4c.codegen.ops.tensor_parallel import AllGather, AllReduce, ShardIds
from dsv4c.errors import UsageError


class Unsupported(OpLowering):
    """An op the compiled targets do not run yet: it has no matmul weights, and compiling a
    node of it is refused."""

    def kernels(self, node, cfg, plan):
        raise UsageError(f"the {plan.target} target does not compile op {node.op!r} yet (qat numerics / fused passes); "
                         "use --target reference or --numerics exact")


LOWERINGS: dict[str, OpLowering] = {
    "embed": Embed(),
    "hc_expand": HcExpand(),
    "hc_mean": HcMean(),
    "mhc_pre": Mhc(seam=False, head=False),
    "hc_head": Mhc(seam=False, head=True),
    "mhc_seam": Mhc(seam=True, head=False),
    "mhc_post_head": Mhc(seam=True, head=True),
    "mhc_post": MhcPost(),
    "rmsnorm": RmsNorm(),
    "rope": Rope(),
    "rmsnorm_rope": RmsNormRope(),
    "linear": Linear(),
    "linear_split": LinearSplit(),
    "grouped_linear": GroupedLinear(),
    "lm_head": LmHead(),
    "add": Add(),
    "concat": Concat(),
    "reshape": Reshape(),
    "kv_write": KvWrite(),
    "compress": Compress(),
    "index_score": IndexScore(),
    "index_topk": IndexTopk(),
    "sparse_attn": SparseAttn(),
    "moe_route": MoeRoute(),
    "experts": Experts(),
    "shared_expert": SharedExpert(),
    "shard_ids": ShardIds(),
    "all_reduce": AllReduce(),
    "all_gather": AllGather(),
    "mhc_mix": MhcMix(),
    "hc_collapse": HcCollapse(),
    "v41_roundtrip": V41Roundtrip(),
    "shared_compress": SharedCompress(),
    "candidate_mask": CandidateMask(),
    "engram": Engram(),
    "image_splice": ImageSplice(),
    **{op: Unsupported() for op in ("fp8_roundtrip", "fp4_roundtrip", "hadamard")},
}


def lowering_of(op: str) -> OpLowering:
    if op not in LOWERINGS:
        raise UsageError(f"the compiled targets (llvm and the GPU targets) have no lowering for op {op!r}")
    return LOWERINGS[op]
