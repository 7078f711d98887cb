"""``encode_image``: DeepSeek-V4.1's vision tower and aligner as a Relax function of the step's
module (docs/vision.md), taking the pixels of one image and returning its span's rows.

``encode_image(pixels: f32[3, H, W], params) -> f32[span tokens, text hidden]``: the patches,
the ViT's blocks (rmsnorm, fused QKV with its bias, the 2-D rope, dense bidirectional attention,
the output projection, rmsnorm, SwiGLU), the final norm, the aligner's r x r merge and its
two-layer GELU MLP, then the span's rows with the learned start / newline / end rows. It reads
the same ``params`` tuple as the step functions (the tower's weights follow the text model's):
the linear weights BF16 in column tiles, as the release stores them, multiplied by the text
model's matmul kernels; everything else float32. H and W are symbolic, so the function's
memory is allocated per call (the compiled bound on patches, ``VisionTower.max_patches``, is
checked by the runtime).
"""

from __future__ import annotations

from tvm import relax, tirx

from dsv4c.artifact.quant import BF16, FP32
from dsv4c.artifact.vision import ENCODE_IMAGE, VisionGeometry, VisionTower, vision_tensors
from dsv4c.codegen.kernels.vision import padded_keys
from dsv4c.codegen.lowering import WeightLayout
from dsv4c.codegen.ops.base import F32, KernelSpec, kernel
from dsv4c.codegen.relax_step import _Emitter

ROPE_CONSTANT = "const.rope.vision"
# The SwiGLU kernel clamps at swiglu_limit; the tower's SwiGLU has none.
NO_LIMIT = 3.0e38


def vision_layouts(geometry: VisionGeometry, tower: VisionTower) -> dict[str, WeightLayout]:
    """The tower's weights in the artifact: the multiplied ones BF16 in column tiles (the matmul
    kernels' layout), the rest float32."""
    from dsv4c.codegen.kernels.formats import column_tile

    return {name: WeightLayout(name, shape, BF16, column_tile(shape[0])) if multiplied
            else WeightLayout(name, shape, FP32)
            for name, (shape, multiplied) in vision_tensors(geometry, tower).items()}


def vision_params(geometry: VisionGeometry, tower: VisionTower) -> list[tuple[str, tuple, str]]:
    """(name, shape, dtype) of the tower's entries of the params tuple, then its rope table."""
    from dsv4c.codegen.kernels.formats import tir_format

    out = []
    for name, (shape, multiplied) in vision_tensors(geometry, tower).items():
        if multiplied:
            (part_shape, dtype), = tir_format(BF16.name).parts(*shape)
            out.append((name, part_shape, dtype))
        else:
            out.append((name, shape, F32))
    return out + [(ROPE_CONSTANT, (tower.rope_pairs,), F32)]


def vision_constants(tower: VisionTower) -> dict:
    """The constants encode_image reads beside the weights: the 2-D rope's frequencies."""
    import numpy as np

    return {ROPE_CONSTANT: ("F32", np.asarray(tower.inv_freq(), np.float32))}


def _roles(geometry: VisionGeometry, tower: VisionTower) -> dict[str, KernelSpec]:
    d, i, t = tower.hidden_size, tower.intermediate_size, geometry.text_hidden
    p, r = geometry.patch_size, geometry.downsample_ratio
    matmuls = {"patch": (d, 3 * p * p), "qkv": (3 * d, d), "wo": (d, d), "w1": (2 * i, d), "w2": (d, i),
               "align1": (t, d * r * r), "align2": (t, t)}
    # GEMM kernels only (``_Emitter.matmul`` with gemv off): one image is many rows.
    roles = {f"{role}_gemm": kernel("linear", o, n, BF16.name, False, 0) for role, (o, n) in matmuls.items()}
    roles.update(
        patches=kernel("vision_patches", p), norm=kernel("rmsnorm", d, tower.norm_eps, True),
        **{f"bias_{w}": kernel("add_bias", w) for w in (d, 3 * d, t)}, gelu_t=kernel("vision_gelu", t),
        rope=kernel("vision_rope", tower.num_heads, tower.head_dim),
        attention=kernel("vision_attention", tower.num_heads, tower.head_dim),
        add=kernel("add", d), swiglu=kernel("swiglu", i, NO_LIMIT), merge=kernel("vision_merge", d, r),
        span=kernel("vision_span", t))
    return roles


def vision_kernels(geometry: VisionGeometry, tower: VisionTower) -> dict[str, KernelSpec]:
    """The distinct kernels encode_image calls, by symbol."""
    return {spec.symbol: spec for spec in _roles(geometry, tower).values()}


