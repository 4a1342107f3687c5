"""The tables of measured figures in README.md and docs/performance.md are what benchmarks.readme_tables
generates from benchmarks/results/latest.json: a new run recorded there, or a table edited by hand, fails here
until `python -m benchmarks.readme_tables` is run. The README stays a front door (at most 350 lines), and no
tracked file is named by a date (runs are told apart in history.csv, not by file names)."""

import pathlib
import re
import subprocess

import pytest

from benchmarks import readme_tables

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("doc", readme_tables.DOCS)
def test_tables_equal_what_latest_json_gives(doc):
    text = (ROOT / doc).read_text()
    names = readme_tables.BLOCK.findall(text)
    assert names, f"{doc} holds no generated table"
    assert readme_tables.regenerate(text, readme_tables.load()) == text, (
        f"{doc}'s tables differ from benchmarks/results/latest.json: run python -m benchmarks.readme_tables"
    )


def test_every_table_is_used_and_every_row_shows_figures():
    latest = readme_tables.load()
    used = [m[1] for doc in readme_tables.DOCS for m in readme_tables.BLOCK.findall((ROOT / doc).read_text())]
    assert sorted(used) == sorted(readme_tables.TABLES)  # each table once, none unknown
    for name in readme_tables.TABLES:
        rows = readme_tables.render(name, latest).splitlines()[4:]
        # A row whose cells are all "—" names no recorded figure: its spec is wrong.
        assert rows and all(row.count("—") < row.count("|") - 2 for row in rows), (name, rows)


def test_a_block_is_rewritten_between_its_markers():
    latest = {
        "kernels": {
            "device": "GPU",
            "date": "2030-01-01",
            "torch": "9",
            "figures": [
                {"case": "quantize tensorwise (current) 16384x8192", "variant": "ours", "metric": "ms", "value": 0.5}
            ],
        }
    }
    text = "before\n<!-- results:kernels -->\nstale\n<!-- /results -->\nafter\n"
    out = readme_tables.regenerate(text, latest)
    assert out.startswith("before\n<!-- results:kernels -->\nQuantization kernels") and out.endswith(
        "<!-- /results -->\nafter\n"
    )
    assert (
        "| current-scaling quantize (amax + cast) | 0.500 | — | — | — |" in out
        and "GPU (torch 9): 2030-01-01 (kernels)" in out
    )
    with pytest.raises(KeyError):
        readme_tables.regenerate("<!-- results:nothing -->\n<!-- /results -->", latest)


def test_latest_md_is_what_latest_json_gives():
    from benchmarks.harness import RESULTS, latest_markdown, load_latest

    assert (RESULTS / "latest.md").read_text() == latest_markdown(load_latest(RESULTS))


def test_readme_stays_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 350, f"README.md has {lines} lines; move detail to docs/"


def test_no_tracked_file_is_named_by_a_date():
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    files = listed.stdout.split("\n")
    dated = [f for f in files if re.search(r"20\d\d-\d\d-\d\d", f)]
    assert not dated, dated
