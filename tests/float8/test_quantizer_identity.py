"""A Float8Tensor carries the identity of the quantizer that made it (issue 24, item 1).

The identity (float8/quantizer_id.py) is constants: the layout, the class's import path and its constructor
arguments. In-place writes re-quantize through the quantizer it names, the same way eagerly, compiled,
through views, after deepcopy and after a save and load; an FP8 GEMM reads the layout it declares instead of
guessing from the scale's shape. Granularities of one's own are defined here, in the test file alone.
"""

import copy
import io

import pytest
import torch

import float8.ops as ops
from float8 import Float8Tensor, Format, Recipe
from float8.gemm import fp8_mm, operand
from float8.quantizer import BlockwiseQuantizer, Quantizer, RowwiseQuantizer, ScaleLayout, TensorwiseQuantizer
from float8.quantizer_id import quantizer_id, rebuild_quantizer
from tests.tolerances import sqnr_db

BF16 = torch.bfloat16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
X = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 128)


class PerChannelQuantizer(Quantizer):
    """One scale per last-dim index, shared by all rows: scale_inv (1, ..., K). No FP8 GEMM reads it."""

    layout = ScaleLayout.OTHER

    def __init__(self, fp8_dtype: torch.dtype = E4M3) -> None:
        self.fp8_dtype = fp8_dtype

    def _quantize(self, x: torch.Tensor, with_transpose: bool) -> Float8Tensor:
        k = x.shape[-1]
        rows = x.reshape(-1, k).float()
        amax = rows.abs().amax(dim=0, keepdim=True)
        fp8_max = torch.finfo(self.fp8_dtype).max
        scale = torch.where(amax > 0, fp8_max / amax, torch.ones_like(amax))
        data = (rows * scale).clamp(-fp8_max, fp8_max).to(self.fp8_dtype).reshape(x.shape)
        scale_inv = (1.0 / scale).reshape(*([1] * (x.dim() - 1)), k)
        return Float8Tensor(data, scale_inv, x.dtype, quantizer_id=self.requantizer_id)


class PowerOfTwoRowQuantizer(Quantizer):
    """One power-of-two scale per row: the layout an FP8 GEMM reads (ROW), declared by the class."""

    layout = ScaleLayout.ROW

    def __init__(self, fp8_dtype: torch.dtype = E4M3) -> None:
        self.fp8_dtype = fp8_dtype

    def _quantize(self, x: torch.Tensor, with_transpose: bool) -> Float8Tensor:
        xf = x.float()
        amax = xf.abs().amax(dim=-1, keepdim=True)
        fp8_max = torch.finfo(self.fp8_dtype).max
        scale = torch.where(amax > 0, torch.exp2(torch.floor(torch.log2(fp8_max / amax))), torch.ones_like(amax))
        data = (xf * scale).clamp(-fp8_max, fp8_max).to(self.fp8_dtype)
        return Float8Tensor(data, 1.0 / scale, x.dtype, quantizer_id=self.requantizer_id)


def _same(a: Float8Tensor, b: Float8Tensor) -> bool:
    return torch.equal(a.fp8_data.view(torch.uint8), b.fp8_data.view(torch.uint8)) and torch.equal(
        a.scale_inv, b.scale_inv
    )


def test_an_identity_is_constants_that_rebuild_the_quantizer():
    qid = PerChannelQuantizer(E5M2).requantizer_id
    assert qid == (ScaleLayout.OTHER, f"{__name__}:PerChannelQuantizer", (E5M2,), ())
    again = rebuild_quantizer(qid, Quantizer)
    assert type(again) is PerChannelQuantizer and again.fp8_dtype == E5M2
    block = BlockwiseQuantizer(E4M3, block=(128, 128), margin=1)
    assert block.requantizer_id == quantizer_id(BlockwiseQuantizer(E4M3, block=(128, 128)))  # no margin in writes
    assert rebuild_quantizer(block.requantizer_id, Quantizer).block == (128, 128)


@pytest.mark.parametrize(
    "quantizer",
    [TensorwiseQuantizer(margin=2), RowwiseQuantizer(), BlockwiseQuantizer(block=(1, 128)), PerChannelQuantizer()],
    ids=["tensorwise", "rowwise", "block", "per-channel (here)"],
)
def test_a_write_re_quantizes_through_the_carried_quantizer(quantizer):
    t = quantizer.quantize(X)
    new = X.flip(0) * 3
    t.copy_(new)
    assert _same(t, quantizer.requantizer.quantize(new))


