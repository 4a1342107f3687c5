"""The "Bad input" table (docs/bad_input.md, linked from the README) stays true: every test it names exists (a
renamed or deleted test fails here)."""

import ast
import fnmatch
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _table_rows():
    section = (ROOT / "docs" / "bad_input.md").read_text()
    return [line for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]


def _tests_in(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name.startswith("test")}


def test_every_row_names_an_existing_test():
    rows = _table_rows()
    assert len(rows) >= 30
    files = {}
    for p in (ROOT / "tests").rglob("test_*.py"):
        files.setdefault(p.name, []).append(p)  # tests/ops/test_ops.py and tests/kernels/test_ops.py
    for row in rows:
        cell = row.rstrip("|").split("|")[-1]
        refs = re.findall(r"`([\w./]+\.py)(?:::([\w*]+))?`", cell)
        if "documented in" in cell:
            continue
        assert refs, f"row names no test: {row}"
        for file, name in refs:
            paths = files.get(pathlib.Path(file).name)
            assert paths, f"{file} (row: {row})"
            if name:
                matches = [m for p in paths for m in fnmatch.filter(_tests_in(p), name)]
                assert matches, f"{file}::{name} does not exist (row: {row})"
