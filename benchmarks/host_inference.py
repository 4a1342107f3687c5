"""Host time of decode-size inference calls (CUDA): an FP8-only ops.Linear against nn.Linear, per call, and
the Llama-style model under CUDA graphs (ops.graphed_inference, and torch.compile mode="reduce-overhead")
and compiled in torch.compile's default mode ("compiled"), bf16 against float8.

    python -m benchmarks.host_inference [--tokens 16] [--graphs graphed_inference,reduce-overhead,compiled]
        [--linear-shapes 4096x4096,4096x1024,14336x4096] [--linear-tokens 16,64,128] [--out DIR]

- linear: microseconds of host per call, calls issued back to back under inference_mode (the GPU keeps up,
  so the loop measures the host): nn.Linear, an FP8-only ops.Linear (weight-only kernel) and one converted
  with Recipe(inference_fp8_input_from=33) (FP8-input kernel from 33 tokens), each --linear-shapes KxN
  (4096x1024: a split-K layer) at each of --linear-tokens.
- graphs: per call, the host time before the replay returns ("host_ms", calls back to back without a
  synchronize, divided by their count), the time per call back to back ("pipelined_ms") and one call at a
  time ("synchronized_ms", the median): bf16 and float8 weights of benchmarks.inference's Llama-style model.
  Also "host_only_ms": the host time of a call while the GPU is still busy with earlier work (a few calls
  queued behind large matmuls, so that the launch queue never fills and no call waits for the GPU), and
  "gpu_ms": the CUDA kernel time of a call (torch.profiler, summed). A call whose host_only_ms exceeds its
  gpu_ms is bound by the host.

Recorded as the area "host_inference" (or --area) in DIR (default benchmarks/results/; benchmarks.harness.record).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

import float8.ops as ops
from benchmarks.harness import add_out_argument, environment, figure, record
from benchmarks.inference import build_bf16, quantize_weights
from benchmarks.llama import LlamaShape


def linear_host_us(tokens: int, n: int, k: int = 4096, reps: int = 100, rounds: int = 15) -> dict:
    """{variant: best host microseconds per call} of nn.Linear and FP8-only ops.Linears (the default recipe's
    weight-only kernel, and Recipe(inference_fp8_input_from=33)'s FP8-input kernel from 33 tokens), k -> n,
    calls issued back to back under inference_mode, the variants interleaved round by round (the host's
    speed drifts within a run)."""
    from float8 import Recipe

    def make(recipe=None, fp8=True):
        torch.manual_seed(0)
        lin = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16))
        return ops.convert(lin, fp8_weights=True, recipe=recipe)[0] if fp8 else lin[0]

    variants = {
        "nn.Linear": make(fp8=False),
        "float8": make(),
        "float8 fp8-input": make(Recipe(inference_fp8_input_from=33)),
    }
    x = torch.randn(1, tokens, k, device="cuda", dtype=torch.bfloat16)
    best = dict.fromkeys(variants, float("inf"))
    with torch.inference_mode():
        for m in variants.values():
            for _ in range(20):
                m(x)
        torch.cuda.synchronize()
        for _ in range(rounds):
            for name, m in variants.items():
                t = time.perf_counter()
                for _ in range(reps):
                    m(x)
                best[name] = min(best[name], (time.perf_counter() - t) / reps * 1e6)
                torch.cuda.synchronize()
    return {name: round(us, 1) for name, us in best.items()}


def host_only_ms(call, calls: int = 8) -> float:
    """Host milliseconds per call, issued while the GPU works through ~30 ms of matmuls queued before them:
    few enough calls that their launches fit the launch queue, so none waits for the GPU."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    for _ in range(24):
        a @ a
    t = time.perf_counter()
    for _ in range(calls):
        call()
    host = (time.perf_counter() - t) / calls * 1e3
    torch.cuda.synchronize()
    return host


def gpu_ms(call, calls: int = 10) -> float:
    """CUDA kernel milliseconds per call (torch.profiler), summed over every kernel of the call."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time for e in kernels) / calls / 1e3


def graphed_ms(weights: str, tokens: int, how: str) -> dict:
    """host_ms, pipelined_ms, synchronized_ms, host_only_ms and gpu_ms of the model: `how` is
    "graphed_inference" (ops.graphed_inference), "reduce-overhead" (torch.compile's CUDA-graph mode) or
    "compiled" (torch.compile's default mode; fullgraph for float8)."""
    dev = torch.device("cuda")
    model = quantize_weights(build_bf16("llama", LlamaShape(), dev), weights, dev)
    ids = torch.randint(0, LlamaShape().vocab, (1, tokens), device=dev)
    if how == "graphed_inference":
        call = ops.graphed_inference(model)
        call = functools.partial(call, ids)
    elif how == "compiled":
        call = functools.partial(torch.compile(model, fullgraph=weights == "float8", dynamic=False), ids)
    else:
        fn = torch.compile(model, mode="reduce-overhead", fullgraph=weights == "float8", dynamic=False)

        def call():
            torch.compiler.cudagraph_mark_step_begin()
            return fn(ids)

    with torch.inference_mode():
        for _ in range(23):
            call()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(50):
            call()
        host = (time.perf_counter() - t) / 50 * 1e3
        torch.cuda.synchronize()
        pipelined = (time.perf_counter() - t) / 50 * 1e3
        single = []
        for _ in range(30):
            torch.cuda.synchronize()
            t = time.perf_counter()
            call()
            torch.cuda.synchronize()
            single.append((time.perf_counter() - t) * 1e3)
        alone, kernels = host_only_ms(call), gpu_ms(call)
    return {
        "host_ms": round(host, 3),
        "pipelined_ms": round(pipelined, 3),
        "synchronized_ms": round(statistics.median(single), 3),
        "host_only_ms": round(alone, 3),
        "gpu_ms": round(kernels, 3),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--graphs", default="graphed_inference,reduce-overhead", help="how to graph the model ('': none)")
    p.add_argument("--linear-shapes", default="4096x4096,4096x1024,14336x4096", help="KxN of the Linears timed alone")
    p.add_argument("--linear-tokens", default="16,64,128", help="token counts of the Linears timed alone")
    p.add_argument("--area", default="host_inference", help="the results area this run replaces")
    add_out_argument(p)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.host_inference measures CUDA launches: nothing to do without a GPU")
        return
    figures = []
    for shape in filter(None, args.linear_shapes.split(",")):
        k, n = (int(d) for d in shape.split("x"))
        for tokens in (int(t) for t in args.linear_tokens.split(",")):
            for variant, us in linear_host_us(tokens, n, k).items():
                figures.append(figure(f"linear {k}->{n}, {tokens} tokens", variant, "host_us", us))
                print(f"{variant} {k}->{n}, {tokens} tokens: {us} us of host per call", flush=True)
    for how in filter(None, args.graphs.split(",")):
        name = "llama compiled" if how == "compiled" else "llama graphed"
        case = f"{name}, {args.tokens} tokens" + ("" if how in ("reduce-overhead", "compiled") else f", {how}")
        for weights in ("bf16", "float8"):
            for metric, v in graphed_ms(weights, args.tokens, how).items():
                figures.append(figure(case, weights, metric, v))
                print(f"{weights} {how}: {metric} {v}", flush=True)
    print(record(args.area, args.out, environment(torch.device("cuda")), figures))


if __name__ == "__main__":
    main()