def test_a_granularity_of_ones_own_is_written_alike_everywhere():
    """Eager, through a view, detached, deep-copied, compiled and after a save and load: the same bits."""
    q = PerChannelQuantizer()
    new = X * 1000
    expected = q.quantize(new)

    def write(p):
        p.copy_(new)

    made = [q.quantize(X) for _ in range(6)]
    with torch.no_grad():
        write(made[0])
        write(made[1].view(64, 128))
        write(made[2].detach())
        copied = copy.deepcopy(made[3])
        write(copied)
        torch.compile(write, backend="aot_eager", fullgraph=True)(made[4])
        buf = io.BytesIO()
        torch.save(made[5], buf)
        loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
        write(loaded)
    for t in (made[0], made[1], made[2], copied, made[4], loaded):
        assert _same(t, expected)


def test_compiled_code_keeps_the_identity_of_the_tensors_it_makes():
    q = PerChannelQuantizer()

    def make(x):
        return q.quantize(x).view(-1, 128)[:32]

    eager = make(X)
    compiled = torch.compile(make, backend="aot_eager", fullgraph=True)(X)
    assert compiled._quantizer_id == eager._quantizer_id == q.requantizer_id


def test_a_write_a_transposed_view_cannot_take_names_the_problem():
    t = PerChannelQuantizer().quantize(X)
    with pytest.raises(ValueError, match="not laid out as its quantizer PerChannelQuantizer"):
        t.t().copy_(X.t())


def test_a_class_that_cannot_be_found_again_is_named():
    class Local(PerChannelQuantizer):
        pass

    t = Local().quantize(X)
    with pytest.raises(ValueError, match="cannot find the quantizer class .*Local"):
        t.copy_(X)


def test_files_saved_before_tensors_carried_an_identity_still_load():
    from float8.tensor import _rebuild_float8_tensor

    old = _rebuild_float8_tensor(
        torch.zeros(4, 16, dtype=torch.uint8), E4M3, torch.ones(4, 1), torch.float32, None, False
    )
    assert old._quantizer_id is None and old.requantizer.layout is ScaleLayout.ROW


def test_the_gemm_reads_the_declared_layout_not_the_scales_shape():
    """(1, 128) blocks over K = 128 give one scale per row, the shape of per-row scales: declared BLOCK, the
    FP8 GEMM leaves them alone; the same parts without a declared quantizer are taken by their shape."""
    x8 = BlockwiseQuantizer(block=(1, 128)).quantize(torch.randn(32, 128))
    w8 = Float8Tensor.quantize(torch.randn(64, 128))
    assert x8.scale_inv.shape == (32, 1)
    assert fp8_mm(x8, operand(w8, transposed=True)) is None
    parts = Float8Tensor(x8.fp8_data, x8.scale_inv, x8.dtype)
    assert fp8_mm(parts, operand(w8, transposed=True)) is not None


def test_a_row_granularity_of_ones_own_runs_fp8_gemms_in_a_linear_and_trains():
    torch.manual_seed(0)
    row4, row5 = PowerOfTwoRowQuantizer(E4M3), PowerOfTwoRowQuantizer(E5M2)
    recipe = Recipe(format=Format.HYBRID, input=row4, weight=row4, grad=row5)
    lin = ops.Linear(128, 64, recipe=recipe).to(BF16)
    x = torch.randn(256, 128, dtype=BF16)
    x8, w8 = PowerOfTwoRowQuantizer().quantize(x), PowerOfTwoRowQuantizer().quantize(lin.weight.detach())
    direct = fp8_mm(x8, operand(w8, transposed=True), bias=lin.bias.detach(), out_dtype=BF16, pad=True)
    assert direct is not None  # the declared ROW layout is one the FP8 GEMM reads
    with torch.no_grad():
        assert torch.equal(lin(x), direct)
    twin = torch.nn.Linear(128, 64).to(BF16)
    twin.load_state_dict(lin.state_dict())
    target = torch.randn(256, 64)
    opt = torch.optim.AdamW(lin.parameters(), lr=1e-2)
    losses = []
    for step in range(20):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(lin(x).float(), target)
        loss.backward()
        if step == 0:
            torch.nn.functional.mse_loss(twin(x).float(), target).backward()
            assert sqnr_db(twin.weight.grad.float(), lin.weight.grad.float()) > 20
        losses.append(loss.item())
        opt.step()
    assert losses[-1] < 0.7 * losses[0], losses


