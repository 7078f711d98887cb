"""The pass manager: a named, ordered list of passes with the verifier after each one.

Passes are plain functions ``Program -> Program`` (they may rebuild functions in place).
``dsv4c compile`` runs :data:`PIPELINE`; ``--print-ir-after-all``, ``--print-ir-after NAME``,
``--disable-pass NAME`` and ``--verbose`` (per-pass timing and op counts) control it.
"""

from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, TextIO

from dsv4c.errors import UsageError
from dsv4c.ir.core import Program, format_program
from dsv4c.ir.verify import verify
from dsv4c.passes.fuse_mhc import fuse_mhc_seams
from dsv4c.passes.fuse_norm_rope import fuse_norm_rope
from dsv4c.passes.merge_projections import merge_projections
from dsv4c.passes.cleanup import eliminate_dead_code


@dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[[Program], Program]
    summary: str


PIPELINE: tuple[Pass, ...] = (
    Pass("fuse-mhc-seams", fuse_mhc_seams,
         "mhc_post of a sub-layer + mhc_pre of the next -> mhc_seam; the last post + hc_head -> mhc_post_head"),
    Pass("merge-projections", merge_projections,
         "linears reading the same input with the same storage -> one linear_split over concatenated weights"),
    Pass("fuse-norm-rope", fuse_norm_rope, "rmsnorm read only by a rope -> rmsnorm_rope (one pass over memory)"),
    Pass("dead-code", eliminate_dead_code, "drop nodes whose results nothing uses (effects are kept)"),
)
PASS_NAMES = tuple(p.name for p in PIPELINE)


@dataclass
class PipelineOptions:
    disable: set[str] = field(default_factory=set)
    print_ir_after_all: bool = False
    print_ir_after: set[str] = field(default_factory=set)
    verbose: bool = False
    stream: TextIO = field(default_factory=lambda: sys.stderr)

    def check(self) -> None:
        unknown = (self.disable | self.print_ir_after) - set(PASS_NAMES)
        if unknown:
            raise UsageError(f"unknown pass {sorted(unknown)[0]!r}; passes are: {', '.join(PASS_NAMES)}")


def op_count(program: Program) -> int:
    return sum(len(f.nodes) for f in program.functions.values())


def run_pipeline(program: Program, options: PipelineOptions | None = None) -> Program:
    """Run every enabled pass on a copy of ``program``; verify after each."""
    options = options or PipelineOptions()
    options.check()
    program = copy.deepcopy(program)
    if options.verbose:
        print(f"[passes] traced program: {op_count(program)} ops", file=options.stream)
    for p in PIPELINE:
        if p.name in options.disable:
            if options.verbose:
                print(f"[passes] {p.name}: disabled", file=options.stream)
            continue
        start = time.perf_counter()
        before = op_count(program)
        program = p.run(program)
        verify(program)
        elapsed = time.perf_counter() - start
        if options.verbose:
            print(f"[passes] {p.name}: {before} -> {op_count(program)} ops in {elapsed * 1e3:.1f} ms",
                  file=options.stream)
        if options.print_ir_after_all or p.name in options.print_ir_after:
            print(f"// ----- IR after {p.name}", file=options.stream)
            print(format_program(program), file=options.stream)
    return program
