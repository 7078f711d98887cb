"""The MoE ops: ``moe_route`` (gate, scores, expert ids and weights), ``experts`` (the routed
experts) and ``shared_expert``."""

from __future__ import annotations

from dsv4c.codegen.ops.base import (F32, I32, OpLowering, dense_compute, dense_quant, gemm_compute, input_shapes,
                                    kernel, matmul_kernels)


class MoeRoute(OpLowering):
    """The gate's logits (an fp32 matmul), their scores, each token's k experts (by hash of the
    token, or top-k of the scores plus a bias) and their weights."""

    weights, weight_role = slice(1, 2), "gate_gemv"

    def kernels(self, node, cfg, plan):
        a, ins = node.attrs, input_shapes(node)
        e, d = ins[1]
        out = {**matmul_kernels("gate_", e, d, self.weight_format(node, plan).name),
               "scores": kernel("route_scores", e, *([a["temp"]] if a.get("temp", 1.0) != 1.0 else [])),
               "weights": kernel("route_weights", e, a["k"], a["scale"])}
        if a["mode"] == "hash":
            out["select"] = kernel("hash_ids", ins[2][0], a["k"])
        else:
            out.update(bias=kernel("add_bias", e), select=kernel("topk_rows", a["k"]))
            if len(node.inputs) == 6:  # V4.1 with images: bias_vl on image positions (prefill only)
                out["image_bias"] = kernel("add_image_bias", e)
        return out

    def emit(self, em, node, roles, args):
        y = args[0]
        t = em.shape(y)[0]
        k, e = node.attrs["k"], node.inputs[1].type.shape[0]
        logits = em.matmul(roles, "gate_", y, em.weight(node.inputs[1].name, roles["gate_gemv"]), e)
        scores = em.call(roles["scores"], [logits], ([t, e], F32))
        if node.attrs["mode"] == "hash":
            ids = em.call(roles["select"], [em.param(node.inputs[2].name), em.inputs["tokens"]], ([t, k], I32))
        else:
            bias = em.param(node.inputs[2].name)
            if "image_index" in em.inputs and len(node.inputs) == 6:
                biased = em.call(roles["image_bias"], [scores, bias, em.param(node.inputs[4].name),
                                                       em.inputs["image_index"]], ([t, e], F32))
            else:  # the decode function: no token of its steps is an image span's
                biased = em.call(roles["bias"], [scores, bias], ([t, e], F32))
            ids = em.call(roles["select"], [biased], ([t, k], I32))
        weights = em.call(roles["weights"], [scores, ids], ([t, k], F32))
        return [weights, ids]

    def weight_format(self, node, plan):
        return plan.weight_format("fp32")  # the router's logits are exact: an fp32 gate


class Experts(OpLowering):
    """Routed (token, slot) pairs grouped by expert on the device, then each expert's matmuls
    over its group, then every token's experts added in ascending id order."""

    weights, weight_role = slice(3, 6), "up"

    def kernels(self, node, cfg, plan):
        ins = input_shapes(node)
        e, inter, d = ins[3]
        q, k = self.weight_format(node, plan).name, ins[2][1]
        # The prefill kernels' (up, down) compute: spelled out after decode=False in bf16 numerics only.
        bf16 = gemm_compute(plan.weights["expert"].compute)
        prefill = (False, *bf16) if bf16 else ()
        # The decode function's expert matmuls are kernels of their own on GPU targets (a GEMV
        # streaming the weights, kernels.gpu_gemv); the CPU builds one kernel for both.
        return {"group": kernel("moe_group", k, e), "act": kernel("swiglu", inter, node.attrs["limit"]),
                "up": kernel("expert_linear", inter, d, q, e, *prefill),
                "down": kernel("expert_linear", d, inter, q, e, *prefill),
                "up_gemv": kernel("expert_linear", inter, d, q, e, True),
                "down_gemv": kernel("expert_linear", d, inter, q, e, True), "combine": kernel("moe_combine", d, k)}

    def emit(self, em, node, roles, args):
        y, route_w, ids = args[:3]
        t, d = em.shape(y)
        k = em.shape(ids)[1]
        e, inter, _ = node.inputs[3].type.shape
        pairs = t * k
        grouped = em.call(roles["group"], [ids], [([e + 1], I32), ([pairs], I32), ([t, k], I32)])
        offsets, pair_token, token_pair = em.outputs(grouped, 3)
        xs = em.call("gather_rows", [y, pair_token], ([pairs, d], F32))
        w1, w2, w3 = (em.weight(v.name, roles["up"]) for v in node.inputs[3:6])
        up_role, down_role = ("up_gemv", "down_gemv") if em.gemv else ("up", "down")
        gate = em.call(roles[up_role], [xs, offsets] + w1, ([pairs, inter], F32))
        up = em.call(roles[up_role], [xs, offsets] + w3, ([pairs, inter], F32))
        act = em.call(roles["act"], [gate, up], ([pairs, inter], F32))
        down = em.call(roles[down_role], [act, offsets] + w2, ([pairs, d], F32))
        return [em.call(roles["combine"], [down, token_pair, route_w], ([t, d], F32))]

    def weight_format(self, node, plan):
        return plan.weight_format("expert")


class SharedExpert(OpLowering):
    weights, weight_role = slice(1, 4), "up_gemv"

    def kernels(self, node, cfg, plan):
        inter, d = input_shapes(node)[1]
        q, compute = dense_quant(node, plan), dense_compute(node, plan)
        return {**matmul_kernels("up_", inter, d, q, 0, compute), "act": kernel("swiglu", inter, node.attrs["limit"]),
                **matmul_kernels("down_", d, inter, q, 0, compute)}

    def emit(self, em, node, roles, args):
        y = args[0]
        t = em.shape(y)[0]
        w1, w2, w3 = node.inputs[1:4]
        inter = w1.type.shape[0]
        gate = em.matmul(roles, "up_", y, em.weight(w1.name, roles["up_gemv"]), inter)
        up = em.matmul(roles, "up_", y, em.weight(w3.name, roles["up_gemv"]), inter)
        act = em.call(roles["act"], [gate, up], ([t, inter], F32))
        return [em.matmul(roles, "down_", act, em.weight(w2.name, roles["down_gemv"]), w2.type.shape[0])]
