"""What every kernel here shares: input checks, the device-side scale rule, the saturating cast.

The device helpers are the Triton spelling of `reference.py` (which states the semantics); each says
where it has to be careful to give the reference's bits.
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import importlib.util
import os
import sys
from typing import Callable, Sequence

if __name__ != "float8.kernels.common":  # a second copy would define every float8:: op again (kernels/__init__.py)
    raise ImportError(f"{__file__} is float8.kernels.common, imported here as {__name__!r}: import float8.kernels")

import torch
import triton
import triton.language as tl

from .reference import FP8_DTYPES, HIGH_PRECISION_DTYPES, check_fp8_dtype, fp8_max, max_margin, min_scale

# Current scaling of a SMALL tensor runs as one program, one launch (quantize.py, cast_transpose.py): on the
# H100 machine's host each Triton launch costs ~25-60 us of Python time and torch.zeros ~20-50 us, so the
# amax buffer + amax pass + cast pass of the general path are what a small layer waits for, not the GPU.
# 16384 elements in one program of 8 warps are 64 per thread: they stay in registers (ptxas sm_90a, Triton
# 3.9: 79 registers for the flat kernel, 95-127 for the 128 x 128 transposing one, no spills; the PTX at the
# limit is checked in tests/kernels/test_sm90_lowering.py). One SM reading 32 KiB of bf16 should take a few
# us, well under the host time saved (device time of this path not measured yet). The 2-D (transposing)
# tile also bounds each side by SMALL_DIM, so that the padded power-of-two tile stays <= 128 x 128.
SMALL_NUMEL = 16384
SMALL_DIM = 128


# Per-format values of reference.py, computed once: the checks and launchers run on every call.
_MAX_MARGIN = {d: max_margin(d) for d in FP8_DTYPES}
_FP8_CONSTANTS = {d: dict(FP8_MAX=fp8_max(d), MIN_SCALE=min_scale(d)) for d in FP8_DTYPES}


# ---- device helpers ---------------------------------------------------------------------------------


@triton.jit
def abs_bits(x):
    """|x| as int32 bits: for values >= 0, int order == float order, and |NaN| sorts above +inf.

    So an integer max (tl.max on the bits, tl.atomic_max on an int32 view of the output) is a
    NaN-propagating float max. The float versions are not: tl.max/max.f32 return the non-NaN operand,
    and Triton's float atomic_max routes val >= 0 / val < 0 to two integer atomics, and NaN is neither.
    """
    return x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def atomic_amax(amax_ptr, bits):
    """Device code: raise the () float32 amax at amax_ptr to the non-negative float whose bits are `bits`."""
    # amax_ptr: () fp32, zero-initialised (+0.0 has bits 0); bits: a scalar from abs_bits + tl.max.
    tl.atomic_max(amax_ptr.to(tl.pointer_type(tl.int32)), bits, sem="relaxed")


@triton.jit
def clamp_keep_nan(v, FP8_MAX: tl.constexpr):
    """Clamp to +-FP8_MAX, NaN stays NaN: with the RTNE cast after it, the satfinite cast of reference.py.

    Hopper's cvt.rn.satfinite would saturate by itself; clamping here makes the result independent of the
    backend (and of the interpreter). min/max drop NaN on NVIDIA, hence the where.
    """
    c = tl.minimum(tl.maximum(v, -FP8_MAX), FP8_MAX)
    return tl.where(v != v, v, c)


@triton.jit
def scale_from_amax(amax, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, margin_div, POWER_OF_2: tl.constexpr):
    """reference.scale_from_amax on the device, elementwise over an fp32 amax (scalar or block).

    Bit-exact with the reference: `fp8_max / amax` in torch is `amax.reciprocal() * fp8_max` (Tensor.
    __rtruediv__), so we round twice the same way; division is div.rn.f32 (IEEE), not the `/` of Triton,
    which is div.full.f32 (2 ulp). margin_div = 2.0**margin: the same correctly rounded division as the
    reference's. The clamp to the largest float32 comes after the margin, as in the reference. POWER_OF_2
    clears the mantissa bits, an exact round-down, like the reference's frexp/ldexp (a subnormal scale has
    no exponent bits and becomes 0 here, a power of two below 2**-126 there: the clamp below sends both to
    MIN_SCALE). MIN_SCALE = reference.min_scale(fp8_dtype) (common.fp8_constants). An amax of 0 gives 1, an
    inf or NaN amax NaN; max.f32 drops NaN, which is why the NaN comes from the last where, not the clamps.
    margin_div is cast to float32: Triton types a Python float argument float32, but inductor, launching
    the kernel of a triton_op, float64 (div_rn takes float32 only). The same bits either way.
    """
    one = tl.full(amax.shape, 1.0, tl.float32)
    scale = tl.math.div_rn(one, amax) * FP8_MAX
    scale = tl.math.div_rn(scale, tl.cast(margin_div, tl.float32))
    scale = tl.minimum(scale, 3.4028234663852886e38)  # inf (amax tiny) -> largest float32
    if POWER_OF_2:
        scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    scale = tl.maximum(scale, MIN_SCALE)
    scale = tl.where(amax > 0.0, scale, one)
    finite = tl.abs(amax) < float("inf")  # NaN fails
    return tl.where(finite, scale, float("nan"))


# ---- host helpers -----------------------------------------------------------------------------------


def check_hp_input(x: object, op: str, name: str = "x") -> None:
    """TypeError unless x is a float32/bfloat16/float16 tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype in FP8_DTYPES:
        raise TypeError(f"{op}: {name} is already FP8 ({x.dtype}); it takes a float32, bfloat16 or float16 tensor")
    if x.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"{op}: {name} must be float32, bfloat16 or float16, got {x.dtype}")