class VisionEmitter(_Emitter):
    """The step emitter's helpers (calls, views, params, GEMMs over padded row blocks) for a
    function that is not an IR function."""

    def __init__(self, bb: relax.BlockBuilder, gvars: dict, params: list[tuple[str, tuple, str]]):
        self.bb, self.gvars, self.gemv, self.cuda_graph = bb, gvars, False, False
        self.param_index = {name: i for i, (name, _, _) in enumerate(params)}
        self.param_types = [(shape, dtype) for _, shape, dtype in params]
        self._params: dict[str, relax.Var] = {}
        self.call_families: list[dict[str, float]] = []
        self.families = {"vision": 1.0}

    def linear(self, roles: dict, role: str, x: relax.Var, name: str, out_dim: int, bias: str | None = None):
        """x @ W.T (+ the bias ``bias``) by the GEMM kernel of ``role``."""
        y = self.matmul(roles, f"{role}_", x, [self.param(name)], out_dim)
        if bias is None:
            return y
        return self.call(kernel("add_bias", out_dim), [y, self.param(bias)], (self.shape(y), F32))

    def encode_image(self, geometry: VisionGeometry, tower: VisionTower) -> None:
        roles = _roles(geometry, tower)
        bb, p, r = self.bb, geometry.patch_size, geometry.downsample_ratio
        d, i, t, heads = tower.hidden_size, tower.intermediate_size, geometry.text_hidden, tower.num_heads
        h_var, w_var = tirx.Var("H", "int64"), tirx.Var("W", "int64")
        pixels = relax.Var("pixels", relax.TensorType([3, h_var, w_var], F32))
        self.params_var = relax.Var("params", relax.TupleType(
            [relax.TensorType(list(shape), dtype) for shape, dtype in self.param_types]))
        gh, gw = tirx.floordiv(h_var, p), tirx.floordiv(w_var, p)
        n = gh * gw
        mh, mw = tirx.floordiv(gh + r - 1, r), tirx.floordiv(gw + r - 1, r)
        with bb.function(ENCODE_IMAGE, [pixels, self.params_var], attrs={"relax.force_pure": True}):
            x = self.call(roles["patches"], [self.view(pixels, [3, gh, p, gw, p])], ([n, 3 * p * p], F32))
            h = self.linear(roles, "patch", x, "vision.patch_embed.proj.weight", d, "vision.patch_embed.proj.bias")
            for layer in range(tower.num_layers):
                b = f"vision.blocks.{layer}."
                a = self.call(roles["norm"], [h, self.param(b + "norm1.weight")], ([n, d], F32))
                qkv = self.linear(roles, "qkv", a, b + "attn.wqkv.weight", 3 * d, b + "attn.wqkv.bias")
                # The rope writes the queries and values as planes, the keys transposed per head.
                qv_kt = self.call(roles["rope"], [self.view(qkv, [gh, gw, 3, heads, tower.head_dim]),
                                                  self.param(ROPE_CONSTANT)],
                                  [([2, n, heads, tower.head_dim], F32),
                                   ([heads, tower.head_dim, padded_keys(n)], F32)])
                o = self.call(roles["attention"], [bb.emit(relax.TupleGetItem(qv_kt, i)) for i in (0, 1)],
                              ([n, d], F32))
                h = self.call(roles["add"], [h, self.linear(roles, "wo", o, b + "attn.wo.weight", d,
                                                            b + "attn.wo.bias")], ([n, d], F32))
                m = self.call(roles["norm"], [h, self.param(b + "norm2.weight")], ([n, d], F32))
                gu = self.linear(roles, "w1", m, b + "mlp.w1.weight", 2 * i)
                gate, up = (self.call("slice_columns", [gu, relax.prim_value(tirx.IntImm("int64", s))], ([n, i], F32))
                            for s in (0, i))
                s = self.call(roles["swiglu"], [gate, up], ([n, i], F32))
                h = self.call(roles["add"], [h, self.linear(roles, "w2", s, b + "mlp.w2.weight", d)], ([n, d], F32))
            h = self.call(roles["norm"], [h, self.param("vision.norm.weight")], ([n, d], F32))
            merged = self.call(roles["merge"], [self.view(h, [gh, gw, d])], ([mh, mw, d * r * r], F32))
            e = self.matmul(roles, "align1_", self.view(merged, [mh * mw, d * r * r]),
                            [self.param("aligner.w1.weight")], t)
            e = self.call(roles["gelu_t"], [e, self.param("aligner.w1.bias")], ([mh * mw, t], F32))
            e = self.linear(roles, "align2", e, "aligner.w2.weight", t, "aligner.w2.bias")
            rows = self.call(roles["span"], [self.view(e, [mh, mw, t])] +
                             [self.param(m) for m in ("image_start", "image_newline", "image_end")],
                             ([mh * (mw + 1) + 2, t], F32))
            bb.emit_func_output(rows)
