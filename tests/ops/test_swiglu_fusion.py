"""ops.convert fuses the model's own SwiGLU (ops/swiglu_fusion.py): `F.silu(g) * u` over the halves of a
converted Linear's output keeps only that output for the backward, which writes its gradient in one pass.
The forward's bits do not change; the gradient of the Linear's output is act_bwd's (one rounding); every
pattern that is not exactly the halves of one output, and every context where a fused save would be wrong
(no grad, in-place writes, checkpointing inside the model, compile), runs torch's own code."""

from __future__ import annotations

import copy
import io
import pickle
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import float8.ops as ops
from float8 import Recipe
from float8.kernels.activation import act_bwd
from float8.ops.saved_outputs import saved_outputs_of
from float8.ops.swiglu_fusion import SwiGLUFusion, swiglu_fusion_of
from tests.tolerances import sqnr_db

BF16 = torch.bfloat16
D, F_ = 64, 128


class _Reverse(torch.autograd.Function):
    """The identity, with the gradient's sign reversed (a view of its input)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, d):
        return -d


class MLP(torch.nn.Module):
    """A Llama MLP as users write it; `pattern` picks how the activation is spelled; h.grad is kept."""

    def __init__(self, pattern="chunk", f=F_):
        super().__init__()
        self.pattern, self.f = pattern, f
        self.up = torch.nn.Linear(D, 2 * f, bias=False)
        self.down = torch.nn.Linear(f, D, bias=False)

    def forward(self, x):
        h = self.up(x)
        if h.requires_grad and not torch.compiler.is_compiling():  # retain_grad does not compile
            h.retain_grad()
        self.h = h
        p, f = self.pattern, self.f
        if p == "chunk":
            g, u = h.chunk(2, dim=-1)
            a = F.silu(g) * u
        elif p == "reversed":
            g, u = h.chunk(2, dim=-1)
            a = u * F.silu(g)
        elif p == "torch.mul":
            g, u = h.chunk(2, dim=-1)
            a = torch.mul(F.silu(g), u)
        elif p == "slices":
            a = F.silu(h[..., :f]) * h[..., f:]
        elif p == "slices of a view":  # a view between h and the halves: its hooks could not be seen
            hv = h.view(2, -1, 2 * f)
            a = (F.silu(hv[..., :f]) * hv[..., f:]).view(-1, f)
        elif p == "gate second":  # [linear | gate]: not the kernel's layout, not fused
            u, g = h.chunk(2, dim=-1)
            a = F.silu(g) * u
        elif p == "silu used twice":
            g, u = h.chunk(2, dim=-1)
            s = F.silu(g)
            a = s * u + s
        elif p == "silu written in place":
            g, u = h.chunk(2, dim=-1)
            s = F.silu(g)
            s.mul_(0.5)
            a = s * u
        elif p == "two chunks":  # g and u from different chunk calls of h: still the same halves
            g = h.chunk(2, dim=-1)[0]
            u = h.chunk(2, dim=-1)[1]
            a = F.silu(g) * u
        elif p == "quarters":  # halves of halves: not the output's halves
            q = h.chunk(4, dim=-1)
            a = torch.cat([F.silu(q[0]) * q[1], F.silu(q[2]) * q[3]], dim=-1)
        elif p == "detached u":  # plain torch gives h no gradient through u
            g, u = h.chunk(2, dim=-1)
            a = F.silu(g) * u.detach()
        elif p == "silu detached in place":
            g, u = h.chunk(2, dim=-1)
            s = F.silu(g)
            s.detach_()
            a = s * u
        elif p == "product only":  # no down projection: the output is the product itself
            g, u = h.chunk(2, dim=-1)
            return F.silu(g) * u
        elif p == "silu plus u":  # no product, no down projection
            g, u = h.chunk(2, dim=-1)
            return F.silu(g) + u
        elif p == "custom view":  # a gradient-reversal layer between h and the halves
            g, u = _Reverse.apply(h).chunk(2, dim=-1)
            a = F.silu(g) * u
        elif p in ("hook on silu", "hook on u", "hook on g", "retain_grad on u"):
            g, u = h.chunk(2, dim=-1)
            s = F.silu(g)
            t = {"hook on silu": s, "hook on u": u, "hook on g": g, "retain_grad on u": u}[p]
            if p.startswith("retain"):
                t.retain_grad()
            else:
                t.register_hook(lambda d: d * 0.5)
            self.kept = t
            a = s * u
        else:
            raise ValueError(p)
        return self.down(a)


def _convert(model, **kwargs):
    """ops.convert, with the fusion's size threshold off (these models are small: MIN_NUMEL is 16M elements)."""
    ops.convert(model, **kwargs)
    if swiglu_fusion_of(model) is not None:
        swiglu_fusion_of(model).min_numel = 1
    return model


