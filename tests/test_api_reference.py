"""The API reference builds from the docstrings (docs/build_api.py, pdoc), and documents every public name.

Fails when a docstring breaks pdoc (any warning is an error there), when a public module's page is missing,
or when a name a public module exports in `__all__` has no entry on its page.
"""

import importlib
import pathlib
import subprocess
import sys
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = {
    "float8": "float8.html",
    "float8.ops": "float8/ops.html",
    "float8.ops.functional": "float8/ops/functional.html",
    "float8.fsdp": "float8/fsdp.html",
    "float8.kernels": "float8/kernels.html",
}


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    pytest.importorskip("pdoc", reason='the docs extra (pip install -e ".[docs]"; the test extra has it too)')
    out = tmp_path_factory.mktemp("api")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "build_api.py"), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_every_public_module_has_a_page(api):
    for page in [*PAGES.values(), "index.html"]:
        assert (api / page).is_file(), page


@pytest.mark.parametrize("module", list(PAGES))
def test_every_exported_name_has_an_entry(api, module):
    html = (api / PAGES[module]).read_text()
    mod = importlib.import_module(module)
    names = getattr(mod, "__all__", None)
    if names is None:  # a module without __all__: its public functions
        names = [n for n, v in vars(mod).items() if callable(v) and not n.startswith("_") and v.__module__ == module]
    assert names
    submodules = [n for n in names if isinstance(getattr(mod, n), types.ModuleType)]
    for n in submodules:  # a page of its own
        assert (api / PAGES[module].replace(".html", f"/{n}.html")).is_file(), n
    missing = [n for n in names if n not in submodules and f'id="{n}"' not in html]
    assert not missing, missing
