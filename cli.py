"""The ``dsv4c`` command line.

User errors (bad config, checkpoint, artifact, arguments) print one line,
``dsv4c: error: ...``, and exit 2; they never show a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from dsv4c import cli_inspect
from dsv4c.errors import DsvError
from dsv4c.targets import COMPILED_TARGETS, TARGETS


def _cmd_make_tiny(args) -> int:
    from dsv4c.frontend.checkpoint_writer import write_checkpoint
    from dsv4c.frontend.random_model import iter_random_weights
    from dsv4c.frontend.config import resolve_model

    cfg = resolve_model(args.config or "tiny")
    out = write_checkpoint(cfg, iter_random_weights(cfg, args.seed), args.out, progress=sys.stderr.isatty())
    extras = f", a DSpark drafter of {len(cfg.mtp_layers)} stage(s)" if cfg.dspark is not None else ""
    if cfg.engram is not None:  # its compressed vocabulary comes from a tokenizer
        from dsv4c.frontend.byte_tokenizer import write_byte_tokenizer
        from dsv4c.frontend.engram import engram_tables

        write_byte_tokenizer(out, cfg.vocab_size)
        engram_tables(cfg, out)  # a config whose Engram fields this tokenizer does not fit fails here
        extras += ", a byte-level tokenizer"
    print(f"wrote a random {cfg.name} model (seed {args.seed}, {cfg.num_layers} layers{extras}) to {out}")
    return 0


def _cmd_trace(args) -> int:
    from dsv4c.frontend.config import resolve_model
    from dsv4c.frontend.trace import trace

    program = trace(resolve_model(args.model), args.numerics)
    sys.stdout.write(str(program))
    return 0


def _parse_bytes(text: str) -> int:
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    t = text.strip().upper()
    num = t.rstrip("KMGTIB")
    try:
        return int(float(num) * units[t[len(num):]])
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} (e.g. 80GiB, 512MiB)") from None


def _cmd_compile(args) -> int:
    from dsv4c.compile import compile_model
    from dsv4c.passes.pipeline import PipelineOptions

    passes = PipelineOptions(disable=set(args.disable_pass or ()), print_ir_after_all=args.print_ir_after_all,
                             print_ir_after=set(args.print_ir_after or ()), verbose=args.verbose)
    compile_model(args.model, args.target, args.output, numerics=args.numerics, no_weights=args.no_weights,
                  passes=passes, kv_cache_dtype=args.kv_cache_dtype, cpu=args.cpu,
                  tensor_parallel=args.tensor_parallel, expert_parallel=args.expert_parallel,
                  draft_model=args.draft_model)
    return 0


def _cmd_export(args) -> int:
    from pathlib import Path

    from dsv4c.errors import UsageError
    from dsv4c.frontend.config import resolve_model
    from dsv4c.frontend.trace import trace

    if args.format != "onnx":
        raise UsageError(f"unknown export format {args.format!r}; formats: onnx")
    if args.target is not None and not args.after_passes:
        raise UsageError("--target only applies with --after-passes (the traced program is the same for every target)")
    if args.with_weights and not Path(args.model).is_dir():
        raise UsageError(f"--with-weights needs a model directory (e.g. from `dsv4c make-tiny`), got {args.model!r}")
    from dsv4c.ir.onnx_io import write_onnx  # a one-line error where onnx is not installed

    from dsv4c.frontend.draft_model import resolve_drafter

    cfg = resolve_drafter(resolve_model(args.model), Path(args.model) if args.with_weights else None, None)
    program, stage = trace(cfg, args.numerics), "traced"
    if args.after_passes:
        from dsv4c.passes.pipeline import run_pipeline
        from dsv4c.targets import target_info

        target = target_info(args.target or "llvm").name
        # The pipeline is the same for every target today; the target is recorded with the stage.
        program, stage = run_pipeline(program), f"after passes for {target}"
    weights = None
    if args.with_weights:
        from dsv4c.frontend.checkpoint import load_weights
        from dsv4c.passes.merge_projections import base_weight_names, materialize_weights

        base = load_weights(cfg, args.model, base_weight_names(program), progress=sys.stderr.isatty())
        weights = materialize_weights(program, base)
    out = write_onnx(program, args.output, weights, stage)
    extra = f", weights in {out.name}.data" if weights is not None else ""
    print(f"exported {cfg.name} ({stage}, {args.numerics}) to {out}{extra}")
    return 0


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--token-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--token-ids is empty")
    return ids


def _speculative_kwargs(args) -> dict:
    return {"speculative": args.speculative, "num_draft_tokens": args.num_draft_tokens,
            "draft_confidence": args.draft_confidence}


def _speculative_args(p: argparse.ArgumentParser) -> None:
    from dsv4c.runtime.speculative import METHODS

    p.add_argument("--speculative", choices=METHODS,
                   help="speculative decoding: draft with the model's MTP layer (mtp) or DSpark block drafter "
                        "(dspark), verify in the decode step (outputs are those of plain decoding)")
    p.add_argument("--num-draft-tokens", type=int,
                   help="drafts per decode step with --speculative: with mtp more than 1 chains the MTP layer "
                        "(default 1); with dspark at most the drafter's block size (default the block size)")
    p.add_argument("--draft-confidence", type=float, default=0.0, metavar="T",
                   help="with --speculative dspark: a block's drafts stop at the first one the drafter's confidence "
                        "head rates below T, in [0, 1] (default 0: every draft is verified)")


def _weights_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", choices=("auto", "read", "map"), default="auto",
                   help="read the weights into memory (on the CPU, huge pages: faster decode) or map the files "
                        "(fast start, pages load as first used); auto reads on the CPU when they take at most half "
                        "the available memory (default auto)")
    p.add_argument("--engram-memory", default="map", metavar="map|read",
                   help="a V4.1 model's Engram tables: map their files (a step reads the rows its n-grams hash to; "
                        "a table need not fit in memory) or read them into memory first (default map)")


def _pool_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-cache-memory", type=_parse_bytes,
                   help="memory of the KV pool all requests share, e.g. 8GiB (default: room for --max-requests "
                        "requests of --max-context tokens and as much again for cached prefixes)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="recompute every prompt (by default requests share the pool rows of the 256-token blocks "
                        "their prompts start with)")


def _distributed_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-tp", "--tensor-parallel", type=int, metavar="N",
                   help="ranks the artifact runs on (it was compiled with --tensor-parallel N: one process per rank "
                        "is started; checked against the artifact when given)")
    p.add_argument("--distributed-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="with several ranks: how long a collective waits for a rank before the engine stops with "
                        "an error (default 60)")


def _image_args(p: argparse.ArgumentParser, files: str) -> None:
    from dsv4c.runtime.vision.intake import DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_IMAGES

    p.add_argument("--allowed-image-dir", metavar="DIR", help=f"image files (file:// URLs) are read only from under "
                   f"DIR, symlinks resolved (default: {files})")
    p.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS, metavar="N",
                   help=f"images with more pixels are refused, from their header "
                        f"(default {DEFAULT_MAX_IMAGE_PIXELS:,})")
    p.add_argument("--max-images-per-request", type=int, default=DEFAULT_MAX_IMAGES, metavar="N",
                   help=f"requests with more images are refused (default {DEFAULT_MAX_IMAGES})")


def _image_intake(args, relative_to: Path | None = None, allowed_dir: Path | None = None):
    from dsv4c.runtime.vision.intake import ImageIntake

    return ImageIntake(args.max_image_pixels, args.max_images_per_request,
                       args.allowed_image_dir or allowed_dir, relative_to)


def _engine_ranks(args) -> dict:
    return {"tensor_parallel": args.tensor_parallel, "distributed_timeout": args.distributed_timeout}


def _cmd_generate(args) -> int:
    import numpy as np

    from dsv4c.artifact.manifest import read_manifest
    from dsv4c.errors import UsageError
    from dsv4c.runtime.engine import Engine
    from dsv4c.runtime.sampling import SamplingParams
    from dsv4c.runtime.serve.chat import count_image_parts, messages_prompt, read_messages

    if args.greedy and (args.temperature is not None or args.top_p is not None):
        raise UsageError("--greedy cannot be combined with --temperature / --top-p")
    temperature = 0.0 if args.greedy or args.temperature is None else args.temperature
    if temperature == 0 and args.top_p is not None:
        raise UsageError("--top-p needs --temperature > 0")
    # Size the pool for this request: a text prompt has at most one token per character (+ specials),
    # an image at most its span's positions.
    messages = read_messages(args.messages) if args.messages is not None else None
    if args.thinking and messages is None:
        raise UsageError("--thinking goes with --messages")
    text_prompt = args.prompt if messages is None else json.dumps(messages)
    prompt_bound = len(args.token_ids) if args.token_ids is not None else len(text_prompt) + 1024
    if messages is not None and (images := count_image_parts(messages)):
        prompt_bound += images * (read_manifest(args.artifact).vision or {}).get("max_image_tokens", 0)
    if args.stats and args.speculative is None:
        raise UsageError("--stats reports speculative decoding; add --speculative mtp (or dspark)")
    engine = Engine(args.artifact, prefill_chunk=args.prefill_chunk,
                    max_context=max(4096, prompt_bound + max(args.max_new_tokens, 0) + 1), verify=args.verify,
                    **_speculative_kwargs(args), weights=args.weights, engram_memory=args.engram_memory,
                    profile=args.profile, kv_cache_memory=args.kv_cache_memory,
                    prefix_caching=args.prefix_caching, **_engine_ranks(args))
    images = ()
    if messages is not None:
        intake = _image_intake(args, relative_to=Path(args.messages).parent, allowed_dir=Path("/"))
        chat_prompt = messages_prompt(engine, messages, args.thinking, intake)
        prompt, images = chat_prompt.token_ids, chat_prompt.images
    else:
        prompt = args.token_ids if args.token_ids is not None else engine.encode(args.prompt)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=temperature,
                            top_p=args.top_p if args.top_p is not None else 1.0, seed=args.seed,
                            stop_token_ids=tuple(args.stop_token_ids or ()))
    streamed: list[int] = []

    def on_token(_rid: int, token: int) -> None:
        # Text streams as it decodes; ids are printed once, space-separated, at the end.
        if args.token_ids is None:
            before = engine.decode(streamed)
            streamed.append(token)
            sys.stdout.write(engine.decode(streamed)[len(before):])
            sys.stdout.flush()

    result = engine.generate(prompt, params, on_token=on_token, record_logits=args.logits_out is not None,
                             images=images)
    if args.token_ids is None:
        sys.stdout.write("\n")
    else:
        print(" ".join(str(t) for t in result.tokens))
    if args.logits_out is not None:
        np.save(args.logits_out, result.logits)
    if args.stats:
        s = result.speculative
        rate = "n/a" if s["acceptance_rate"] is None else f"{100 * s['acceptance_rate']:.1f}%"
        print(f"speculative {args.speculative}: acceptance {rate} ({s['accepted_tokens']}/{s['draft_tokens']} drafts), "
              f"{s['tokens_per_step'] or 0:.2f} tokens per verify step over {s['verify_steps']} steps, "
              f"steps by drafts accepted {json.dumps(s['accepted_lengths'])}", file=sys.stderr)
    if args.profile:
        from dsv4c.runtime.profile import report_lines

        print("\n".join(report_lines(engine)), file=sys.stderr)
    return 0


def _given(**values) -> dict:
    """The options given on the command line (the others keep their defaults, which live with their code)."""
    return {name: value for name, value in values.items() if value is not None}


def _cmd_serve(args) -> int:
    from dsv4c.runtime.serve.app import ConnectionLimits, RequestLimits, serve

    return serve(args.artifact, host=args.host, port=args.port, max_requests=args.max_requests,
                 max_context=args.max_context, max_waiting=args.max_waiting, api_key=args.api_key,
                 shutdown_timeout=args.shutdown_timeout, **_speculative_kwargs(args), weights=args.weights,
                 engram_memory=args.engram_memory,
                 served_model_name=args.served_model_name, kv_cache_memory=args.kv_cache_memory,
                 prefix_caching=args.prefix_caching, **_engine_ranks(args),
                 limits=RequestLimits(**_given(max_bytes=args.max_request_bytes,
                                               body_timeout=args.request_body_timeout)),
                 connection_limits=ConnectionLimits(**_given(
                     max_header_bytes=args.max_header_bytes, header_timeout=args.header_timeout,
                     keep_alive_timeout=args.keep_alive_timeout, max_connections=args.max_connections)),
                 verify=args.verify, background_verify=args.background_verify,
                 images=_image_intake(args))


def _cmd_verify(args) -> int:
    from dsv4c.artifact.manifest import verify_artifact

    manifest, checked = verify_artifact(args.artifact)
    print(f"{args.artifact}: {len(manifest.files)} files, {checked / 1e9:.2f} GB, match their sha256")
    return 0


KV_HELP = ("KV pool row format: fp8 (FP8 NoPE + BF16 rope rows, FP8 or FP4 index rows), fp32, or auto (the "
           "target's default: fp32 for exact numerics on llvm, fp8 on GPUs)")


def build_parser() -> argparse.ArgumentParser:
    from dsv4c.artifact.quant import NUMERICS

    from dsv4c.passes.quant_plan import KV_CACHE_DTYPES

    parser = argparse.ArgumentParser(prog="dsv4c", description="Ahead-of-time compiler for DeepSeek-V4 models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("make-tiny", help="write a deterministic random model a user can compile and run")
    p.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    p.add_argument("--config", help="config.json or preset (e.g. v41-tiny) to use instead of the tiny preset")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.set_defaults(run=_cmd_make_tiny)

    p = sub.add_parser("trace", help="print the traced IR of a model")
    p.add_argument("--model", required=True, help="model directory, config.json, or preset (pro, flash, tiny)")
    p.add_argument("--numerics", choices=NUMERICS, default="exact",
                   help="exact: fp32 like transformers; qat: the official FP8/FP4 round trips; bf16: exact's "
                        "graph, its CPU prefill GEMMs on BF16-rounded activations (docs/numerics.md)")
    p.set_defaults(run=_cmd_trace)

    p = sub.add_parser("compile", help="compile a model into an artifact for a target")
    p.add_argument("--model", required=True, help="model directory, or preset (pro, flash, tiny)")
    p.add_argument("--target", required=True, choices=TARGETS)
    p.add_argument("-o", "--output", required=True, help="artifact directory to create")
    p.add_argument("--numerics", choices=NUMERICS, default="exact")
    p.add_argument("--no-weights", action="store_true", help="compile the structure only (no weights file)")
    p.add_argument("--draft-model", metavar="DIR",
                   help="take the DSpark drafter (its dspark_* config fields and mtp.* tensors) from this checkpoint")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help=KV_HELP)
    p.add_argument("--cpu", metavar="NAME",
                   help="llvm: the CPU to build for, an LLVM name (x86-64-v3: any AVX2 CPU, x86-64-v4, znver4, "
                        "skylake-avx512, ...) or native (this machine's, the default)")
    p.add_argument("--print-ir-after-all", action="store_true", help="print the IR after every pass (stderr)")
    p.add_argument("--print-ir-after", action="append", metavar="PASS", help="print the IR after this pass")
    p.add_argument("--disable-pass", action="append", metavar="PASS", help="skip this pass")
    p.add_argument("--verbose", action="store_true", help="per-pass timing and op counts")
    p.add_argument("-tp", "--tensor-parallel", type=int, default=1, metavar="N",
                   help="devices to split the model across (a power of two the model's heads, output groups, experts "
                        "and expert width divide; `dsv4c inspect --tensor-parallel N` says what each holds): one "
                        "library every rank runs, each rank's weights (default 1)")
    p.add_argument("--no-expert-parallel", dest="expert_parallel", action="store_false",
                   help="with --tensor-parallel: each rank holds a share of every routed expert's intermediate dim "
                        "instead of whole experts (a share of them, the default)")
    p.set_defaults(run=_cmd_compile)

    p = sub.add_parser("export", help="write the program (step + MTP) as an ONNX graph for Netron and ONNX tooling")
    p.add_argument("--model", required=True, help="model directory, config.json, or preset (pro, flash, tiny)")
    p.add_argument("--format", required=True, help="output format: onnx")
    p.add_argument("--after-passes", action="store_true", help="export after the target's pass pipeline")
    p.add_argument("--target", help="target whose pipeline --after-passes runs (default llvm)")
    p.add_argument("--numerics", choices=NUMERICS, default="exact")
    p.add_argument("--with-weights", action="store_true",
                   help="also write the model directory's weights as ONNX external data (<output>.data)")
    p.add_argument("-o", "--output", required=True, help="the .onnx file to write")
    p.set_defaults(run=_cmd_export)

    p = sub.add_parser("generate", help="generate tokens with a compiled artifact")
    p.add_argument("artifact", help="artifact directory written by `dsv4c compile`")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs tokenizer.json in the artifact)")
    src.add_argument("--token-ids", type=_token_ids, help="prompt as comma-separated token ids, e.g. 1,2,3")
    src.add_argument("--messages", metavar="FILE.json",
                     help="a conversation (a JSON list of OpenAI chat messages) encoded as `dsv4c serve` encodes "
                          "chat requests: the artifact's chat template, else DeepSeek-V4's encoding; image parts' "
                          "URLs may be paths relative to FILE")
    p.add_argument("--thinking", action="store_true", help="with --messages: V4's thinking mode")
    p.add_argument("--max-new-tokens", type=int, required=True)
    p.add_argument("--greedy", action="store_true", help="argmax decoding (the default)")
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-token-ids", type=_token_ids, help="stop after any of these ids")
    p.add_argument("--prefill-chunk", type=int, help="feed the prompt in chunks of at most this many tokens")
    p.add_argument("--logits-out", help="save float32 logits [prompt_len + N, vocab] to this .npy file")
    p.add_argument("--verify", action="store_true",
                   help="check every artifact file against its sha256 first (reads every byte; `dsv4c verify` alone)")
    _speculative_args(p)
    _pool_args(p)
    _weights_arg(p)
    _distributed_args(p)
    p.add_argument("--stats", action="store_true",
                   help="print speculative decoding's acceptance rate, tokens per step and how many verify steps "
                        "accepted 0, 1, ... drafts on stderr")
    p.add_argument("--profile", action="store_true",
                   help="time the compiled step's kernels by op family and print them on stderr beside the cost "
                        "model's prediction at this machine's measured bandwidth and matmul rate")
    _image_args(p, "any file, paths relative to the --messages file")
    p.set_defaults(run=_cmd_generate)

    p = sub.add_parser("serve", help="serve an artifact over an OpenAI-compatible HTTP API")
    p.add_argument("artifact", help="artifact directory written by `dsv4c compile`")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default 8000)")
    p.add_argument("--max-requests", type=int, default=8, help="requests run at once, in one batch (default 8)")
    p.add_argument("--max-context", type=int, default=4096,
                   help="most tokens (prompt + generated) of one request; sizes the KV pool (default 4096)")
    p.add_argument("--max-waiting", type=int, default=64,
                   help="requests that wait for a place beyond --max-requests; more get 503 (default 64)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/ requests")
    p.add_argument("--served-model-name",
                   help="the name clients give as 'model' (and /v1/models lists); another name gets 404 "
                        "(default: the artifact's model name)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGINT / SIGTERM, seconds running requests get to finish before they are "
                        "cancelled (default 30)")
    p.add_argument("--max-request-bytes", type=int,
                   help="larger request bodies get 413 before they are read (default 8 MiB: a 1M-token text "
                        "prompt)")
    p.add_argument("--request-body-timeout", type=float,
                   help="seconds a request body gets to arrive in full; slower ones get 408 (default 30)")
    _image_args(p, "none: images come as data: URLs")
    p.add_argument("--max-header-bytes", type=_parse_bytes,
                   help="a larger request line and headers get 431 and the connection closes (default 64KiB)")
    p.add_argument("--header-timeout", type=float, metavar="SECONDS",
                   help="a connection whose request line and headers have not all arrived this long after it opened "
                        "(or, kept alive, after its next request began) is closed (default 10)")
    p.add_argument("--keep-alive-timeout", type=float, metavar="SECONDS",
                   help="an idle kept-alive connection is closed after this long (default 5)")
    p.add_argument("--max-connections", type=int,
                   help="connections open at once; one more gets 503 before a byte of it is read (default 1000)")
    p.add_argument("--verify", action="store_true",
                   help="check every artifact file against its sha256 before the engine starts (reads every byte)")
    p.add_argument("--no-background-verify", dest="background_verify", action="store_false",
                   help="without --verify: skip the weight files' sha256 check a low-priority thread runs once the "
                        "server is ready (a mismatch turns /health to 503 and exits with status 1)")
    _speculative_args(p)
    _pool_args(p)
    _weights_arg(p)
    _distributed_args(p)
    p.set_defaults(run=_cmd_serve)

    p = sub.add_parser("verify", help="check every file of an artifact against the sha256 in its manifest")
    p.add_argument("artifact", help="artifact directory written by `dsv4c compile`")
    p.set_defaults(run=_cmd_verify)

    p = sub.add_parser("inspect", help="KV pool geometry, memory budget and quantization plan of a model")
    p.add_argument("model", help="model directory, config.json, preset (pro, flash, tiny), or an artifact "
                                 "(its model, target and numerics as compiled)")
    p.add_argument("--target", default="llvm", choices=COMPILED_TARGETS)
    p.add_argument("--numerics", choices=NUMERICS, default="exact")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help=KV_HELP)
    p.add_argument("--memory", type=_parse_bytes,
                   help="memory of each device, e.g. 141GiB: what is left beside its weights holds the pool; "
                        "also reports min_devices")
    p.add_argument("-tp", "--tensor-parallel", type=int, default=1, metavar="N",
                   help="devices the weights split across (docs/tensor_parallel.md); default 1")
    p.add_argument("--plan", action="store_true", help="also print the quantization plan")
    p.add_argument("--cost", action="store_true",
                   help="FLOPs and bytes read per decode token, by op family (docs/cost_model.md); "
                        "the model may also be v3.2, DeepSeek-V3.2-Exp for comparison")
    p.add_argument("--context", type=int, help=f"with --cost: tokens each request sees (default {cli_inspect.COST_CONTEXT:,})")
    p.add_argument("--batch", type=int, help="with --cost: requests decoding together, one token each (default 1)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=cli_inspect.run)
    return parser


def _torchrun_rank(args) -> None:
    """Under torchrun (``WORLD_SIZE`` > 1), ``generate`` / ``serve`` run the engine on rank 0 and
    only a rank's share of each step on the others (``runtime.tensor_parallel``; it ends the
    process)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if args.command in ("generate", "serve") and world > 1 and rank > 0:
        from dsv4c.runtime.tensor_parallel.rank_loop import run_rank
        from dsv4c.runtime.tensor_parallel.ranks import torchrun_address

        run_rank(Path(args.artifact), rank, world, torchrun_address(), args.distributed_timeout, args.weights,
                 engram_memory=args.engram_memory)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _torchrun_rank(args)
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