def _models(pattern="chunk", dtype=BF16):
    torch.manual_seed(0)
    base = MLP(pattern).to(dtype)
    fused = _convert(copy.deepcopy(base))
    plain = ops.convert(copy.deepcopy(base), fuse_swiglu=False)
    return fused, plain


def _data(tokens=256, dtype=BF16):
    g = torch.Generator().manual_seed(1)
    return torch.randn(tokens, D, generator=g).to(dtype), torch.randn(tokens, D, generator=g).to(dtype)


def _step(model, x, dy, create_graph=False):
    x = x.clone().requires_grad_(True)
    y = model(x)
    y.backward(dy, create_graph=create_graph)
    return [y, x.grad, model.h.grad] + [p.grad for p in model.parameters()]


def _dh_float64(h, dh_in):
    """d(silu(g) * u)/dh in float64 for h = [g | u] and the incoming gradient dh_in."""
    g, u = h.double().chunk(2, dim=-1)
    s = torch.sigmoid(g)
    dy = dh_in.double()
    return torch.cat([dy * u * s * (1 + g * (1 - s)), dy * g * s], dim=-1)


def test_convert_attaches_it_by_default_and_not_when_asked_or_lean():
    fused, plain = _models()
    assert swiglu_fusion_of(fused) is not None and swiglu_fusion_of(plain) is None
    lean = ops.convert(MLP().to(BF16), recipe=Recipe(lean_activations=True))
    assert swiglu_fusion_of(lean) is None and saved_outputs_of(lean) is not None
    ops.convert(lean, recipe=Recipe())  # not lean any more: the fusion instead
    assert swiglu_fusion_of(lean) is not None and saved_outputs_of(lean) is None
    ops.convert(lean, fuse_swiglu=False)
    assert swiglu_fusion_of(lean) is None


@pytest.fixture(params=[False, True], ids=["torch forward", "computed ahead"])
def ahead(request, monkeypatch):
    """On CUDA the silu computes the product with it (kernels/silu_product.py), and on the CPU too where the
    Linears take the product's amax (a converted model); here both paths run, that one with torch's own calls
    standing in for the kernel (whose bits the GPU tests compare with them)."""
    monkeypatch.setattr(SwiGLUFusion, "_computes_ahead", lambda self, h: request.param)
    return request.param


@pytest.mark.parametrize("pattern", ["chunk", "reversed", "torch.mul", "slices", "two chunks"])
def test_fused_forward_bits_unchanged_and_the_gradient_is_one_rounding_of_float64(pattern, ahead):
    x, dy = _data()
    fused, plain = _models(pattern)
    a, b = _step(fused, x, dy), _step(plain, x, dy)
    assert swiglu_fusion_of(fused).last_forward == {"fused": 1}
    assert torch.equal(a[0], b[0])  # torch's own forward
    assert torch.equal(a[4], b[4])  # the down projection's weight gradient: the same forward bits
    # h's gradient is act_bwd's: one rounding of the float32 formula, at least as close to float64 as torch's
    # two roundings
    h = fused.h.detach()
    a_in = _incoming(fused, h, dy)
    assert torch.equal(a[2], act_bwd(a_in, h, "swiglu"))
    want = _dh_float64(h, a_in)
    assert sqnr_db(want, a[2]) >= sqnr_db(want, b[2]) - 0.05
    # what reaches the parameters and x: the FP8 GEMMs of the same (or a nearer) h gradient
    for p, q in zip(a[1:], b[1:]):
        assert sqnr_db(q, p) >= 25


