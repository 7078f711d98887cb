"""The ``dsv4c`` command line.

User errors (bad config, checkpoint, artifact, arguments) print one line,
``dsv4c: error: ...``, and exit 2; they never show a traceback.
"""

from __future__ import annotations

import argparse
import sys

from dsv4c.errors import DsvError


def _cmd_make_tiny(args) -> int:
    from dsv4c.frontend.checkpoint import random_weights, write_checkpoint
    from dsv4c.frontend.config import load_config, preset

    cfg = load_config(args.config) if args.config else preset("tiny")
    out = write_checkpoint(cfg, random_weights(cfg, args.seed), args.out, progress=sys.stderr.isatty())
    print(f"wrote a random {cfg.name} model (seed {args.seed}, {cfg.num_layers} layers) to {out}")
    return 0


def _cmd_trace(args) -> int:
    from dsv4c.frontend.config import resolve_model
    from dsv4c.frontend.trace import trace

    program = trace(resolve_model(args.model), args.numerics)
    sys.stdout.write(str(program))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsv4c", description="Ahead-of-time compiler for DeepSeek-V4 models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("make-tiny", help="write a deterministic random model a user can compile and run")
    p.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    p.add_argument("--config", help="config.json to use instead of the built-in tiny preset")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.set_defaults(run=_cmd_make_tiny)

    p = sub.add_parser("trace", help="print the traced IR of a model")
    p.add_argument("--model", required=True, help="model directory, config.json, or preset (pro, flash, tiny)")
    p.add_argument("--numerics", choices=("exact", "qat"), default="exact",
                   help="exact: fp32 like transformers; qat: the official FP8/FP4 round trips")
    p.set_defaults(run=_cmd_trace)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except DsvError as e:
        print(f"dsv4c: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dsv4c: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
