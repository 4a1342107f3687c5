"""The repository's kernels/ and ops/ folders are float8.kernels and float8.ops, under any name they are reached by.

With the repository root on sys.path, `import kernels` finds the kernels/ folder; transformers does exactly that
when it probes for Hugging Face's kernel hub (a package also named `kernels`). Run a second time, the modules
would define every float8:: op again and torch would drop the first definitions, leaving the operator handles
taken from them dangling: dynamo's fake-tensor calls then crashed at random (kernels/__init__.py). Each check
runs in a fresh interpreter, so that nothing this test process imported answers for it."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str) -> subprocess.CompletedProcess:
    prelude = f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=300, cwd=ROOT)


_CHECK = """
import torch, float8
assert sys.modules["kernels"] is float8.kernels, sys.modules["kernels"]
second = sorted(m for m in sys.modules if m.startswith("kernels."))
assert not second, second
x = torch.tensor([1.0, -3.0, 2.0])
assert torch.ops.float8.amax(x).item() == 3.0  # the first definitions are the live ones
print("OK")
"""


@pytest.mark.parametrize("first", ["float8", "kernels"])
def test_kernels_folder_imported_by_its_bare_name_is_float8_kernels(first):
    run = _run(f"import {first}\nimport kernels\n" + _CHECK)
    assert run.returncode == 0 and "OK" in run.stdout, run.stderr[-3000:]


def test_transformers_probe_for_a_kernels_package_defines_nothing_twice():
    pytest.importorskip("transformers")
    code = "import float8\nfrom transformers.utils import import_utils\n"
    code += "assert not import_utils.is_kernels_available()  # our folder is not Hugging Face's kernel hub\n"
    run = _run(code + _CHECK)
    assert run.returncode == 0 and "OK" in run.stdout, run.stderr[-3000:]


@pytest.mark.parametrize("module", ["kernels.quantize", "ops.cross_entropy"])
def test_a_second_copy_of_a_module_defining_ops_is_refused(module):
    run = _run(f"import float8.ops\nimport {module}\n")
    assert run.returncode != 0
    assert "is defined already" in run.stderr and "float8.kernels and float8.ops" in run.stderr, run.stderr[-3000:]


def test_reloading_a_module_that_defines_ops_is_refused_and_the_first_definition_stays():
    code = "import importlib, torch, float8\nm = importlib.import_module('float8.kernels.amax')\n"
    code += "try:\n    importlib.reload(m)\nexcept RuntimeError as e:\n    assert 'reloaded' in str(e), e\n"
    code += "else:\n    raise AssertionError('the reload went through')\n"
    code += "assert torch.ops.float8.amax(torch.tensor([2.0, -5.0])).item() == 5.0\nprint('OK')\n"
    run = _run(code)
    assert run.returncode == 0 and "OK" in run.stdout, run.stderr[-3000:]