def _incoming(model, h, dy):
    """The gradient arriving at the product's output (the down projection's dx), recomputed from h."""
    g, u = h.chunk(2, dim=-1)
    a = (F.silu(g) * u).requires_grad_(True)
    return torch.autograd.grad(model.down(a), a, dy)[0]


@pytest.mark.parametrize(
    "pattern",
    [
        "gate second",
        "silu used twice",
        "silu written in place",
        "quarters",
        "detached u",
        "slices of a view",
        "custom view",
        "hook on silu",
        "hook on u",
        "hook on g",
        "retain_grad on u",
        "silu detached in place",
    ],
)
def test_what_is_not_exactly_the_pattern_keeps_torchs_gradients(pattern, ahead):
    x, dy = _data()
    fused, plain = _models(pattern)
    a, b = _step(fused, x, dy), _step(plain, x, dy)
    want_fused = 1 if pattern == "silu used twice" else 0
    assert swiglu_fusion_of(fused).last_forward == {"fused": want_fused}
    for p, q in zip(a, b):
        if p is None:
            assert q is None
        elif want_fused:  # the product fused, silu's other use through torch's backward: the sum is h's gradient
            assert sqnr_db(q, p) >= 30
        else:
            assert torch.equal(p, q)
    if pattern == "retain_grad on u":
        assert torch.equal(fused.kept.grad, plain.kept.grad)


def test_an_output_whose_autograd_node_is_torchs_own_is_fused_too():
    # Under ops.high_precision (and the small-layer policy on CUDA) the Linear is F.linear: its output's node is
    # a C++ one. torch 2.11 makes such a node's Python wrapper anew once the last one is dropped, so the table
    # keeps the node itself: found by its id alone, nothing fused on the H100 (torch 2.13 here keeps the
    # wrapper; tests/ops/test_swiglu_fusion.py's CUDA test is the one that saw it).
    x, dy = _data()
    fused, plain = _models()
    with ops.high_precision(fused), ops.high_precision(plain):
        a, b = _step(fused, x, dy), _step(plain, x, dy)
    assert swiglu_fusion_of(fused).last_forward == {"fused": 1}
    assert torch.equal(a[0], b[0])
    for p, q in zip(a[1:], b[1:]):
        assert sqnr_db(q, p) >= 40


def test_module_backward_hooks_on_the_up_projection_still_fire():
    # register_full_backward_hook wraps the Linear's output after its forward hooks ran: the halves come from
    # the wrapped output, not the noted one, so nothing is fused and the hook sees the whole gradient.
    x, dy = _data()
    fused, plain = _models()
    seen = {}
    for name, model in (("fused", fused), ("plain", plain)):
        model.up.register_full_backward_hook(lambda m, gi, go, name=name: seen.__setitem__(name, go[0].clone()))
    a, b = _step(fused, x, dy), _step(plain, x, dy)
    assert swiglu_fusion_of(fused).last_forward == {"fused": 0}
    assert torch.equal(seen["fused"], seen["plain"])
    for p, q in zip(a, b):
        assert (p is None and q is None) or torch.equal(p, q)