def test_an_identity_read_from_a_file_calls_nothing_but_a_quantizer_class():
    """A crafted file naming another callable (os.system) is refused, at load or at the first write."""
    from float8.tensor import _rebuild_float8_tensor

    evil = (ScaleLayout.TENSOR, "os:system", ("echo pwned",), ())
    t = Float8Tensor(torch.zeros(4, 16, dtype=E4M3), torch.ones(()), torch.float32, quantizer_id=evil)
    with pytest.raises(ValueError, match="not a subclass of Quantizer"):
        t.copy_(torch.ones(4, 16))
    with pytest.raises(ValueError, match="not a quantizer identity"):
        _rebuild_float8_tensor(
            torch.zeros(4, 16, dtype=torch.uint8), E4M3, torch.ones(()), torch.float32, None, False, ("os:system",)
        )


class TaggedRowwise(RowwiseQuantizer):
    """A subclass whose constructor takes something before the format (review finding)."""

    def __init__(self, tag: str = "", fp8_dtype: torch.dtype = E4M3) -> None:
        super().__init__(fp8_dtype)
        self.tag = tag


def test_subclasses_of_the_librarys_quantizers_write_with_the_librarys_requantizer():
    """A per-row subclass, one defined inside a function, and one whose constructor takes other arguments
    all write as per-row scaling of their format (what their layout is), with no class to find again."""

    class Local(RowwiseQuantizer):
        pass

    new = X.flip(0) * 3
    for q, fmt in ((TaggedRowwise("grad", E5M2), E5M2), (Local(), E4M3)):
        t = q.quantize(X)
        t.copy_(new)
        assert _same(t, RowwiseQuantizer(fmt).quantize(new))


def test_a_granularity_whose_constructor_is_not_described_is_refused_not_written_wrong():
    class_path = f"{__name__}:MisdescribedChannels"
    t = MisdescribedChannels("tag", E5M2).quantize(X)
    assert t._quantizer_id[1] == class_path
    with pytest.raises(ValueError, match="constructor_arguments"):
        t.copy_(X * 2)


class MisdescribedChannels(PerChannelQuantizer):
    """Its constructor takes a tag first, but it does not override constructor_arguments."""

    def __init__(self, tag: str = "", fp8_dtype: torch.dtype = E4M3) -> None:
        super().__init__(fp8_dtype)
        self.tag = tag


def test_per_row_tensors_concatenated_side_by_side_are_written_as_their_scales_now_are():
    """cat along the last dim gives two scales per row: the write takes 1 x 128 blocks, as before the
    identity was carried, rather than failing on the per-row quantizer."""
    q = RowwiseQuantizer()
    a, b = X[:, :64].contiguous(), X[:, 64:].contiguous()
    c = torch.cat([q.quantize(torch.cat([a, a], 1)), q.quantize(torch.cat([b, b], 1))], dim=1)
    assert c.scale_inv.shape == (64, 2)
    c.copy_(X.repeat(1, 2))
    assert _same(c, BlockwiseQuantizer(block=(1, 128)).quantize(X.repeat(1, 2)))


def test_an_identity_from_a_file_imports_nothing_and_builds_only_its_own_requantizer():
    import sys

    pytest.importorskip("numpy")
    if "numpy.f2py" in sys.modules:
        pytest.skip("numpy.f2py already imported: nothing left to show")
    lazy = (ScaleLayout.TENSOR, "numpy:f2py.Nope", (), ())  # numpy's module __getattr__ imports f2py
    t = Float8Tensor(torch.zeros(4, 16, dtype=E4M3), torch.ones(()), torch.float32, quantizer_id=lazy)
    with pytest.raises(ValueError, match="cannot find the quantizer class"):
        t.copy_(torch.ones(4, 16))
    assert "numpy.f2py" not in sys.modules
    static = (ScaleLayout.TENSOR, "float8.tensor:StaticQuantizer", (1.0,), ())  # would clip written values
    t = Float8Tensor(torch.zeros(4, 16, dtype=E4M3), torch.ones(()), torch.float32, quantizer_id=static)
    with pytest.raises(ValueError, match="not its own requantizer"):
        t.copy_(torch.ones(4, 16) * 1000)


def test_a_delayed_gradient_beside_per_row_inputs_records_one_amax_per_backward():
    """The per-row GEMMs ask the gradient quantizer for both operands at once (`Quantizer.operands`): a
    delayed state records the gradient's amax once per backward, not once per operand."""
    from float8 import DelayedScaling, RowwiseScaling

    recipe = Recipe(Format.HYBRID, RowwiseScaling(), RowwiseScaling(), DelayedScaling(history_len=4))
    torch.manual_seed(1)
    lin = ops.Linear(128, 128, recipe=recipe).to(BF16)
    for step in range(2):
        x = torch.randn(64, 128, dtype=BF16, requires_grad=True)
        (lin(x).square().sum() * 10**step).backward()
    history = lin.quantizers.grad.amax_history
    assert history[0] > 5 * history[1] > 0 and history[2] == 0, history  # two backwards, two amaxes
