"""What a decode token costs on a target: the traced step after the passes, each node costed by
its op's rule (``ir.cost``), summed by family; and the same for DeepSeek-V3.2, the model V4's
report measures itself against (``frontend.v32``). ``dsv4c inspect --cost`` prints it."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from dsv4c.ir.cost import FAMILIES, Cost, Decode, function_cost, node_costs, total


@dataclass(frozen=True)
class TokenCost:
    model: str
    target: str
    context: int
    batch: int
    by_family: dict[str, Cost]  # per decode token
    kv_bytes_per_token: float  # the pool bytes each token of context keeps
    speculation: "SpeculationCost | None" = None  # what the model's drafter costs and buys

    @property
    def total(self) -> Cost:
        return total(self.by_family)

    def to_json(self) -> dict:
        t = self.total
        return {
            "model": self.model, "target": self.target, "context": self.context, "batch": self.batch,
            "decode_flops_per_token": t.flops,
            "decode_bytes_per_token": t.bytes_read,
            "decode_bytes_written_per_token": t.bytes_written,
            "bytes_per_token": self.kv_bytes_per_token,
            "cost_by_family": {f: {"flops": c.flops, "bytes_read": c.bytes_read, "bytes_written": c.bytes_written}
                               for f, c in self.by_family.items()},
            **({"speculation": self.speculation.to_json()} if self.speculation else {}),
        }


ACCEPTANCES = (0.5, 0.7, 0.9)  # the acceptance rates ``inspect --cost`` prices speculation at


@dataclass(frozen=True)
class SpeculationCost:
    """What speculative decoding with the model's drafter reads per request, beside a plain decode
    step (decode is bandwidth-bound: bytes read stand for time). A verify step carrying k drafts
    is a step of k + 1 tokens: the dense weights once, the routed experts of all k + 1 tokens
    (``ir.cost.experts_touched``), attention and the rest per token. Drafting k tokens is, for
    DSpark, one ``dspark_draft`` call over the block's B rows and k ``dspark_markov`` calls; for
    MTP, k calls of the MTP layer."""

    method: str
    plain: float  # bytes a plain decode step reads per request
    rounds: dict[int, tuple[float, float]]  # drafts k -> (verify step, drafting) bytes per request

    def speedup(self, drafts: int, acceptance: float) -> float:
        """Decode tokens per byte against plain decoding, when each draft is accepted with
        probability ``acceptance`` given that the ones before it were: a round yields
        1 + a + ... + a^k tokens."""
        verify, draft = self.rounds[drafts]
        return sum(acceptance ** i for i in range(drafts + 1)) * self.plain / (verify + draft)

    def to_json(self) -> dict:
        return {"method": self.method, "plain_step_bytes": self.plain,
                "rounds": [{"drafts": k, "verify_step_bytes": v, "drafting_bytes": dr,
                            "speedup": {str(a): round(self.speedup(k, a), 4) for a in ACCEPTANCES}}
                           for k, (v, dr) in self.rounds.items()]}


def speculation_cost(program, cfg, d: Decode) -> SpeculationCost | None:
    """The drafter's :class:`SpeculationCost` at decode step ``d`` (None without a drafter)."""
    functions = program.functions

    def read(name: str, batch: int) -> float:
        return total(function_cost(functions[name], replace(d, batch=batch))).bytes_read / d.batch

    if "dspark_draft" in functions:
        block = cfg.dspark.block_size
        draft, markov = read("dspark_draft", d.batch * block), read("dspark_markov", d.batch)
        method, drafting = "dspark", {k: draft + k * markov for k in range(1, block + 1)}
    elif "mtp0" in functions:
        method, drafting = "mtp", {k: k * read("mtp0", d.batch) for k in (1, 2)}
    else:
        return None
    return SpeculationCost(method, read("step", d.batch),
                           {k: (read("step", d.batch * (k + 1)), cost) for k, cost in drafting.items()})


def _per_token(costs: dict[str, Cost], batch: int) -> dict[str, Cost]:
    return {f: c.scaled(1 / batch) for f, c in costs.items()}