def test_user_function_modes_are_left_alone_and_never_leak():
    from torch.overrides import TorchFunctionMode

    class SiluToGelu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is F.silu:
                return F.gelu(args[0])
            return func(*args, **(kwargs or {}))

    x, dy = _data()
    fused, plain = _models()
    with SiluToGelu():  # below the window: no window opens, the mode's silu is what runs
        a, b = _step(fused, x, dy), _step(plain, x, dy)
    assert swiglu_fusion_of(fused).last_forward == {"fused": 0}
    for p, q in zip(a, b):
        assert torch.equal(p, q)

    class DeviceAroundUp(MLP):  # a mode entered and left around a Linear inside the forward
        def forward(self, x):
            with torch.device("cpu"):
                h = self.up(x)
            self.h = h
            g, u = h.chunk(2, dim=-1)
            return self.down(F.silu(g) * u)

    torch.manual_seed(0)
    model = _convert(DeviceAroundUp().to(BF16))
    _step(model, x, dy)
    assert torch.overrides._get_current_function_mode() is None


def test_a_default_device_mode_keeps_the_fusion():
    # torch.set_default_device and `with torch.device(...)` are TorchFunctionModes that change no silu or product:
    # a window opens over them (over any other mode, none does).
    x, dy = _data()
    fused, plain = _models()
    with torch.device("cpu"):
        a, b = _step(fused, x, dy), _step(plain, x, dy)
    assert swiglu_fusion_of(fused).last_forward == {"fused": 1}
    assert torch.equal(a[0], b[0])
    for p, q in zip(a[1:], b[1:]):
        assert sqnr_db(q, p) >= 25


def test_an_output_that_is_a_view_nobody_names_is_fused():
    # F.linear with a bias on a 3-D input returns a view of its 2-D result; `self.up(x).chunk(...)` keeps no
    # reference to it: the window keeps it until the next Linear.
    class Unnamed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(D, 2 * F_, bias=True)
            self.down = torch.nn.Linear(F_, D, bias=True)

        def forward(self, x):
            g, u = self.up(x).chunk(2, dim=-1)
            return self.down(F.silu(g) * u)

    torch.manual_seed(0)
    base = Unnamed().to(BF16)
    fused, plain = _convert(copy.deepcopy(base)), ops.convert(copy.deepcopy(base), fuse_swiglu=False)
    x, dy = (t.view(4, 64, D) for t in _data())
    with ops.high_precision(fused), ops.high_precision(plain):
        ya, yb = fused(x), plain(x)
        ya.backward(dy)
        yb.backward(dy)
    assert swiglu_fusion_of(fused).last_forward == {"fused": 1}
    assert torch.equal(ya, yb)
    for p, q in zip(fused.parameters(), plain.parameters()):
        assert sqnr_db(q.grad, p.grad) >= 40


def test_a_keyboard_interrupt_mid_forward_leaves_nothing_behind():
    x, dy = _data()
    fused, plain = _models()

    def interrupt(module, args, output):
        raise KeyboardInterrupt

    handle = fused.up.register_forward_hook(interrupt)  # after the window opened
    with pytest.raises(KeyboardInterrupt):
        fused(x.clone().requires_grad_(True))
    handle.remove()
    # the window the interrupted forward opened is still on the stack (no hook runs on a BaseException) ...
    assert torch.overrides._get_current_function_mode() is not None
    a, b = _step(fused, x, dy), _step(plain, x, dy)
    # ... until the next forward of the model, which starts over and leaves nothing behind
    assert torch.overrides._get_current_function_mode() is None
    assert swiglu_fusion_of(fused).last_forward == {"fused": 1}
    assert torch.equal(a[0], b[0])


