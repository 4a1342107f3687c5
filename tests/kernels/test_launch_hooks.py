"""kernels/launch.py run_compiled passes Triton's launch hooks only when a hook is registered: an empty
HookChain (Triton's default) is skipped together with the launch metadata built for it, a registered hook is
called with that metadata as Triton's own launch calls it."""

import pytest
import torch

from float8.kernels.launch import live_hook, run_compiled

knobs = pytest.importorskip("triton.knobs")
needs_chains = pytest.mark.skipif(
    not hasattr(knobs.runtime.launch_enter_hook, "calls"), reason="this Triton has no HookChain launch hooks"
)


class _FakeCompiled:
    function, packed_metadata = "fn", "packed"

    def __init__(self):
        self.metadata_calls, self.ran = 0, None

    def launch_metadata(self, grid, stream, *args):
        self.metadata_calls += 1
        return {"grid": grid, "stream": stream}

    def run(self, *args):
        self.ran = args


@needs_chains
def test_live_hook():
    chain = type(knobs.runtime.launch_enter_hook)()
    assert live_hook(None) is None and live_hook(chain) is None
    chain.add(print)
    assert live_hook(chain) is chain
    assert live_hook(print) is print  # a plain function, as older Tritons took

    class Counting:  # a user's hook object with a `calls` of its own: kept, whatever its value
        calls = []

        def __call__(self, metadata):
            pass

    hook = Counting()
    assert live_hook(hook) is hook


@needs_chains
def test_run_compiled_skips_empty_hooks_and_calls_registered_ones(monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 77, raising=False)  # a CPU build lacks it
    # Empty chains in place of whatever a profiler may have registered in this process.
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", type(knobs.runtime.launch_enter_hook)())
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", type(knobs.runtime.launch_exit_hook)(reversed=True))
    fake = _FakeCompiled()
    run_compiled(fake, (3,), 0, ("x", 5))
    assert fake.ran == (3, 1, 1, 77, "fn", "packed", None, None, None, "x", 5) and fake.metadata_calls == 0
    seen = []
    hook = seen.append
    knobs.runtime.launch_exit_hook.add(hook)  # an exit hook alone still gets the metadata
    try:
        run_compiled(fake, (3, 2), 0, ("x",))
    finally:
        knobs.runtime.launch_exit_hook.remove(hook)
    meta = {"grid": (3, 2), "stream": 77}
    assert fake.ran[6:9] == (meta, None, knobs.runtime.launch_exit_hook) and fake.metadata_calls == 1


def test_run_compiled_calls_the_launcher_in_tritons_argument_order():
    """run_compiled's positional call matches the NVIDIA launcher's parameters in this Triton: named up to the
    hooks (Triton 3.9), or, in Triton 3.6 (the GPU machines'), named up to `function` and the rest, kernel
    metadata, launch metadata, the two hooks and the kernel's arguments in that order, passed on as *args to
    the compiled C launcher (which the GPU tier's prepared launches exercise: their bits equal the checked
    path's)."""
    import inspect

    driver = pytest.importorskip("triton.backends.nvidia.driver")
    signature = inspect.signature(driver.CudaLauncher.__call__)
    params = list(signature.parameters.values())[1:10]
    names = [p.name for p in params]
    assert names[:5] == ["gridX", "gridY", "gridZ", "stream", "function"]
    if params[5].kind is inspect.Parameter.VAR_POSITIONAL:
        source = inspect.getsource(driver.CudaLauncher.__call__)
        assert "self.launch(gridX, gridY, gridZ, stream, function," in source and "*args)" in source
    else:
        assert names[5:9] == ["kernel_metadata", "launch_metadata", "launch_enter_hook", "launch_exit_hook"]
