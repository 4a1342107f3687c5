"""The repository's kernels/ and ops/ folders are float8.kernels and float8.ops when reached by their bare names.

With the repository root on sys.path, `import kernels` finds the kernels/ folder; transformers does exactly that
when it probes for Hugging Face's kernel hub (a package also named `kernels`). Run a second time, the modules
would define every float8:: op again and torch would drop the first definitions, leaving the operator handles
taken from them dangling: dynamo's fake-tensor calls then crashed at random (kernels/__init__.py). Each check
runs in a fresh interpreter, so that nothing this test process imported answers for it."""

import ast
import importlib.machinery
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(code: str, path: pathlib.Path = ROOT) -> subprocess.CompletedProcess:
    prelude = f"import sys; sys.path.insert(0, {str(path)!r})\n"
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=300, cwd=ROOT)


_BEFORE = f"import pathlib, torch\nfrom torch._library.custom_ops import OPDEFS\nROOT_STR = {str(ROOT)!r}\n"
_CHECK = """
import float8, float8.ops
for bare in ("kernels", "ops"):  # the canonical package, or another installed package of that name
    module = sys.modules.get(bare, getattr(float8, bare))
    ours = module is getattr(float8, bare)
    where = pathlib.Path(getattr(module, "__file__", None) or "/").resolve()
    assert ours or not where.is_relative_to(pathlib.Path(ROOT_STR, bare).resolve()), module
    for name, sub in list(sys.modules.items()):  # and then every bare-name submodule is the canonical one
        if ours and name.startswith(bare + "."):
            assert sub is sys.modules.get("float8." + name), (name, sub)
assert OPDEFS["float8::amax"] is first and OPDEFS["float8::addmm_float32_"] is first_ce  # never redefined
assert torch.ops.float8.amax(torch.tensor([1.0, -3.0, 2.0])).item() == 3.0
print("OK")
"""


def _installed_elsewhere(name: str) -> bool:
    """Whether a package `name` other than the repository's folder is importable (Hugging Face's kernel hub
    is `kernels`, Juju's framework is `ops`): then the bare name means it."""
    paths = [p for p in sys.path if pathlib.Path(p or ".").resolve() != ROOT]
    spec = importlib.machinery.PathFinder.find_spec(name, paths)
    return spec is not None and spec.loader is not None


def _first_definitions(imports: str) -> str:
    return imports + "\nfirst, first_ce = OPDEFS['float8::amax'], OPDEFS['float8::addmm_float32_']\n"


@pytest.mark.parametrize(
    "imports",
    [
        "import float8.ops\nimport kernels, ops",
        "import kernels\nimport float8.ops",  # the bare name first
        "import float8.ops\nimport kernels.quantize, kernels.launch, ops.linear\nfrom kernels import amax",
    ],
)
def test_bare_names_are_the_canonical_packages_and_define_nothing_twice(imports):
    if _installed_elsewhere("kernels") or _installed_elsewhere("ops"):
        pytest.skip("another package named kernels or ops is installed: the bare names mean it")
    code = _BEFORE + _first_definitions(imports) + _CHECK
    if "ops.linear" in imports:
        code += "assert ops.linear.Linear is float8.ops.Linear\n"
    run = _run(code)
    assert run.returncode == 0 and "OK" in run.stdout, run.stderr[-3000:]


def test_transformers_probe_for_a_kernels_package_defines_nothing_twice():
    pytest.importorskip("transformers")
    code = _BEFORE + _first_definitions("import float8.ops\nfrom transformers.utils import import_utils")
    if not _installed_elsewhere("kernels"):  # our folder is not Hugging Face's kernel hub
        code += "assert not import_utils.is_kernels_available()\n"
    run = _run(code + _CHECK)
    assert run.returncode == 0 and "OK" in run.stdout, run.stderr[-3000:]


def test_another_installed_package_of_the_bare_name_is_what_the_name_means(tmp_path):
    """Hugging Face's kernel hub is also `kernels`: with it installed, `import kernels` must give it, not our
    folder, even with the repository root first on sys.path."""
    hub = tmp_path / "kernels"
    hub.mkdir()
    (hub / "__init__.py").write_text("def get_kernel(name):\n    return 'hub:' + name\n")
    (hub / "layers.py").write_text("NAME = 'hub layers'\n")
    code = f"sys.path.append({str(tmp_path)!r})\n" + _BEFORE + _first_definitions("import float8.ops")
    code += "import kernels, kernels.layers\nfrom kernels import get_kernel\n"
    code += "assert get_kernel('x') == 'hub:x' and kernels.layers.NAME == 'hub layers', kernels\n"
    run = _run(code + _CHECK)
    assert run.returncode == 0 and "OK" in run.stdout, run.stderr[-3000:]


def test_reloading_a_module_that_defines_ops_is_refused_before_it_changes_anything():
    code = "import importlib, torch, float8\nm = importlib.import_module('float8.kernels.amax')\n"
    code += "launcher = m._launch_amax\n"
    code += "try:\n    importlib.reload(m)\nexcept RuntimeError as e:\n    assert 'reloaded' in str(e), e\n"
    code += "else:\n    raise AssertionError('the reload went through')\n"
    code += "assert m._launch_amax is launcher  # refused before its first definition: nothing of it re-ran\n"
    code += "assert torch.ops.float8.amax(torch.tensor([2.0, -5.0])).item() == 5.0\nprint('OK')\n"
    run = _run(code)
    assert run.returncode == 0 and "OK" in run.stdout, run.stderr[-3000:]


def test_the_kernels_folder_itself_on_sys_path_is_refused_by_name():
    run = _run("import common\n", path=ROOT / "kernels")
    assert run.returncode != 0 and "is float8.kernels.common, imported here as 'common'" in run.stderr, run.stderr


def test_every_module_defining_ops_refuses_a_second_run_before_its_first_definition():
    """A module run a second time must raise before it defines anything (a reload would otherwise leave it
    half new, half old): its first statement after the docstring and the imports is refuse_redefinition of
    its first op."""
    found = 0
    for path in sorted([*(ROOT / "kernels").glob("*.py"), *(ROOT / "ops").glob("*.py")]):
        text = path.read_text()
        ops = re.findall(r'(?:custom_op|triton_op)\("(float8::\w+)"', text)
        if not ops:
            continue
        found += 1
        body = [n for n in ast.parse(text).body if not isinstance(n, (ast.Import, ast.ImportFrom))]
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        first = ast.unparse(body[0])
        assert first == f"refuse_redefinition('{ops[0]}', __name__)", f"{path.name}: first statement {first!r}"
    assert found >= 13


def test_a_copy_of_the_folder_elsewhere_on_sys_path_is_not_another_package(tmp_path):
    """Another checkout (or a copy of kernels/__init__.py) on sys.path is this folder again, not a package of
    the same name: loading it as one would resolve the bare name again without end."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text((ROOT / "kernels" / "__init__.py").read_text())
    code = f"sys.path.append({str(tmp_path)!r})\n" + _BEFORE + _first_definitions("import float8.ops\nimport kernels")
    run = _run(code + "assert kernels is float8.kernels, kernels\n" + _CHECK)
    assert run.returncode == 0 and "OK" in run.stdout, run.stderr[-3000:]
