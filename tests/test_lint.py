"""The tree is clean under the project's ruff configuration (pyproject.toml [tool.ruff]): lint and format.

ruff comes with the test extra (`pip install -e ".[test]"`); a run without it fails here, naming the fix,
rather than skipping the check.
"""

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _ruff() -> list:
    try:
        import ruff  # noqa: F401
    except ImportError:
        if shutil.which("ruff") is None:
            pytest.fail('ruff is not installed: pip install -e ".[test]" (or pip install ruff)')
        return ["ruff"]
    return [sys.executable, "-m", "ruff"]


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]], ids=["lint", "format"])
def test_ruff_is_clean(args):
    done = subprocess.run([*_ruff(), *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"ruff {' '.join(args)} (run it, or `ruff format .`):\n{done.stdout}{done.stderr}"


def test_no_library_file_over_600_lines():
    """Small files with one concern: a library module past 600 lines is split by concern (the norm and
    activation kernels were, into forward, backward, launchers and references)."""
    long = {
        str(p.relative_to(ROOT)): n
        for folder in ("float8", "ops", "kernels")
        for p in (ROOT / folder).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 600
    }
    assert not long, f"library files over 600 lines (split them by concern): {long}"
