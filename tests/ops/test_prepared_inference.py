"""An FP8-only Linear's repeated decode-size calls: the prepared launch (`Linear._prepared_forward`,
kernels/weight_only.py PreparedMM).

The first eager call of an input shape is checked and planned; later calls of that shape re-check only what can
change between calls and launch the compiled kernel directly. On the GPU: a prepared call gives the bits of the
checked op, sees every change of what it was prepared for (weight bytes written in place, a replaced weight or
bias, a bias moved to another tensor, grad mode, autocast, a non-contiguous input, ops.high_precision), and is
captured by a CUDA graph. On the CPU: nothing is prepared (the op is its reference), and copies of a model carry
no plans.
"""

import copy
import pickle

import pytest
import torch

import float8
import float8.ops as ops
from float8 import Float8Tensor, Recipe
from float8.kernels import rowwise_input_mm, weight_only

BF16 = torch.bfloat16


def _linear(k=256, n=128, bias=True, recipe=None, device="cuda", seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(k, n, bias=bias)).to(device, BF16)
    return ops.convert(model, recipe=recipe, fp8_weights=True)[0]


def _checked(lin, x):
    """The registered op, with all of its checks: what a prepared call must equal bit for bit."""
    w, b, x2 = lin.weight, lin.bias, x.reshape(-1, lin.in_features)
    fp8_input = x2.shape[0] >= lin.recipe.inference_fp8_input_from
    if fp8_input and rowwise_input_mm.supports(x2, w.fp8_data, w.scale_inv):
        y = rowwise_input_mm.fp8_rowwise_input_mm(x2, w.fp8_data, w.scale_inv, b)
    else:
        y = weight_only.fp8_weight_mm(x2, w.fp8_data, w.scale_inv, b)
    return y.reshape(*x.shape[:-1], lin.out_features)


def test_cpu_calls_prepare_nothing():
    lin = _linear(device="cpu")
    with torch.inference_mode():
        lin(torch.randn(4, 256, dtype=BF16))
    assert len(lin._inference_plans) == 0


def test_prepare_on_the_interpreter_launches_and_keeps_nothing():
    lin = _linear(k=64, n=32, device="cpu")
    x = torch.randn(3, 64, dtype=BF16)
    y, prepared = weight_only.prepare(x, lin.weight.fp8_data, lin.weight.scale_inv, lin.bias)
    assert prepared is None and y.shape == (3, 32) and y.dtype == BF16  # the values: tests/kernels


def test_copies_and_pickles_carry_no_plans():
    lin = _linear(device="cpu")
    lin._inference_plans.add(("shape", BF16), object())  # as a GPU call would leave it
    for twin in (copy.deepcopy(lin), pickle.loads(pickle.dumps(lin))):
        assert len(twin._inference_plans) == 0
        assert twin._inference_plans is not lin._inference_plans


def test_plans_are_bounded_and_cleared_by_a_new_weight():
    lin = _linear(device="cpu")
    kept = lin._inference_plans.scratch.get(("stream",), torch.float32, 64, torch.device("cpu"))
    for i in range(lin._inference_plans.MAX + 1):
        lin._inference_plans.add((i, BF16), object())
    assert len(lin._inference_plans) <= lin._inference_plans.MAX
    # Past the bound only this layer's plans go: the workspace, shared with the model's other layers, stays.
    held = lin._inference_plans.scratch.tensors()
    assert kept is not None and len(held) == 1 and held[0] is kept
    lin.refresh_fp8_weight()
    assert len(lin._inference_plans) == 0 and lin._inference_plans.scratch.tensors() == []
    lin._inference_plans.add((0, BF16), object())
    lin.bias = torch.nn.Parameter(torch.zeros(128, dtype=BF16))
    assert len(lin._inference_plans) == 0


gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("shape", [(1, 4096), (16, 4096), (2, 3, 4096), (128, 4096)])
@pytest.mark.parametrize("n", [256, 4096])  # 256 columns: split K, summed in one launch when prepared
@pytest.mark.parametrize("bias", [False, True])
def test_gpu_prepared_calls_give_the_checked_ops_bits(shape, n, bias):
    lin = _linear(k=4096, n=n, bias=bias)
    x = torch.randn(shape, device="cuda", dtype=BF16)
    with torch.inference_mode():
        first = lin(x)
        assert (x.shape, x.dtype) in lin._inference_plans
        for _ in range(3):
            assert torch.equal(lin(x), first)
        assert torch.equal(first, _checked(lin, x))