def test_threads_sharing_a_model_keep_their_own_state():
    import threading

    x, dy = _data()
    fused, plain = _models()
    xr = x.clone().requires_grad_(True)
    want = torch.autograd.grad(plain(xr), xr, dy)[0]
    barrier = threading.Barrier(2, timeout=30)

    def meet(module, args, output):  # both threads inside a window at once
        barrier.wait()

    fused.up.register_forward_hook(meet)
    results = {}

    def run(name):
        xi = x.clone().requires_grad_(True)
        (dx,) = torch.autograd.grad(fused(xi), xi, dy)
        results[name] = (dx, type(torch.overrides._get_current_function_mode()).__name__)

    threads = [threading.Thread(target=run, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert set(results) == {"a", "b"}
    for dx, mode in results.values():
        assert mode == "NoneType"
        assert sqnr_db(want, dx) >= 25


def test_in_place_write_to_h_between_silu_and_product_is_not_fused_and_torch_refuses_the_backward():
    class Writes(MLP):
        def forward(self, x):
            h = self.up(x)
            self.h = h
            g, u = h[:, : self.f], h[:, self.f :]
            s = F.silu(g)
            h.mul_(2.0)  # after silu saved g
            return self.down(s * u)

    torch.manual_seed(0)
    model = _convert(Writes().to(BF16))
    x, dy = _data()
    y = model(x.requires_grad_(True))
    assert swiglu_fusion_of(model).last_forward == {"fused": 0}
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward(dy)


def test_a_write_to_h_after_the_product_is_refused_by_the_fused_save():
    class WritesAfter(MLP):
        def forward(self, x):
            h = self.up(x)
            self.h = h
            g, u = h.chunk(2, dim=-1)
            a = F.silu(g) * u
            h.zero_()
            return self.down(a)

    torch.manual_seed(0)
    model = _convert(WritesAfter().to(BF16))
    x, dy = _data()
    y = model(x.requires_grad_(True))
    assert swiglu_fusion_of(model).last_forward == {"fused": 1}
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward(dy)


def test_not_fused_without_grad_or_under_checkpointing_inside_the_model():
    x, dy = _data()
    fused, plain = _models()
    with torch.no_grad():
        assert torch.equal(fused(x), plain(x))
    assert swiglu_fusion_of(fused).last_forward == {"fused": 0}

    class Checkpointed(torch.nn.Module):
        def __init__(self, mlp):
            super().__init__()
            self.mlp = mlp

        def forward(self, x):
            return checkpoint(self.mlp, x, use_reentrant=False)

    outer = Checkpointed(MLP().to(BF16))
    torch.manual_seed(0)
    outer.mlp = MLP().to(BF16)
    ref = copy.deepcopy(outer)
    _convert(outer)
    ops.convert(ref, fuse_swiglu=False)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    outer(xa).backward(dy)  # a fused save here would not match the recomputation's: torch would raise
    ref(xb).backward(dy)
    assert swiglu_fusion_of(outer).last_forward == {"fused": 0}
    assert torch.equal(xa.grad, xb.grad)


class _Box:
    def __init__(self, t):
        self.t = t


def _bytes_saved_by_forward(model, x):
    """(bytes, output): what autograd holds for the backward at the end of model(x) (the distinct tensors that
    saved-tensor hooks around the forward packed and that are still alive then), and the output."""
    boxes = []

    def pack(t):
        box = _Box(t)
        boxes.append(weakref.ref(box))
        return box

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.t):
        y = model(x.clone().requires_grad_(True))
    alive = {}
    for ref in boxes:
        box = ref()
        if box is not None:
            t = box.t
            alive[(t.untyped_storage().data_ptr(), t.storage_offset(), t.shape)] = t.numel() * t.element_size()
    return sum(alive.values()), y


def test_a_callers_saved_tensor_hooks_around_the_model_see_less_saved():
    # Offloading-style hooks around the whole forward still fuse; what autograd still holds at the end of the
    # forward (the packed tensors alive then) is h once, without silu(g).
    x, dy = _data()
    fused, plain = _models()

    def held_bytes(model):
        held, y = _bytes_saved_by_forward(model, x)
        y.backward(dy)
        return held

    fused_bytes, plain_bytes = held_bytes(fused), held_bytes(plain)
    assert swiglu_fusion_of(fused).last_forward == {"fused": 1}
    # plain: g, u and silu(g), each (256, 128) bf16; fused: h (256, 256)
    assert plain_bytes - fused_bytes == 256 * F_ * 2


@pytest.mark.parametrize("pattern", ["product only", "silu plus u"])
def test_double_backward_through_the_fused_product_matches_torch(pattern, ahead):
    # A penalty on the gradient with respect to h (the FP8 Linears themselves have no second derivative):
    # the fused backward under create_graph=True is torch's differentiable formula.
    x, _ = _data(dtype=torch.float32)
    fused, plain = _models(pattern, dtype=torch.float32)
    w = torch.randn(x.shape[0], F_, generator=torch.Generator().manual_seed(2))

    def penalty(model):
        y = model(x)
        (gh,) = torch.autograd.grad((y * w).sum(), model.h, create_graph=True)
        gh.square().sum().backward()
        return [gh] + [p.grad for p in model.parameters()]

    got, want = penalty(fused), penalty(plain)
    assert swiglu_fusion_of(fused).last_forward == {"fused": int(pattern == "product only")}
    assert want[-1] is None and got[-1] is None  # the down projection is not used
    for p, q in zip(got[:-1], want[:-1]):
        assert sqnr_db(q, p) >= 60


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_silus_own_gradient_under_create_graph_is_torchs_bits(dtype, ahead):
    # silu(g) used outside a product: its gradient is the silu's own, which under create_graph=True (computed
    # ahead, _SiluOfHalf) is torch's differentiable formula op for op, so the bits of torch's F.silu (an
    # adversarial review found a float32 formula rounded once that differed from torch's bf16 bits).
    x, _ = _data(dtype=dtype)
    fused, plain = _models("silu plus u", dtype=dtype)
    w = torch.randn(x.shape[0], F_, generator=torch.Generator().manual_seed(2)).to(dtype)
    got = []
    for model in (fused, plain):
        y = model(x.clone().requires_grad_(True))
        (gh,) = torch.autograd.grad((y * w).sum(), model.h, create_graph=True)
        gh.square().sum().backward()
        got.append([gh, model.up.weight.grad])
    for p, q in zip(*got):
        assert torch.equal(p, q)


def test_compiled_model_is_left_to_the_compiler():
    x, dy = _data()
    fused, plain = _models()
    compiled = torch.compile(fused, backend="aot_eager", fullgraph=True)
    a, b = _step(compiled, x, dy), _step(plain, x, dy)
    assert swiglu_fusion_of(fused).last_forward == {"fused": 0}
    assert torch.equal(a[0], b[0])


def test_a_compiled_block_inside_an_eager_converted_model():
    # The eager model's window is open when the compiled block runs: the block's code is the compiler's.
    torch.manual_seed(0)
    base = torch.nn.Sequential(MLP(), MLP())
    fused = _convert(copy.deepcopy(base).to(BF16))
    plain = ops.convert(copy.deepcopy(base).to(BF16), fuse_swiglu=False)
    for model in (fused, plain):
        model[1] = torch.compile(model[1], backend="aot_eager", fullgraph=True)
    x, dy = _data()
    outs = []
    for model in (fused, plain):
        xr = x.clone().requires_grad_(True)
        y = model(xr)
        y.backward(dy)
        outs.append([y, xr.grad] + [p.grad for p in model.parameters()])
    assert swiglu_fusion_of(fused).last_forward == {"fused": 1}  # the eager block's only
    assert torch.equal(outs[0][0], outs[1][0])
    for p, q in zip(outs[0][1:], outs[1][1:]):
        assert sqnr_db(q, p) >= 25
    assert torch.overrides._get_current_function_mode() is None


def test_pickles_copies_and_is_freed_without_the_garbage_collector():
    from tests.ops.test_no_reference_cycles import _freed_without_gc

    fused, _ = _models()
    x, dy = _data()
    for clone in (copy.deepcopy(fused), pickle.loads(pickle.dumps(fused))):
        _step(clone, x, dy)
        assert swiglu_fusion_of(clone).last_forward == {"fused": 1}
    buf = io.BytesIO()
    torch.save(fused, buf)

    def step(model):
        _step(model, x, dy)
        assert swiglu_fusion_of(model).last_forward == {"fused": 1}

    _freed_without_gc(lambda: _models()[0], step)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_cuda_fused_holds_less_and_takes_the_kernel():
    # 8192 tokens, f 4096: silu(g) (64 MiB of bf16) is not kept between forward and backward; h's gradient is
    # the Triton kernel's (one launch), at least as close to float64 as torch's unfused backward.
    def held(fuse):
        torch.manual_seed(0)
        model = ops.convert(MLP(f=4096).to(BF16).cuda(), fuse_swiglu=fuse)  # h: 67M elements, above MIN_NUMEL
        x = torch.randn(8192, D, device="cuda", dtype=BF16)
        dy = torch.randn_like(x)
        _step(model, x, dy)  # warm-up: cuBLAS's workspace (32 MiB) is allocated by the first GEMM
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        xr = x.clone().requires_grad_(True)
        y = model(xr)
        kept = torch.cuda.memory_allocated() - base
        y.backward(dy)
        return kept, model, dy

    fused_kept, fused, dy = held(True)
    plain_kept, plain, _ = held(False)
    assert swiglu_fusion_of(fused).last_forward == {"fused": 1}
    assert abs(plain_kept - fused_kept - 64 * 2**20) < 2**20, (plain_kept / 2**20, fused_kept / 2**20)
    h = fused.h.detach()
    assert torch.equal(h, plain.h.detach())
    incoming = _incoming(fused, h, dy)
    assert torch.equal(fused.h.grad, act_bwd(incoming, h, "swiglu"))
    want = _dh_float64(h, incoming)
    assert sqnr_db(want, fused.h.grad) >= sqnr_db(want, plain.h.grad) - 0.05


def test_the_mode_is_on_only_from_a_large_output_to_the_next_linear():
    # The Linears' own Python, and the model's code before the up projection, run without it (host time).
    from float8.ops.swiglu_fusion import _FuseSwiGLU

    seen = []

    def where(name):
        seen.append((name, type(torch.overrides._get_current_function_mode()).__name__))

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(D, 2 * F_, bias=False)
            self.down = torch.nn.Linear(F_, D, bias=False)

        def forward(self, x):
            where("start")
            h = self.up(x)
            where("after up")
            g, u = h.chunk(2, dim=-1)
            y = self.down(F.silu(g) * u)
            where("after down")
            return y

    torch.manual_seed(0)
    model = _convert(Probe().to(BF16))
    model.up.register_forward_pre_hook(lambda m, a: where("in up"))
    model.down.register_forward_pre_hook(lambda m, a: where("in down"))
    x, dy = _data()
    model(x.requires_grad_(True)).backward(dy)
    assert seen == [
        ("start", "NoneType"),
        ("in up", "NoneType"),
        ("after up", _FuseSwiGLU.__name__),
        ("in down", "NoneType"),
        ("after down", _FuseSwiGLU.__name__),  # its output opens a window too; the forward's end closes it
    ]
    assert torch.overrides._get_current_function_mode() is None  # nothing left on the stack after the forward
    assert swiglu_fusion_of(model).last_forward == {"fused": 1}
    # with the default threshold, outputs this small open no window at all
    swiglu_fusion_of(model).min_numel = 1 << 24
    seen.clear()
    model(x).backward(dy)
    assert all(kind == "NoneType" for _, kind in seen) and swiglu_fusion_of(model).last_forward == {"fused": 0}


def test_the_window_after_a_blocks_last_linear_closes_when_the_block_returns():
    """The down projection's output opened a window that stayed open into the next block, until its first
    Linear: under FSDP2 the next block's all-gather hooks (hundreds of torch calls) ran through the mode. It
    closes when the module holding that Linear returns; what runs between blocks runs without it."""
    seen = []

    def where(name):
        seen.append((name, type(torch.overrides._get_current_function_mode()).__name__))

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(D, 2 * F_, bias=False)
            self.down = torch.nn.Linear(F_, D, bias=False)

        def forward(self, x):
            g, u = self.up(x).chunk(2, dim=-1)
            return x + self.down(F.silu(g) * u)

    torch.manual_seed(0)
    model = _convert(torch.nn.Sequential(Block(), Block()).to(BF16))
    model[0].register_forward_hook(lambda m, a, out: where("block 0 returned"))
    model[1].register_forward_pre_hook(lambda m, a: where("block 1 starts"))
    x, dy = _data()
    model(x.requires_grad_(True)).backward(dy)
    assert seen == [("block 0 returned", "NoneType"), ("block 1 starts", "NoneType")]
    assert swiglu_fusion_of(model).last_forward == {"fused": 2}
    assert torch.overrides._get_current_function_mode() is None


def test_an_error_inside_a_linear_leaves_no_mode_behind():
    model, _ = _models()
    with pytest.raises(ValueError, match="Linear expects input"):
        model(torch.randn(4, D + 1, dtype=BF16, requires_grad=True))  # wrong width: the Linear raises
    assert torch.overrides._get_current_function_mode() is None
    x, dy = _data()
    _step(model, x, dy)
    assert swiglu_fusion_of(model).last_forward == {"fused": 1}


def test_an_ops_sequential_inside_the_model_keeps_its_own_fusion_and_no_hooks():
    seq = ops.Sequential(ops.RMSNorm(D), ops.Linear(D, 2 * F_), ops.SwiGLU(), ops.Linear(F_, D))
    model = _convert(torch.nn.Sequential(seq, torch.nn.Linear(D, D)).to(BF16))
    assert swiglu_fusion_of(model) is not None
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in seq.modules())
    x, dy = _data()
    x.requires_grad_(True)
    model(x).backward(dy)
    assert x.grad is not None