def check_scale(scale: object, x: torch.Tensor, op: str) -> None:
    """TypeError or ValueError naming `op` unless scale is a one-element float32 tensor on x's device."""
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{op}: scale must be a float32 tensor with one element, got {type(scale).__name__}")
    if scale.dtype != torch.float32:
        raise TypeError(f"{op}: scale must be float32, got {scale.dtype}")
    if scale.numel() != 1:
        raise ValueError(f"{op}: scale must hold one element, got shape {tuple(scale.shape)}")
    if scale.device != x.device:
        raise ValueError(f"{op}: scale is on {scale.device} but x is on {x.device}")


def check_scaling_args(fp8_dtype: object, margin: object, power_of_2: object, op: str) -> None:
    """The arguments of current scaling: an FP8 dtype, 0 <= margin <= reference.max_margin(fp8_dtype), a bool."""
    check_fp8_dtype(fp8_dtype)
    if not isinstance(margin, int) or isinstance(margin, bool) or margin < 0:
        raise ValueError(f"{op}: margin must be an int >= 0, got {margin!r}")
    limit = _MAX_MARGIN[fp8_dtype]
    if margin > limit:
        raise ValueError(
            f"{op}: margin {margin} is too large for {fp8_dtype}: at most {limit} (a larger margin can send "
            "every value to 0)"
        )
    if not isinstance(power_of_2, bool):
        raise TypeError(f"{op}: power_of_2 must be a bool, got {type(power_of_2).__name__}")


def check_tensorwise_args(
    x: torch.Tensor, fp8_dtype: object, scale: object, margin: object, power_of_2: object, op: str
) -> None:
    """The FP8 arguments of a per-tensor op: scale None, current scaling (check_scaling_args); or a given
    scale (check_scale), with which margin and power_of_2 are ignored (and not checked)."""
    if scale is None:
        check_scaling_args(fp8_dtype, margin, power_of_2, op)
    else:
        check_scale(scale, x, op)
        check_fp8_dtype(fp8_dtype)


def check_flag(value: object, name: str, op: str) -> None:
    """TypeError naming `op` unless value is a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{op}: {name} must be a bool, got {type(value).__name__}")


def fp8_constants(fp8_dtype: torch.dtype) -> dict:
    """The constexprs FP8_MAX and MIN_SCALE of a kernel casting to fp8_dtype (reference.fp8_max, .min_scale).
    One dict per format, made once (launchers unpack it; never modify it): host time per launch counts."""
    constants = _FP8_CONSTANTS.get(fp8_dtype)
    if constants is None:
        check_fp8_dtype(fp8_dtype)  # raises
    return constants


def transposed_shape(shape: Sequence[int]) -> tuple:
    """shape with its last two dims swapped: the shape of a per-tensor FP8 output's data_t."""
    return (*shape[:-2], shape[-1], shape[-2])


