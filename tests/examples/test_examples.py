"""Every example runs (in a fresh process, as a user would run it) so none goes stale."""

import pathlib
import subprocess
import sys

import pytest

EXAMPLES = sorted((pathlib.Path(__file__).parents[2] / "examples").glob("*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path, tmp_path):
    out = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip(), "an example should say what it did"


def test_there_are_examples():
    assert EXAMPLES