def decode_cost(model: str, target: str = "llvm", context: int = 4096, batch: int = 1, numerics: str = "exact",
                kv_cache_dtype: str = "auto") -> TokenCost:
    """The cost of one decode token of ``model`` (a preset, config or model directory; ``v3.2``
    too) at ``context`` tokens, in a step of ``batch`` requests."""
    from dsv4c.artifact.pool import PoolGeometry
    from dsv4c.frontend import v32
    from dsv4c.frontend.config import preset, resolve_model
    from dsv4c.passes.quant_plan import plan_for

    if model == v32.NAME:
        # V3.2 keeps its cache rows in the storage the target's plan gives V4's rows (FP8 where
        # V4's are FP8: the report's footing for both).
        plan = plan_for(preset("flash"), target, numerics, kv_cache_dtype)
        cfg = v32.v32_preset()
        d = v32.v32_decode(cfg, batch, context, plan.main_kv.storage, plan.index_kv.storage, plan.fp8_format)
        return TokenCost(v32.NAME, target, context, batch, _per_token(v32.v32_cost(cfg, d), batch),
                         v32.kv_bytes_per_token(cfg, d))

    from dsv4c.frontend.trace import trace
    from dsv4c.passes.pipeline import run_pipeline

    cfg = resolve_model(model)
    plan = plan_for(cfg, target, numerics, kv_cache_dtype)
    geometry = PoolGeometry.build(cfg, plan)
    program = run_pipeline(trace(cfg, numerics))
    d = Decode(batch, context, plan.main_kv.row_bytes, plan.index_kv.row_bytes, plan.fp8_format)
    return TokenCost(cfg.name, target, context, batch, _per_token(function_cost(program.functions["step"], d), batch),
                     sum(geometry.bytes_per_token().values()), speculation_cost(program, cfg, d))


def artifact_step_costs(artifact: Path, config, geometry, batch: int, context: int) -> list[tuple[str, Cost]]:
    """(family, cost) of every node (merged projections part by part) of a compiled artifact's
    step (its program, after the passes) for a decode step of ``batch`` requests at ``context``,
    in the pool row and FP8 formats of its pool ``geometry`` (``artifact.pool.PoolGeometry``)."""
    from dsv4c.artifact.file_names import PROGRAM
    from dsv4c.ir.serialize import program_from_json

    program = program_from_json(json.loads((Path(artifact) / PROGRAM).read_text()), config)
    d = Decode(batch, context, geometry.main_row_bytes, geometry.index_row_bytes, geometry.fp8_format)
    return [part for node in program.functions["step"].nodes for part in node_costs(node, d)]


def roofline_seconds(parts: list[tuple[str, Cost]], bytes_per_s: float, flops_per_s: float) -> dict[str, float]:
    """Predicted seconds by family (every family, in :data:`FAMILIES` order): each node takes the
    longer of moving its bytes (read and written) at ``bytes_per_s`` and doing its FLOPs at
    ``flops_per_s``; nodes run one after another."""
    out = dict.fromkeys(FAMILIES, 0.0)
    for family, c in parts:
        out[family] += max((c.bytes_read + c.bytes_written) / bytes_per_s, c.flops / flops_per_s)
    return out


def format_cost(c: TokenCost) -> list[str]:
    """The text ``dsv4c inspect --cost`` prints: per family FLOPs, bytes read and their shares."""
    t = c.total
    lines = [f"{c.model} on {c.target}: one decode token at context {c.context:,} (batch {c.batch})",
             f"  {'family':<34} {'GFLOP':>10} {'share':>6} {'MB read':>11} {'share':>6}"]
    for family, cost in c.by_family.items():
        if cost.flops or cost.bytes_read:
            lines.append(f"  {FAMILIES[family]:<34} {cost.flops / 1e9:>10.3f} {share_text(cost.flops, t.flops):>6} "
                         f"{cost.bytes_read / 1e6:>11.2f} {share_text(cost.bytes_read, t.bytes_read):>6}")
    lines.append(f"  {'total':<34} {t.flops / 1e9:>10.3f} {'':>6} {t.bytes_read / 1e6:>11.2f}")
    lines.append(f"  KV bytes per token of context: {c.kv_bytes_per_token:,.1f}")
    s = c.speculation
    if s is not None:
        rates = " / ".join(str(a) for a in ACCEPTANCES)
        lines += [f"speculative decoding with {s.method}, bytes read per request against a plain step "
                  f"({s.plain / 1e6:,.2f} MB; bandwidth-bound)",
                  f"  {'drafts':>6} {'verify step':>12} {'drafting':>9}   speedup at acceptance {rates}"]
        for k, (verify, draft) in s.rounds.items():
            speedups = " / ".join(f"{s.speedup(k, a):.2f}x" for a in ACCEPTANCES)
            lines.append(f"  {k:>6} {verify / s.plain:>11.2f}x {draft / s.plain:>8.2f}x   {speedups}")
    return lines


def share_text(part: float, whole: float) -> str:
    """A percentage of ``whole``, or "-" when it is 0."""
    return f"{100 * part / whole:5.1f}%" if whole else "-"
