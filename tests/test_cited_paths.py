"""Comments and docstrings of the library cite only files that exist (issue 24: four cited `float8/ops/...` and
`float8/kernels/...`, paths of the installed package, where the repository's folders are `ops/` and `kernels/`).
A file that moves or is deleted fails here until its citations follow."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
# A repository-relative path: folders, then a file with one of these extensions, not inside a longer word.
CITED = re.compile(r"(?<![\w./])((?:[\w.-]+/)+[\w.-]+\.(?:py|md|sh|json|toml|txt|png))")
OUTSIDE = ("torch/", "triton/", "transformers/", "torchao/")  # files of other projects, cited by their own paths


def test_every_path_cited_in_the_library_exists():
    missing = []
    for folder in ("float8", "ops", "kernels"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                for cited in CITED.findall(line):
                    if not cited.startswith(OUTSIDE) and not (ROOT / cited).exists():
                        missing.append(f"{path.relative_to(ROOT)}:{number} cites {cited}")
    assert not missing, "\n".join(missing)