def test_a_product_computed_ahead_is_handed_out_once_and_dropped_when_the_window_closes(ahead):
    from float8.ops.swiglu_fusion import _SiluOfHalf

    class Twice(MLP):
        def forward(self, x):
            h = self.up(x)
            self.h = h
            g, u = h.chunk(2, dim=-1)
            s = F.silu(g)
            a, b = s * u, s * u  # two products: two tensors
            self.kinds = (type(s.grad_fn).__name__, a.data_ptr() != b.data_ptr())
            return self.down(a + b)

    class Between(MLP):  # a Linear runs between the silu and the product: the window closed, what it noted
        # (the product computed ahead, h) was dropped, and the product is torch's
        def forward(self, x):
            h = self.up(x)
            self.h = h
            g, u = h.chunk(2, dim=-1)
            s = F.silu(g)
            _ = self.down(torch.zeros_like(u))
            return self.down(s * u)

    x, dy = _data()
    for cls, fused_count in ((Twice, 2), (Between, 0)):
        torch.manual_seed(0)
        base = cls().to(BF16)
        fused, plain = _convert(copy.deepcopy(base)), ops.convert(copy.deepcopy(base), fuse_swiglu=False)
        a, b = _step(fused, x, dy), _step(plain, x, dy)
        assert swiglu_fusion_of(fused).last_forward == {"fused": fused_count}
        assert torch.equal(a[0], b[0])
        for p, q in zip(a[1:], b[1:]):
            assert (p is None and q is None) or sqnr_db(q, p) >= 25  # h.grad: not retained here
        if cls is Twice:
            want = _SiluOfHalf._backward_cls.__name__ if ahead else "SiluBackward0"
            assert fused.kinds == (want, True)
