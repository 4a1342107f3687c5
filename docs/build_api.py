"""Build the API reference, HTML from the docstrings, with pdoc: `python docs/build_api.py [--out DIR]`.

Documents the public modules: `float8` (Float8Tensor, recipes, quantizers, checkpoints), `float8.ops` (ops,
Sequential, convert, calibrate; with `float8.ops.functional`), `float8.fsdp` (FSDP2's FP8 all-gather) and
`float8.kernels` (the kernels and their references); in each, the names its `__all__` exports. Writes
DIR/index.html and one page per module (default build/api, which git ignores). Needs the docs extra:
`pip install -e ".[docs]"`. tests/test_api_reference.py builds it.
"""

from __future__ import annotations

import argparse
import pathlib
import warnings

MODULES = ["float8", "float8.ops", "float8.fsdp", "float8.kernels"]  # float8.ops brings float8.ops.functional


def build(out: pathlib.Path) -> list:
    """Write the reference into `out`; returns the pages written. Raises on any pdoc warning but one: pdoc
    cannot tell which file defines an attribute a float8 class inherits from torch's C extension
    (Float8Tensor's), and assumes the class's own file, which is right for the page."""
    import pdoc
    import pdoc.render

    pdoc.render.configure(docformat="markdown", show_source=False)
    with warnings.catch_warnings():
        # pdoc's own warnings (a docstring or a module it cannot read) fail the build; others (a library
        # warning on import) do not.
        warnings.filterwarnings("error", module=r"pdoc(\.|$)")
        warnings.filterwarnings("ignore", message=r"Cannot determine where float8\..* is taken from")
        pdoc.pdoc(*MODULES, output_directory=out)
    return sorted(p.relative_to(out) for p in out.rglob("*.html"))


def main() -> None:
    """The command line: build into --out and list the pages."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="build/api", help="output folder (default build/api)")
    out = pathlib.Path(parser.parse_args().out)
    pages = build(out)
    print(f"{len(pages)} pages in {out}: " + ", ".join(map(str, pages)))


if __name__ == "__main__":
    main()
