"""Every example runs (in a fresh process, as a user would run it) so none goes stale."""

import pathlib
import subprocess
import sys

import pytest

EXAMPLES = sorted((pathlib.Path(__file__).parents[2] / "examples").glob("*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path, tmp_path):
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip(), "an example should say what it did"
    for bad in MUST_NOT_PRINT.get(path.stem, ()):
        assert bad not in out.stdout, (bad, out.stdout[-2000:])


# What an example printed that misled a reader (issue 23 item 13): a nan column where the CPU has no peak
# counter; a verdict on the 1% target after a 30-step toy run.
MUST_NOT_PRINT = {"inference_memory": (" nan",), "train_gpt": ("within 1%",)}


def test_there_are_examples():
    assert EXAMPLES