def fake_fp8_outputs(
    like: torch.Tensor, shape: Sequence[int], t_shape: Sequence[int] | None, fp8_dtype: torch.dtype
) -> tuple:
    """(data, data_t, scale_inv, amax) of a per-tensor FP8 op, for its register_fake: data of `shape`,
    data_t of `t_shape` (None: no transpose, an empty (0,) tensor), scale_inv and amax () float32."""
    return (
        like.new_empty(shape, dtype=fp8_dtype),
        like.new_empty((0,) if t_shape is None else t_shape, dtype=fp8_dtype),
        like.new_empty((), dtype=torch.float32),
        like.new_empty((), dtype=torch.float32),
    )


def margin_div(margin: int) -> float:
    """2**margin as a float: what a margin divides the scale by."""
    return float(2.0**margin)


@functools.lru_cache(maxsize=None)
def _fp8_capable(device_index) -> bool:
    # Without CUDA a "cuda" tensor is a fake or meta one (tracing for a GPU, export on a CPU-only host):
    # traced for the Hopper target, whose FP8 conversions the kernels need.
    if not torch.cuda.is_available():
        return True
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def use_triton(x: torch.Tensor, writes_fp8: bool = True) -> bool:
    """Run the Triton kernel for x? Kernels that write FP8 need a GPU with FP8 conversions (sm_89+);
    high-precision ones (writes_fp8=False: act_fwd/act_bwd, the norms' forward and backward) run on any
    CUDA GPU. Elsewhere the reference."""
    return x.device.type == "cuda" and (not writes_fp8 or _fp8_capable(x.device.index))


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host ints. Not triton.cdiv: since Triton 3.3 that is a ConstexprFunction whose call
    unwraps constexprs, 1.7 us per call on this CPU and ~3 us on the H100 machine's host; a decode-size
    Linear computed four of them per launch (cProfile of 2026-11-25)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= max(1, n)."""
    if type(n) is int:  # 0.2 us against Triton's 2.2 (its bit loop), a dozen times per small FP8 step
        return 1 << (max(1, n) - 1).bit_length()
    return triton.next_power_of_2(max(1, n))  # a SymInt while traced


def small_num_warps(tile_elems: int) -> int:
    """Warps for a one-program kernel over a tile of tile_elems (<= SMALL_NUMEL) elements: <= 64 per thread."""
    return 4 if tile_elems <= 4096 else 8


# ---- registering ops ---------------------------------------------------------------------------------


def refuse_redefinition(name: str, module: str) -> None:
    """Raise if the op `name` ("float8::...") is defined already. torch.library drops an op's first definition
    when the op is defined again, and the operator handles taken from it before (every OpOverload, inductor's
    and dynamo's caches) then point at freed memory: calls crash at random, far from the cause. A second
    definition comes from one of this package's modules run a second time: imported under another name
    (`kernels.quantize` beside `float8.kernels.quantize`: the repository root on sys.path makes its folders
    importable), or reloaded (importlib.reload, an editor's autoreload)."""
    try:
        torch._C._dispatch_find_schema_or_throw(name, "")
    except RuntimeError:
        return  # not defined yet
    raise RuntimeError(
        f"{name} is defined already: module {module!r} runs a second time, imported under another name or "
        "reloaded. Defining a torch op again would leave the handles of its first definition dangling. The "
        "repository's kernels/ and ops/ folders are float8.kernels and float8.ops: import them by those names, "
        "and restart the interpreter instead of reloading float8"
    )


def alias_package(bare: str, canonical: str, folder: str) -> None:
    """Settle what the bare name `bare` means after the import system found this repository's `folder`
    (`kernels/`, `ops/`) under it, through the repository root on sys.path (see kernels/__init__.py).

    Another package of that name installed elsewhere on sys.path (Hugging Face's kernel hub is `kernels`
    too) is what the name means: it is loaded in its place, as if the root were not on sys.path. Otherwise
    the name becomes the canonical package, with its loaded submodules: `import kernels.quantize` is then
    float8.kernels.quantize, not a second run of its file. Submodules the canonical package has not loaded
    stay unaliased; one that defines an op refuses to run twice (refuse_redefinition)."""
    root = os.path.realpath(os.path.dirname(folder))
    elsewhere = [p for p in sys.path if isinstance(p, str) and os.path.realpath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec(bare, elsewhere)
    if spec is not None and spec.loader is not None and spec.origin and not _float8_folder(spec.origin):
        other = importlib.util.module_from_spec(spec)
        sys.modules[bare] = other
        spec._initializing = True  # other threads importing the name wait for it, as importlib's own load does
        try:
            spec.loader.exec_module(other)
        except BaseException:
            if sys.modules.get(bare) is other:
                del sys.modules[bare]
            raise
        finally:
            spec._initializing = False
        return
    package = importlib.import_module(canonical)
    prefix = canonical + "."
    for name, module in list(sys.modules.items()):
        if name.startswith(prefix):
            sys.modules.setdefault(bare + "." + name[len(prefix) :], module)
    sys.modules[bare] = package


def _float8_folder(init_file: str) -> bool:
    """Whether a package's __init__.py is this folder's kind (another checkout of this repository, a copy):
    loading it as "another package" would resolve the bare name again, without end. Read, not run."""
    try:
        with open(init_file, encoding="utf-8") as f:
            return "_alias_package(__name__, " in f.read()
    except OSError:
        return False


def custom_op(name: str) -> Callable[[Callable], Callable]:
    """`torch.library.custom_op(name)`, with a direct call on the eager hot path.

    The registered op is what torch.compile, fake tensors, functionalization and opcheck see. A plain
    eager call (no tracing, no dispatch mode, plain tensors among the positional and keyword arguments, no
    autograd to record) calls the function itself: the op dispatcher costs ~47 us per call on the H100
    machine's host (134 us against 87 us for quantize_tensorwise, measured 2026-11-22:
    docs/performance.md, "What the measurements say"), which small layers feel. Same
    function, same results.
    """

    def wrap(fn):
        refuse_redefinition(name, fn.__module__)
        call = _direct_in_eager(fn, torch.library.custom_op(name, mutates_args=())(fn))
        call.register_fake = call.op.register_fake
        return call

    return wrap


def _direct_in_eager(fn, op):
    """A callable that runs fn itself on plain eager calls and the registered op otherwise."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if _plain_eager(args, kwargs):
            return fn(*args, **kwargs)
        return op(*args, **kwargs)

    call.op = op
    return call


def triton_op(name: str) -> Callable[[Callable], Callable]:
    """`torch.library.triton_op(name)` with the same direct eager call as `custom_op`.

    Under torch.compile the op's body is traced, not called: its kernel launches (through
    `launch.FastLauncher`, which hands them to `torch.library.wrap_triton` while tracing) become Triton
    kernels of the compiled graph, launched by inductor's own generated code instead of through the op
    dispatcher and our Python launcher (~50 us a call on the H100 machine's host; see custom_op). The CPU
    reference inside the body is traced as the torch ops it is. No register_fake: tracing the body on fake
    tensors gives the output shapes."""

    def wrap(fn):
        refuse_redefinition(name, fn.__module__)
        return _direct_in_eager(fn, torch.library.triton_op(name, fn, mutates_args=()))

    return wrap


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def forward_ad_or_functorch_active() -> bool:
    """Whether forward-mode AD (a dual level) or a functorch transform (jvp, vmap, grad) is active: a direct
    call would drop its tangents or see wrapped tensors, so such calls go through the registered op, which
    differentiates or refuses with torch's own error."""
    return torch.autograd.forward_ad._current_level >= 0 or torch._C._are_functorch_transforms_active()


def _plain_eager(args, kwargs) -> bool:
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() or forward_ad_or_functorch_active():
        return False
    grad = torch.is_grad_enabled()
    for a in (*args, *kwargs.values()) if kwargs else args:
        # A norm's weight is an nn.Parameter: a plain tensor for this purpose (a subclass keeps its own type).
        if isinstance(a, torch.Tensor) and (type(a) not in _PLAIN or (grad and a.requires_grad)):
            return False
    return True
