"""Compile times of the full pro and flash structure (no weights) for every target.

Kernels are shared across layers, so the build cost is a few dozen kernels whatever the depth.
Each compile runs in its own process (as a user would run it); the issue's budget is 120 s
per compile on 2 cores.

    python bench/compile_times.py [--targets sm90 gfx942 gfx950 llvm] [--models pro flash]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", nargs="+", default=["sm90", "gfx942", "gfx950", "llvm"])
    p.add_argument("--models", nargs="+", default=["pro", "flash"])
    args = p.parse_args()
    print(f"{'model':<8}{'target':<9}{'wall s':>8}{'kernels':>9}{'kernel build s':>16}")
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            for target in args.targets:
                out = Path(tmp) / f"{model}-{target}"
                start = time.perf_counter()
                done = subprocess.run([sys.executable, "-m", "dsv4c", "compile", "--model", model, "--target", target,
                                       "--no-weights", "-o", str(out)], capture_output=True, text=True)
                wall = time.perf_counter() - start
                if done.returncode:
                    print(f"{model:<8}{target:<9}  failed: {done.stderr.strip().splitlines()[-1]}")
                    continue
                from dsv4c.artifact.manifest import read_manifest

                kernels = read_manifest(out).kernels
                print(f"{model:<8}{target:<9}{wall:>8.1f}{kernels.count:>9}{kernels.build_seconds:>16.1f}")


if __name__ == "__main__":
    main()
