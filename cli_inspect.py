"""``dsv4c inspect``: a model's or an artifact's KV pool geometry, memory budget, quantization plan
and, with ``--cost``, its decode cost; the report ``--json`` prints."""

from __future__ import annotations

from pathlib import Path

COST_CONTEXT = 1 << 20  # the 1M context of the V4 report's claims


def run(args) -> int:
    import json

    from dsv4c.errors import UsageError
    from dsv4c.frontend.config import COST_ONLY_PRESETS, resolve_model
    from dsv4c.passes.quant_plan import plan_for
    from dsv4c.artifact.pool import PoolGeometry
    from dsv4c.artifact.sharding import MIN_DEVICES_CONTEXT, ShardingPlan, min_devices
    from dsv4c.artifact.file_names import MANIFEST
    from dsv4c.compile import stored_weights

    if not args.cost and (args.context is not None or args.batch is not None):
        raise UsageError("--context and --batch size the decode step --cost prices; add --cost")
    cost = None
    if args.cost:
        from dsv4c.token_cost import decode_cost, format_cost

        cost = decode_cost(args.model, args.target, COST_CONTEXT if args.context is None else args.context,
                           1 if args.batch is None else args.batch, args.numerics,
                           args.kv_cache_dtype)
        if args.model in COST_ONLY_PRESETS:  # no pool geometry to report: it never compiles
            print(json.dumps(cost.to_json(), indent=2) if args.json else "\n".join(format_cost(cost)))
            return 0
    engram_bytes, manifest = None, None
    if (Path(args.model) / MANIFEST).is_file():  # an artifact: its model as compiled, its tables' files
        from dsv4c.artifact.directory import open_artifact

        opened = open_artifact(args.model)
        cfg, manifest = opened.config, opened.manifest
        args.target, args.numerics, args.kv_cache_dtype = manifest.target, manifest.numerics, manifest.kv_cache_dtype
        if manifest.engram_table_files():
            engram_bytes = sum(manifest.files[f].bytes for f in manifest.engram_table_files())
    else:
        cfg = resolve_model(args.model)
    plan = plan_for(cfg, args.target, args.numerics, args.kv_cache_dtype)
    sharding = ShardingPlan.build(cfg, args.tensor_parallel)
    geometry = PoolGeometry.build(cfg, plan)
    report = {"model": cfg.name, "target": args.target, "numerics": args.numerics, **geometry.summary(),
              "fp8_format": plan.fp8_format, "expert_format": plan.expert_format,
              "tensor_parallel": sharding.tensor_parallel}
    if cfg.family == "v4.1":  # the pool priced beside V4-Flash's under the same plan
        flash = resolve_model("flash")
        flash_geometry = PoolGeometry.build(flash, plan_for(flash, args.target, args.numerics, args.kv_cache_dtype))
        report["flash_bytes_per_token"] = flash_geometry.summary()["bytes_per_token"]
    if args.numerics == "bf16":  # how this CPU (or the artifact's) runs the bf16 matmuls
        report["matmul_compute"] = bf16_matmuls_line(manifest)
    if cfg.engram is not None:  # tables gathered a few rows a token, apart from the weights
        report["engram_bytes"] = cfg.engram.table_bytes if engram_bytes is None else engram_bytes
    weights = stored_weights(cfg, plan)  # the Engram tables are not among them
    report["weight_bytes_per_device"] = sharding.device_weight_bytes(weights)
    if args.memory is not None:
        # Every device holds the whole pool (one KV head: see artifact/sharding.py) beside its weights.
        pool_memory = max(0, args.memory - report["weight_bytes_per_device"])
        report["memory_bytes"] = args.memory
        report["pool_memory_bytes"] = pool_memory
        report.update(geometry.budget(pool_memory))
        report["min_devices"] = min_devices(cfg, weights, geometry, args.memory)
        report["min_devices_context"] = MIN_DEVICES_CONTEXT
    if args.plan:
        report["quant_plan"] = plan.to_json()
    if cost is not None:
        report.update(cost.to_json())
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    mib, gib = 2 ** 20, 2 ** 30

    def encoding(storage: str) -> str:  # FP8 rows name their code format
        return f"{storage} {geometry.fp8_format}" if storage == "fp8" else storage

    print(f"{cfg.name} on {args.target} ({args.numerics}): {cfg.num_layers} layers, "
          f"main KV {encoding(geometry.main_storage)} ({geometry.main_row_bytes} B/row), "
          f"index KV {encoding(geometry.index_storage)} {geometry.index_layout} ({geometry.index_row_bytes} B/row)")
    rows = [("rows per 256-token envelope", f"{geometry.rows_per_envelope} main + "
             f"{geometry.index_rows_per_envelope} index")]
    for plane, b in geometry.bytes_per_token().items():
        rows.append((f"bytes per token, {plane} plane", f"{b:,.1f}"))
    rows.append(("bytes per token, total", f"{report['bytes_per_token']:,.1f}"))
    if "flash_bytes_per_token" in report:
        rows.append(("bytes per token, V4-Flash beside it", f"{report['flash_bytes_per_token']:,.1f}"))
    if "engram_bytes" in report:
        rows.append(("Engram tables", f"{report['engram_bytes'] / gib:,.2f} GiB"))
    if "matmul_compute" in report:
        rows.append(("matmul compute", report["matmul_compute"]))
    rows.append(("window rows per request", f"{geometry.window_rows_per_request:,} "
                 f"({report['window_bytes_per_request'] / mib:,.2f} MiB)"))
    rows.append(("compressor state per request", f"{geometry.state_bytes_per_request / mib:,.2f} MiB"))
    rows.append((f"weights per device at tensor parallel {sharding.tensor_parallel}",
                 f"{report['weight_bytes_per_device'] / gib:,.2f} GiB"))
    if args.memory is not None:
        rows.append((f"pool memory left in {args.memory / gib:,.1f} GiB", f"{pool_memory / gib:,.2f} GiB" if pool_memory
                     else "none: the weights alone do not fit; raise --tensor-parallel"))
        rows.append(("tokens that fit beside the weights (one request)", f"{report['max_tokens']:,}"))
        for ctx, n in report["max_requests_at_context"].items():
            rows.append((f"requests that fit at {int(ctx):,} tokens", f"{n:,}"))
        fewest = report["min_devices"]
        rows.append((f"fewest devices for one {MIN_DEVICES_CONTEXT:,}-token request",
                     f"{fewest}" if fewest is not None else "none: the weights do not split small enough"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    if args.plan:
        print("quantization plan:")
        for kind, w in plan.weights.items():
            block = "x".join(map(str, w.block)) if w.block else "-"
            print(f"  {kind:<8} storage={w.storage:<9} block={block:<8} scale={w.scale or '-':<5} compute={w.compute}")
        print(f"  fp8 format {plan.fp8_format}; index layout {plan.index_kv.layout}"
              f"{' with Hadamard rotation' if plan.index_kv.hadamard else ''}")
    if cost is not None:
        print("\n".join(format_cost(cost)))
    return 0


def bf16_matmuls_line(manifest) -> str:
    """How the bf16 matmuls run: on the CPU an artifact was built for, else on this machine's."""
    from dsv4c.codegen.kernels.bf16 import bf16_matmuls
    from dsv4c.targets import host_cpu, host_cpu_flags

    if manifest is not None:
        features = manifest.kernels.cpu_features or ()
        return bf16_matmuls(manifest.kernels.mcpu, "avx512_bf16" in features, "amx_bf16" in features)
    host = host_cpu_flags()
    flags = host.flags if host is not None else frozenset()
    return bf16_matmuls(host_cpu(), "avx512_bf16" in flags, "amx_bf16" in flags)