@gpu
@pytest.mark.parametrize("recipe", [Recipe.rowwise(), Recipe.blockwise()])
def test_gpu_row_and_block_scaled_weights(recipe):
    lin = _linear(k=512, n=256, recipe=recipe)
    x = torch.randn(8, 512, device="cuda", dtype=BF16)
    with torch.inference_mode():
        first = lin(x)
        assert torch.equal(lin(x), first) and torch.equal(first, _checked(lin, x))


@gpu
@pytest.mark.parametrize("tokens", [40, 128])
def test_gpu_fp8_input_recipe_prepared_eager_and_graphed_give_the_same_bits(tokens):
    """Recipe.inference_fp8_input_from=33: the row-quantized FP8 x FP8 kernel (a prepared call is one launch,
    its row quantization inside, a split K on this narrow layer summed in it; the checked op two launches),
    call after call on fresh inputs (a call that read another call's quantized rows, left in reused memory,
    would differ), its counters zero after each, under ops.graphed_inference too."""
    lin = _linear(k=4096, n=256, recipe=Recipe(inference_fp8_input_from=33))
    xs = [torch.randn(tokens, 4096, device="cuda", dtype=BF16) for _ in range(4)]
    with torch.inference_mode():
        want = _checked(lin, xs[0])
        assert torch.equal(lin(xs[0]), want)
        prepared = lin._inference_plans[(xs[0].shape, xs[0].dtype)]
        assert isinstance(prepared, rowwise_input_mm.PreparedRowwiseMM)
        for x in xs * 2:
            assert torch.equal(lin(x), _checked(lin, x))
            torch.cuda.synchronize()
            assert all(not c.any() for c in prepared.counts.values())
        graphed = ops.graphed_inference(lin)
        for x in xs:
            assert torch.equal(graphed(x), _checked(lin, x))


@gpu
def test_gpu_fp8_input_prepared_calls_on_two_streams_and_threads_count_apart():
    """The one-launch FP8-input call on two streams, from two host threads, queued behind a sleep on each so
    that they likely run at once (not proven): each (stream, thread) has its own counters, so no launch's
    programs wait on (or count into) another's; every output has the checked op's bits and every counter is
    back to zero. Shared counters would hang here rather than fail: the GPU tier's --timeout-method=thread
    turns that into a failed worker (.ci/gpu_tier.sh)."""
    import threading

    lin = _linear(k=4096, n=1024, recipe=Recipe(inference_fp8_input_from=33))
    xs = [torch.randn(64, 4096, device="cuda", dtype=BF16) for _ in range(2)]
    with torch.inference_mode():
        wants = [_checked(lin, v) for v in xs]
        lin(xs[0])
        streams = [torch.cuda.Stream() for _ in xs]
        outs = [[], []]

        def run(i):
            with torch.inference_mode(), torch.cuda.stream(streams[i]):
                torch.cuda._sleep(1_000_000)  # both streams' calls queue up behind it, then run side by side
                for _ in range(10):
                    outs[i].append(lin(xs[i]))

        for s in streams:
            s.wait_stream(torch.cuda.current_stream())
        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        torch.cuda.synchronize()
        prepared = lin._inference_plans[(xs[0].shape, xs[0].dtype)]
        assert len(prepared.counts) == 3 and all(not c.any() for c in prepared.counts.values())
        for i in range(2):
            assert len(outs[i]) == 10 and all(torch.equal(o, wants[i]) for o in outs[i])


