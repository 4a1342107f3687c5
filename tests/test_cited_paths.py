"""Comments and docstrings cite only files that exist (issue 24: four cited `float8/ops/...` and `float8/kernels/...`,
paths of the installed package, where the repository's folders are `ops/` and `kernels/`). A file that moves or
is deleted fails here until its citations follow.

What is read: every line of the library (float8/, ops/, kernels/); the comments and docstrings of benchmarks/,
tests/ and examples/ (their code holds made-up paths as test data); every line of docs/*.md. A cited path
resolves from the repository root or from the citing file's folder (docs/ cites `../benchmarks/...`).
"""

import ast
import io
import pathlib
import re
import tokenize

ROOT = pathlib.Path(__file__).resolve().parent.parent
# A repository-relative path: folders, then a file with one of these extensions, not inside a longer word.
CITED = re.compile(r"(?<![\w./])((?:[\w.-]+/)+[\w.-]+\.(?:py|md|sh|json|toml|txt|png))")
OUTSIDE = ("torch/", "triton/", "transformers/", "torchao/")  # files of other projects, cited by their own paths
# Not citations: where a run writes (DIR and trace_dir stand for folders the caller names). A file cited in
# benchmarks/results/ is checked like any other.
WRITTEN = ("DIR/", "trace_dir/")


def missing_in(text: str, folder: pathlib.Path, first_line: int = 1) -> list[str]:
    """`line: path` for each path cited in text that exists neither under ROOT nor under folder."""
    missing = []
    for number, line in enumerate(text.splitlines(), first_line):
        for cited in CITED.findall(line):
            if cited.startswith(OUTSIDE + WRITTEN):
                continue
            if not (ROOT / cited).exists() and not (folder / cited).exists():
                missing.append(f"{number}: {cited}")
    return missing


def comments_and_docstrings(source: str):
    """(first line, text) of each comment and each module, class or function docstring."""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                yield first.lineno, first.value.value


def cited_but_missing() -> list[str]:
    missing = []
    for folder in ("float8", "ops", "kernels"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            missing += [f"{path.relative_to(ROOT)}:{m}" for m in missing_in(path.read_text(), path.parent)]
    for folder in ("benchmarks", "tests", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for line, text in comments_and_docstrings(path.read_text()):
                missing += [f"{path.relative_to(ROOT)}:{m}" for m in missing_in(text, path.parent, line)]
    for path in sorted((ROOT / "docs").rglob("*.md")):
        missing += [f"{path.relative_to(ROOT)}:{m}" for m in missing_in(path.read_text(), path.parent)]
    return missing


def test_every_cited_path_exists():
    missing = cited_but_missing()
    assert not missing, "cited but not in the repository:\n" + "\n".join(missing)


def test_the_check_sees_a_wrong_path():
    # The paths issue 24 found: the installed package's names, not the repository's folders.
    text = "see float8/ops/parallel.py and float8/kernels/reference.py; ops/parallel.py and kernels/reference.py exist"
    assert missing_in(text, ROOT) == ["1: float8/ops/parallel.py", "1: float8/kernels/reference.py"]
    source = (
        '"""Module docstring citing kernels/nowhere.py."""\n\nx = "ops/made_up.py"  # a comment citing ops/gone.py\n'
    )
    cited = [m for line, text in comments_and_docstrings(source) for m in missing_in(text, ROOT, line)]
    assert sorted(cited) == ["1: kernels/nowhere.py", "3: ops/gone.py"]  # the string in code is not a citation
