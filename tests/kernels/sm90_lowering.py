"""Compile, for Hopper (sm_90), every kernel specialization the launchers use, on a machine with no GPU.

Run as a script (by test_sm90_lowering.py, in a subprocess without TRITON_INTERPRET): each Triton kernel
in float8.kernels is swapped for a recorder, the launchers are called on CPU tensors of representative
shapes, and every recorded launch is compiled with triton.compile for GPUTarget("cuda", 90, 32), with the
specialization the JIT would pick (16-byte aligned pointers, ints divisible by 16, ints equal to 1 as
constants). Prints one JSON line: per launch, the kernel, its constants and PTX instruction counts.
"""

from __future__ import annotations

import importlib
import json
import re
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from float8.kernels.launch import FastLauncher

MODULES = ("amax", "cast", "quantize", "cast_transpose", "rowwise", "blockwise", "dequantize", "multi_quantize")
_TY = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e5m2: "fp8e5",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
}
PTX_PATTERNS = {
    "div_rn": r"\bdiv\.rn\.f32",
    "div_inexact": r"\bdiv\.(full|approx)\.f32",
    "cvt_satfinite": r"\bcvt\.rn\.satfinite\.e(4m3|5m2)x2\.f32",
    "ld_v4": r"\bld\.global(\.\w+)*\.v4\.",
    "st_v4": r"\bst\.global(\.\w+)*\.v4\.",
    "int_max_atomic": r"\b(red|atom)\.global(\.\w+)*\.max\.s32",
    "float_atomic": r"\b(red|atom)\.global(\.\w+)*\.(max|min)\.(f32|u32)",
    "local": r"\b(ld|st)\.local",
}


class Recorder:
    def __init__(self, name, jit_fn):
        self.name, self.jit_fn, self.calls = name, jit_fn, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def record_launches():
    mods = {m: importlib.import_module(f"float8.kernels.{m}") for m in MODULES}
    recorders = []
    for mod in mods.values():
        for attr, val in list(vars(mod).items()):
            if isinstance(val, triton.runtime.jit.JITFunction) and attr.endswith("_kernel"):
                rec = Recorder(attr, val)
                setattr(mod, attr, rec)
                recorders.append(rec)
                for launcher in vars(mod).values():  # a FastLauncher of it (kernels/launch.py) launches it too
                    if isinstance(launcher, FastLauncher) and launcher.kernel is val:
                        launcher.kernel = rec
    E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
    s = torch.tensor([0.5])
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        x = torch.randn(256, 512).to(dtype)
        mods["cast"].cast_triton(x, s, E4)
        mods["amax"].amax_triton(x)
        mods["quantize"].quantize_tensorwise_triton(x, E5, None, 1, True)
        mods["cast_transpose"].cast_transpose_triton(x, s, E4)
        mods["cast_transpose"].quantize_transpose_tensorwise_triton(x.t(), E5, 0, True)
        mods["rowwise"].quantize_rowwise_triton(x, E4)
        mods["rowwise"].quantize_rowwise_triton(torch.randn(3, 9000).to(dtype), E4)
        mods["blockwise"].quantize_blockwise_triton(x, 1, 128, E4)
        mods["blockwise"].quantize_blockwise_triton(x, 128, 128, E5, 0, True)
        d, si = mods["blockwise"].quantize_blockwise_ref(x, 128, 128, E4)
        mods["dequantize"].dequantize_triton(d, si, dtype)
        mods["dequantize"].dequantize_triton(d, si.new_ones(()), dtype)
        # The one-launch path for small tensors, at its size limit (registers, no spills) and below.
        small = torch.randn(128, 128).to(dtype)
        for xs in (small, small[:64]):
            mods["quantize"].quantize_tensorwise_triton(xs, E4)
            mods["cast_transpose"].quantize_transpose_tensorwise_triton(xs, E4)
        mods["cast_transpose"].quantize_transpose_tensorwise_triton(small.t(), E5, 0, True)  # a weight's .t()
        # Many weights at once (ops.requantize_weights, precompute_scales): aligned, flat and tiled casts.
        mq = mods["multi_quantize"]
        mq.quantize_tensorwise_multi_triton([x, small], E4)
        mq.quantize_tensorwise_multi_triton([x, small], E4, 0, False, True)
        mq.amax_multi_triton([x, small])
    return recorders


def signature_of(jit_fn, args, kwargs):
    names = jit_fn.arg_names
    values = dict(zip(names, args))
    options = {k: v for k, v in kwargs.items() if k not in names}
    values.update({k: v for k, v in kwargs.items() if k in names})
    signature, constexprs, attrs = {}, {}, {}
    for i, n in enumerate(names):
        v = values[n]
        param = jit_fn.params[i]
        if param.is_constexpr or (isinstance(v, int) and not isinstance(v, bool) and v == 1):
            signature[n], constexprs[n] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            signature[n] = "*" + _TY[v.dtype]
            if v.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            signature[n] = "i1"
        elif isinstance(v, int):
            signature[n] = "i32" if -(2**31) <= v < 2**31 else "i64"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            signature[n] = "fp32"
        else:
            raise TypeError(f"{n}: {type(v)}")
    return signature, constexprs, attrs, options


def main():
    out = []
    seen = set()
    for rec in record_launches():
        for args, kwargs in rec.calls:
            sig, consts, attrs, options = signature_of(rec.jit_fn, args, kwargs)
            key = (
                rec.name,
                json.dumps(sig, sort_keys=True),
                json.dumps(consts, sort_keys=True, default=str),
                str(attrs),
            )
            if key in seen:
                continue
            seen.add(key)
            src = ASTSource(fn=rec.jit_fn, signature=sig, constexprs=consts, attrs=attrs)
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
            ptx = k.asm["ptx"]
            counts = {name: len(re.findall(p, ptx)) for name, p in PTX_PATTERNS.items()}
            out.append(
                {
                    "kernel": rec.name,
                    "signature": sig,
                    "constexprs": {c: str(v) for c, v in consts.items()},
                    "counts": counts,
                }
            )
    sys.stdout.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