@gpu
def test_gpu_prepared_calls_see_every_change(monkeypatch):
    lin = _linear()
    x = torch.randn(16, 256, device="cuda", dtype=BF16)
    with torch.inference_mode():
        lin(x)
        # Weight bytes and scale written in place (the same tensors): read by the next call.
        other = Float8Tensor.quantize(torch.randn(128, 256, device="cuda", dtype=BF16))
        lin.weight.copy_(other)
        assert torch.equal(lin(x), _checked(lin, x))
        # A new weight Parameter, a new bias Parameter, the bias moved to another tensor.
        lin.weight = torch.nn.Parameter(
            Float8Tensor.quantize(torch.randn(128, 256, device="cuda", dtype=BF16)), requires_grad=False
        )
        assert torch.equal(lin(x), _checked(lin, x))
        lin(x)
        lin.bias = torch.nn.Parameter(torch.randn(128, device="cuda", dtype=BF16))
        assert torch.equal(lin(x), _checked(lin, x))
        lin(x)
        lin.bias.data = torch.randn(128, device="cuda", dtype=BF16)
        assert torch.equal(lin(x), _checked(lin, x))
        # The weight's bytes and its scale moved to other storages under the same tensor objects (FSDP2 frees
        # and re-gathers storages so): a prepared call (counted: the checked path does not pass here) reads
        # their addresses afresh on each call.
        prepared_launches = []
        launch = weight_only.run_compiled
        monkeypatch.setattr(weight_only, "run_compiled", lambda *a: (prepared_launches.append(1), launch(*a))[1])
        lin(x)
        data, scale, before = lin.weight.fp8_data, lin.weight.scale_inv, lin.weight.fp8_data.data_ptr()
        moved = Float8Tensor.quantize(torch.randn(128, 256, device="cuda", dtype=BF16))
        data.set_(moved.fp8_data.clone())  # both inference tensors (the weight was replaced in this block)
        scale.set_(moved.scale_inv.clone())
        assert lin.weight.fp8_data is data and data.data_ptr() != before
        prepared_launches.clear()
        assert torch.equal(lin(x), _checked(lin, x)) and prepared_launches == [1]
        # ... and to an address off a 16-byte boundary, which the compiled kernel does not take: the checked path.
        big = torch.empty(128 * 256 + 1, device="cuda", dtype=data.dtype)
        big[1:].copy_(moved.fp8_data.reshape(-1))
        data.set_(big.untyped_storage(), 1, (128, 256), (256, 1))
        assert data.data_ptr() % 16 and torch.equal(data, moved.fp8_data)
        prepared_launches.clear()
        assert torch.equal(lin(x), _checked(lin, x)) and prepared_launches == []
        monkeypatch.undo()
        # The same shape, 2 bytes off a 16-byte boundary (Triton specializes on alignment).
        odd = torch.randn(16 * 256 + 1, device="cuda", dtype=BF16)[1:].view(16, 256)
        assert torch.equal(lin(odd), _checked(lin, odd))
        # The same shape, not contiguous.
        xt = torch.randn(256, 16, device="cuda", dtype=BF16).t()
        assert torch.equal(lin(xt), _checked(lin, xt.contiguous()))
        # ops.high_precision: the dequantized weight in bf16, not the FP8 kernel.
        with ops.high_precision(lin):
            hp = lin(x)
        assert torch.equal(hp, torch.nn.functional.linear(x, lin.weight.dequantize(BF16), lin.bias))
    # Grad mode with an input that requires grad: parameters made under inference_mode cannot be saved
    # for backward, and torch's own Linear raises the same error; with parameters made outside it, the
    # general path records a backward.
    xg = x.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
        lin(xg)
    lin.weight = torch.nn.Parameter(
        Float8Tensor.quantize(torch.randn(128, 256, device="cuda", dtype=BF16)), requires_grad=False
    )
    lin.bias = torch.nn.Parameter(torch.randn(128, device="cuda", dtype=BF16))
    assert lin(xg).requires_grad
    # Autocast to float16: the product in float16, as nn.Linear gives.
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.float16):
        assert lin(x).dtype == torch.float16


@gpu
def test_gpu_a_cuda_graph_captures_prepared_calls():
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.SiLU(), torch.nn.Linear(512, 256, bias=False))
    model = ops.convert(model.to("cuda", BF16), fp8_weights=True)
    x = torch.randn(16, 256, device="cuda", dtype=BF16)
    with torch.inference_mode():
        want = model(x)
        model(x)  # prepared now
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)


def _split_k_linear(tokens=16):
    # 16 tokens: 8 column tiles of 32, K split in 4; 128 tokens: 2 swapped tiles of 128, K split in 8
    # (kernels/weight_only.py CONFIGS, split_k_for)
    lin = _linear(k=4096, n=256)
    x = torch.randn(tokens, 4096, device="cuda", dtype=BF16)
    return lin, x


