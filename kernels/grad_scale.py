"""A gradient computed ahead of its backward, scaled by the incoming gradient g once it arrives.

A fused linear + cross-entropy writes its input and weight gradients in the forward (for a loss of 1) and
its backward multiplies them by g, a () float32 tensor on the device. That is 1 for a plain
`loss.backward()`, where the multiply reads and writes the whole weight gradient for nothing: on the H100
(2026-11-27, V=128256, H=4096) torch's `dw.mul_(g)` of the bf16 (V, H) gradient took 2.4 ms of an 80 ms
loss, and a float32 running sum's `mul_` then cast to bf16 two passes where one does.

`scale_grad(t, g, out_dtype)` is `(t.float() * g).to(t.dtype).to(out_dtype)` (the product in float32 with g
as it is, rounded to t's dtype, then cast), in place where the dtype stays, in one pass, and in none where g
is 1 and the dtype stays: the kernel reads g on the device (no host sync) and its programs return at once.
(torch's CUDA `bf16_tensor.mul_(g)` rounds a float32 device g to bf16 before multiplying; on the CPU it
does not. Here neither does.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cdiv, use_triton
from .launch import FastLauncher

BLOCK = 8192  # elements per program; 16 warps


@triton.jit
def _scale_kernel(src_ptr, out_ptr, g_ptr, n, IN_PLACE: tl.constexpr, BLOCK: tl.constexpr):
    g = tl.load(g_ptr)
    if IN_PLACE:
        if g == 1.0:
            return  # x * 1 is x, bit for bit: nothing to read or write
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(src_ptr + offs, mask=mask).to(tl.float32)
    y = (x * g).to(src_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


_launch_scale = FastLauncher(_scale_kernel)


SLAB = 1 << 24  # elements per step of the reference's float32 product, eagerly: no float32 copy of all of t


def scale_grad_ref(t: torch.Tensor, g: torch.Tensor, out_dtype: torch.dtype, copy: bool = False) -> torch.Tensor:
    """(t.float() * g) rounded to t's dtype, then cast to out_dtype. Unless `copy`, t is the caller's to
    consume: it is scaled in place (and returned where out_dtype is its dtype). g: a () float32 tensor."""
    if copy:
        t = t.clone()
    if t.dtype == torch.float32 or (t.device.type == "cpu" and g.device.type == "cpu"):
        t.mul_(g)  # float32 as it is; on the CPU a () tensor multiplies as a float32 scalar
    elif torch.compiler.is_compiling() or (torch.is_grad_enabled() and g.requires_grad) or not t.is_contiguous():
        t = (t.float() * g).to(t.dtype)  # traced (fused by the compiler), differentiated through g, or strided
    else:
        flat = t.view(-1)  # eagerly in slabs: a (128256, 4096) bf16 gradient's float32 product is 2 GiB
        for i in range(0, flat.numel(), SLAB):
            part = flat[i : i + SLAB]
            part.copy_(part.float() * g)
    return t.to(out_dtype)


def scale_grad(t: torch.Tensor, g: torch.Tensor, out_dtype: torch.dtype, copy: bool = False) -> torch.Tensor:
    """scale_grad_ref's result in one pass over t, and none where g is 1 and t is scaled in place. t: float32,
    bfloat16 or float16; g: a () float32 tensor. Eager CUDA tensors only take the kernel: traced code, a
    dispatch mode, a g that takes a gradient (create_graph), other devices and layouts take the reference."""
    traced = torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
    if (
        traced
        or (torch.is_grad_enabled() and g.requires_grad)
        or not (
            use_triton(t, writes_fp8=False)
            and t.is_contiguous()
            and g.dtype == torch.float32
            and g.numel() == 1
            and g.device == t.device
        )
    ):
        return scale_grad_ref(t, g, out_dtype, copy)
    in_place = out_dtype == t.dtype and not copy
    out = t if in_place else torch.empty(t.shape, dtype=out_dtype, device=t.device)
    n = t.numel()
    if n:
        _launch_scale((cdiv(n, BLOCK),), t, out, g, n, IN_PLACE=in_place, BLOCK=BLOCK, num_warps=16)
    return out
