"""Every public function of the library, and every public method of its public classes, has type hints: each
parameter (but self and cls) and the return.

Read with `ast` (nothing is imported) from the three packages pyproject.toml installs: float8/, ops/,
kernels/. Public: the name does not start with an underscore (dunder methods included as private), in a
class whose name does not either. @triton.jit kernels are exempt: their parameters are typed by Triton
(pointers, scalars, tl.constexpr), not by Python. One case per package, naming each function and what
it lacks.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FOLDERS = {"float8": ROOT / "float8", "float8.ops": ROOT / "ops", "float8.kernels": ROOT / "kernels"}


def _is_triton_kernel(fn: ast.FunctionDef) -> bool:
    """Decorated with @triton.jit (or a `from triton import jit`'s @jit), called or not."""
    names = {ast.unparse(d.func if isinstance(d, ast.Call) else d) for d in fn.decorator_list}
    return bool(names & {"triton.jit", "jit"})


def _lacking(fn: ast.FunctionDef) -> list[str]:
    args = fn.args
    params = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    lacking = [a.arg for a in params if a.annotation is None and a.arg not in ("self", "cls")]
    lacking += [f"*{a.arg}" for a in (args.vararg, args.kwarg) if a is not None and a.annotation is None]
    if fn.returns is None:
        lacking.append("return")
    return lacking


def public_functions_lacking_hints(folder: pathlib.Path) -> list[str]:
    """'file:line name: what it lacks' for each public function or method without a full set of hints."""
    found = []
    for path in sorted(folder.glob("*.py")):
        scopes = [(ast.parse(path.read_text()).body, "")]
        while scopes:
            body, owner = scopes.pop()
            for node in body:
                if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                    scopes.append((node.body, f"{node.name}."))
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    if node.name.startswith("_") or _is_triton_kernel(node):
                        continue
                    lacking = _lacking(node)
                    if lacking:
                        where = f"{path.relative_to(folder.parent)}:{node.lineno}"
                        found.append(f"{where} {owner}{node.name}: {', '.join(lacking)}")
    return found


@pytest.mark.parametrize("package", list(FOLDERS))
def test_public_functions_have_type_hints(package):
    lacking = public_functions_lacking_hints(FOLDERS[package])
    assert not lacking, f"{len(lacking)} public functions without full type hints:\n" + "\n".join(lacking)


def test_the_check_sees_a_missing_hint(tmp_path):
    """Wrong-reference check: a module with an unannotated public function, a typed one, a private one and a
    Triton kernel; only the first is reported."""
    (tmp_path / "m.py").write_text(
        "import triton\n"
        "def f(x, y: int):\n    return x\n"
        "def g(x: int) -> int:\n    return x\n"
        "def _h(x):\n    return x\n"
        "class C:\n    def m(self, z) -> None:\n        pass\n"
        "@triton.jit\ndef k(p):\n    pass\n"
        "@torch.jit.script\ndef s(q):\n    return q\n"
    )
    lacking = public_functions_lacking_hints(tmp_path)
    assert sorted(entry.split(" ", 1)[1] for entry in lacking) == ["C.m: z", "f: x, return", "s: q, return"]
