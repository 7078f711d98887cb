"""Constrained decoding's cost: decode time per token of a chat request with and without its
grammar (``response_format`` json_schema, a forced tool call), on the flash slice, in one run.

The slice (``bench/flash_slice.py``'s model) has random weights and no tokenizer; the grammars
need V4's special tokens, so the bench gives it a byte-level BPE tokenizer of the slice's
vocabulary size (trained on Python's standard library and V4's DSML markers) in a directory of
links to the compiled artifact. Each case runs its prompt twice per round, without and with the
constraint, the same number of new tokens (no stop tokens), sampled at temperature 1 with the
same seed. Decode per token is the median time between two new tokens after the first (which
prefill makes). Printed per case: both decode times (medians over rounds), the median of each
round's ratio, the constraint's own time per token (computing the mask, applying it, following
the token; llguidance's mask computation and following the token apart) and how many tokens the
grammar was still open for (a grammar that has ended allows only EOS, which costs next to nothing).

    python bench/constrained.py [--workdir DIR] [--tokens 64] [--rounds 3] [--json out.json]

``--workdir`` holds the slice as ``flash_slice.py`` leaves it (``fp8/``, ``artifact/``); what is
missing is made there (default: a new temporary directory).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
USER = [{"role": "user", "content": "Plan a three-day trip to Paris and check the weather there."}]
ITINERARY = {"type": "object", "additionalProperties": False, "required": ["city", "days", "notes"],
             "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 9},
                            "notes": {"type": "array", "items": {"type": "string"}}}}
WEATHER = {"type": "object", "required": ["city", "unit"],
           "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 9}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
CASES = {
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "trip", "schema": ITINERARY}}},
    "tool_call": {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
}
# Text in V4's protocol, so that its markers are tokens the grammars meet as they would in V4's vocabulary.
DSML = ["<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>", '<｜DSML｜invoke name="get_weather">',
        "</｜DSML｜invoke>", '<｜DSML｜parameter name="city" string="true">', "</｜DSML｜parameter>",
        '{"city": "Paris", "days": 3}']


def chat_artifact(workdir: Path) -> Path:
    """The slice's artifact with a V4 tokenizer beside it (links to its files; made once)."""
    artifact, view = workdir / "artifact", workdir / "chat-artifact"
    for stage, done in (("make", "fp8"), ("compile", "artifact")):
        if not (workdir / done).exists():
            subprocess.run([sys.executable, str(REPO / "bench" / "flash_slice.py"), "--stage", stage, "--workdir",
                            str(workdir)], check=True)
    if not (view / "tokenizer.json").exists():
        sys.path.insert(0, str(REPO / "tests"))
        from v4_tokenizer import write_v4_tokenizer

        view.mkdir(exist_ok=True)
        for f in artifact.iterdir():
            (view / f.name).unlink(missing_ok=True)
            (view / f.name).symlink_to(f.resolve())
        stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
        corpus = [f.read_text(errors="replace") for f in stdlib] + DSML * 100
        from dsv4c.artifact.directory import open_artifact

        vocab = open_artifact(artifact).config.vocab_size
        write_v4_tokenizer(view, corpus, vocab)
    return view


class Timed:
    """A request's constraint, with the time it takes per token: all of it, and within it
    llguidance's mask computation (``compute_bitmask``) and following the token taken."""

    def __init__(self, constraint):
        self.constraint, self.matcher = constraint, constraint.matcher
        constraint.matcher = self
        self.seconds, self.bitmask_seconds, self.accept_seconds, self.open = 0.0, 0.0, 0.0, 0

    def __getattr__(self, name):  # the rest of the matcher's API, untimed
        return getattr(self.matcher, name)

    def compute_bitmask(self):
        start = time.perf_counter()
        try:
            return self.matcher.compute_bitmask()
        finally:
            self.bitmask_seconds += time.perf_counter() - start

    def mask(self, logits):
        start = time.perf_counter()
        self.open += not self.matcher.is_stopped()
        out = self.constraint.mask(logits)
        self.seconds += time.perf_counter() - start
        return out

    def accept(self, token):
        start = time.perf_counter()
        self.constraint.accept(token)
        self.accept_seconds += time.perf_counter() - start
        self.seconds += time.perf_counter() - start


def decode(engine, prompt: list[int], params) -> float:
    """Seconds per decoded token: the median time between two new tokens (after the first, which
    prefill makes); the median, because other jobs on a shared machine stall some steps."""
    times = []
    engine.generate(prompt, params, on_token=lambda _r, _t: times.append(time.perf_counter()))
    assert len(times) == params.max_new_tokens, len(times)
    return statistics.median(b - a for a, b in zip(times, times[1:]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", type=Path)
    p.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    args = p.parse_args()
    from dsv4c.runtime.engine import Engine
    from dsv4c.runtime.sampling import SamplingParams
    from dsv4c.runtime.serve.chat import ChatProtocol, chat_options
    from dsv4c.targets import host_cpu_flags

    engine = Engine(chat_artifact(args.workdir or Path(tempfile.mkdtemp(prefix="dsv4c-constrained-"))),
                    max_requests=1, max_context=1024)
    chat = ChatProtocol.of(engine, None)
    chat.grammar.get()  # built once per server: not a request's cost
    sampling = dict(max_new_tokens=args.tokens, temperature=1.0, seed=0)
    engine.generate([0, 2, 3], SamplingParams(max_new_tokens=2))  # warm up
    host = host_cpu_flags()
    report = {"cpu": host.model if host else None, "tokens": args.tokens, "rounds": args.rounds, "cases": {}}
    for name, body in CASES.items():
        options = chat_options(body)
        prompt = engine.tokenizer.encode(chat.prompt_text(USER, options), add_special_tokens=False).ids
        plain, constrained, own, bitmask, accept, open_tokens = [], [], [], [], [], []
        for _ in range(args.rounds):
            plain.append(decode(engine, prompt, SamplingParams(**sampling)))
            timed = Timed(chat.constraint(options))
            constrained.append(decode(engine, prompt, SamplingParams(**sampling, logits_processor=timed)))
            own.append(timed.seconds / args.tokens)
            bitmask.append(timed.bitmask_seconds / args.tokens)
            accept.append(timed.accept_seconds / args.tokens)
            open_tokens.append(timed.open)
        fig = {"prompt_tokens": len(prompt), "decode_ms": 1e3 * statistics.median(plain),
               "constrained_decode_ms": 1e3 * statistics.median(constrained),
               "constraint_ms": 1e3 * statistics.median(own), "compute_bitmask_ms": 1e3 * statistics.median(bitmask),
               "accept_ms": 1e3 * statistics.median(accept),
               "grammar_open_tokens": open_tokens}
        # Per round (the two runs minutes apart at most): the machine's speed drifts more than that.
        fig["ratio"] = statistics.median(c / p for c, p in zip(constrained, plain))
        fig["constraint_share"] = statistics.median(o / c for o, c in zip(own, constrained))
        report["cases"][name] = fig
        print(f"{name}: {fig['prompt_tokens']}-token prompt, decode {fig['decode_ms']:.1f} ms/token, constrained "
              f"{fig['constrained_decode_ms']:.1f} ms/token (median ratio per round x{fig['ratio']:.3f}); the "
              f"constraint's own {fig['constraint_ms']:.3f} ms/token ({100 * fig['constraint_share']:.2f}% of decode: "
              f"{fig['compute_bitmask_ms']:.3f} in compute_bitmask, {fig['accept_ms']:.3f} following the token); "
              f"grammar open for {open_tokens} of {args.tokens} tokens",
              flush=True)
    print(f"CPU: {report['cpu']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