@gpu
@pytest.mark.parametrize("tokens", [16, 128])
def test_gpu_split_k_prepared_call_is_one_launch_and_its_counters_stay_zero(tokens):
    """The prepared split-K call sums its partials in its one kernel (the last program of each tile): the
    checked op's bits (two launches), call after call, and its tile counters are back to zero after each."""
    lin, x = _split_k_linear(tokens)
    with torch.inference_mode():
        want = _checked(lin, x)
        lin(x)
        prepared = lin._inference_plans[(x.shape, x.dtype)]
        assert prepared.split_shape is not None
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            lin(x)
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if "kernel" in e.name]
        assert sum("_fp8_weight_mm_kernel" in k for k in kernels) == 1, kernels
        assert not any("_split_k_sum_kernel" in k for k in kernels), kernels
        for i in range(20):
            assert torch.equal(lin(x + i), _checked(lin, x + i))
        torch.cuda.synchronize()
        for counts in prepared.counts.values():
            assert counts.numel() == {16: 8, 128: 2}[tokens] and not counts.any()
        assert torch.equal(lin(x), want)


def _workspace_needs(lin) -> dict:
    """The largest workspace each dtype's buffer must hold for lin's prepared calls, from the call shapes: a
    split K's float32 partials (splits x M x N), the FP8 input's rows and scales (M K rounded up to 16
    bytes, plus 4 M)."""
    need = {}
    for (shape, _), p in lin._inference_plans.items():
        m, n, k = shape.numel() // shape[-1], lin.out_features, lin.in_features
        if p.split_shape is not None:
            assert p.split_shape[1:] == (m, n)
            need[torch.float32] = max(need.get(torch.float32, 0), p.split_shape[0] * m * n)
        if isinstance(p, rowwise_input_mm.PreparedRowwiseMM):
            need[torch.uint8] = max(need.get(torch.uint8, 0), -(-m * k // 16) * 16 + 4 * m)
    return need


@gpu
@pytest.mark.parametrize("recipe", [None, Recipe(inference_fp8_input_from=33)], ids=["weight-only", "fp8-input"])
def test_gpu_prepared_calls_of_every_shape_share_one_kept_workspace(recipe):
    """A layer's prepared calls write their workspace (a split K's partial sums, the FP8 input's rows and
    scales) to one kept buffer per dtype (one stream, one thread here), grown to the largest call when a
    larger shape comes: each call gives the checked op's bits even with the buffer filled with NaN or 0xFF
    bytes before it (nothing is read that the call did not write), float8.memory_footprint counts it, and
    dropping the plans drops it."""
    lin = _linear(k=4096, n=256, recipe=recipe)
    scratch = lin._inference_plans.scratch
    base = float8.memory_footprint(lin)
    with torch.inference_mode():
        for tokens in (16, 128, 48, 16, 128, 64, 1):
            for _ in range(2):  # the first call of a shape prepares it, the second is a prepared call
                for t in scratch.tensors():
                    t.fill_(float("nan") if t.is_floating_point() else 255)
                x = torch.randn(tokens, 4096, device="cuda", dtype=BF16)
                assert torch.equal(lin(x), _checked(lin, x)), tokens
        torch.cuda.synchronize()
        need = _workspace_needs(lin)
        held = {t.dtype: t.numel() for t in scratch.tensors()}
        assert need and held == need, (held, need)
        assert float8.memory_footprint(lin) == base + sum(t.nbytes for t in scratch.tensors())
        lin.refresh_fp8_weight()
        assert scratch.tensors() == [] and float8.memory_footprint(lin) == base


@gpu
@pytest.mark.parametrize("recipe", [None, Recipe(inference_fp8_input_from=33)], ids=["weight-only", "fp8-input"])
def test_gpu_a_converted_models_linears_share_one_workspace(recipe):
    """ops.convert gives a model's Linears one kept workspace: the layers take turns with one buffer per
    dtype, the size of the largest call of any of them, and each call keeps the checked op's bits."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.SiLU(), torch.nn.Linear(4096, 1024))
    ops.convert(model.to("cuda", BF16), fp8_weights=True, recipe=recipe)
    first, last = model[0], model[2]
    scratch = first._inference_plans.scratch
    assert last._inference_plans.scratch is scratch
    with torch.inference_mode():
        for tokens in (16, 128, 64, 16):
            for _ in range(2):
                for t in scratch.tensors():
                    t.fill_(float("nan") if t.is_floating_point() else 255)
                x = torch.randn(tokens, 4096, device="cuda", dtype=BF16)
                want = _checked(last, torch.nn.functional.silu(_checked(first, x)))
                assert torch.equal(model(x), want), tokens
        torch.cuda.synchronize()
        need = {}
        for lin in (first, last):
            for dtype, numel in _workspace_needs(lin).items():
                need[dtype] = max(need.get(dtype, 0), numel)
        assert need and {t.dtype: t.numel() for t in scratch.tensors()} == need


@gpu
def test_gpu_split_k_prepared_calls_on_two_streams_count_apart():
    """Two streams running the same prepared layer at once: each stream has its own tile counters, so each
    call's last program sees only its own partials."""
    lin, x = _split_k_linear()
    xs = [torch.randn(16, 4096, device="cuda", dtype=BF16) for _ in range(2)]
    with torch.inference_mode():
        wants = [_checked(lin, v) for v in xs]
        lin(x)
        streams = [torch.cuda.Stream() for _ in xs]
        for s in streams:
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                torch.cuda._sleep(2_000_000)  # both streams' calls queue up behind it, then run side by side
        outs = [[], []]
        for _ in range(10):
            for i, s in enumerate(streams):
                with torch.cuda.stream(s):
                    outs[i].append(lin(xs[i]))
        torch.cuda.synchronize()
        assert len(lin._inference_plans[(x.shape, x.dtype)].counts) == 3
        for i in range(2):
            assert all(torch.equal(o, wants[i]) for o in outs[i])


@gpu
@pytest.mark.parametrize("warm_on_the_capture_stream", [False, True])
def test_gpu_split_k_prepared_calls_in_a_cuda_graph(warm_on_the_capture_stream):
    """A split-K call captured in a CUDA graph is one launch whose tile counters are graph memory, zeroed by
    the graph before each replay, even when the capture reuses that memory after the call (filled with -1
    here): the graph keeps replaying the checked op's bits after the plans are dropped (a reload does that)
    and their memory is reused, and eager calls on the capture stream between replays keep theirs."""
    lin, x = _split_k_linear()
    with torch.inference_mode():
        want = _checked(lin, x)
        lin(x)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        if warm_on_the_capture_stream:
            with torch.cuda.stream(stream):
                lin(x)  # this stream's counters exist before the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = lin(x)
            for _ in range(8):  # the freed counters' memory, and more, written over inside the graph
                torch.full((256,), -1, device="cuda", dtype=torch.int32)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if "kernel" in e.name]
        assert sum("_fp8_weight_mm_kernel" in k for k in kernels) == 1, kernels
        assert not any("_split_k_sum_kernel" in k for k in kernels), kernels
        lin._inference_plans.clear()
        churn = [torch.full((4096,), -1, device="cuda", dtype=torch.int32) for _ in range(64)]
        x2 = torch.randn(16, 4096, device="cuda", dtype=BF16)
        want2 = _checked(lin, x2)
        stream.wait_stream(torch.cuda.current_stream())
        for _ in range(3):
            graph.replay()
            with torch.cuda.stream(stream):
                eager = lin(x2)
            torch.cuda.synchronize()
            assert torch.equal(out, want) and torch.equal(eager, want2)
        assert all(bool((c == -1).all()) for c in churn)


@gpu
def test_gpu_fp8_input_recipe_compiled_model_gives_the_eager_bits():
    """A converted model with Recipe(inference_fp8_input_from=33) at 96 tokens, torch.compile(fullgraph=True)
    with inductor: the eager bits (the same two kernels, launched by inductor)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.SiLU(), torch.nn.Linear(4096, 1024))
    ops.convert(model.to("cuda", BF16), fp8_weights=True, recipe=Recipe(inference_fp8_input_from=33))
    x = torch.randn(2, 48, 4096, device="cuda", dtype=BF16)
    torch._dynamo.reset()
    with torch.inference_mode():
        assert torch.equal(torch.compile(model, fullgraph=True)(x), model(x))
