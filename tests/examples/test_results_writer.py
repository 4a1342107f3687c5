"""benchmarks.harness.record, the one writer of benchmark results, and benchmarks.record, which brings a
results folder from another machine in: areas replaced one by one, history appended, nothing repeated."""

import json

from benchmarks import harness
from benchmarks.harness import figure, figures_from_rows, record, results_dir
from benchmarks.record import merge

ENV = {
    "device": "Some GPU",
    "date": "2030-01-02",
    "torch": "9.0",
    "triton": "4.0",
    "torchao": None,
    "command": "python -m benchmarks.x",
    "commit": "abc1234",
}


def history(folder):
    return (folder / "history.csv").read_text().splitlines()


def test_a_run_replaces_its_own_area_and_appends_its_figures(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "_APPENDED", {})
    record("a", str(tmp_path), ENV, [figure("case 1", "ours", "ms", 1.5)], "| a table |\n", {"rounds": [1, 2]})
    record("b", str(tmp_path), ENV, [figure("case 2", "bf16", "ms", 2)])
    latest = json.loads((tmp_path / "latest.json").read_text())
    assert list(latest) == ["a", "b"] and latest["a"]["detail"] == {"rounds": [1, 2]}
    assert {k: latest["a"][k] for k in harness.ENV_KEYS} == {**ENV}
    md = (tmp_path / "latest.md").read_text()
    assert "## a" in md and "| a table |" in md and "## b" in md and "| bf16 | 2 |" in md  # b: tables of its figures
    assert history(tmp_path) == [
        "date,commit,device,area,case,variant,metric,value",
        "2030-01-02,abc1234,Some GPU,a,case 1,ours,ms,1.5",
        "2030-01-02,abc1234,Some GPU,b,case 2,bf16,ms,2",
    ]
    # The same run writing its area again (a report rewritten as it goes): its rows replaced, not repeated.
    record("a", str(tmp_path), ENV, [figure("case 1", "ours", "ms", 1.25), figure("case 3", "ours", "ms", 3.0)])
    assert history(tmp_path)[1:] == [
        "2030-01-02,abc1234,Some GPU,b,case 2,bf16,ms,2",
        "2030-01-02,abc1234,Some GPU,a,case 1,ours,ms,1.25",
        "2030-01-02,abc1234,Some GPU,a,case 3,ours,ms,3",
    ]
    # A later run (another process) adds its rows and takes the area over; b stays.
    monkeypatch.setattr(harness, "_APPENDED", {})
    record("a", str(tmp_path), {**ENV, "date": "2030-02-03T04:05:06+00:00"}, [figure("case 1", "ours", "ms", 1.0)])
    latest = json.loads((tmp_path / "latest.json").read_text())
    assert latest["a"]["date"] == "2030-02-03T04:05" and latest["a"]["figures"][0]["value"] == 1.0 and "b" in latest
    assert len(history(tmp_path)) == 5 and history(tmp_path)[-1].startswith("2030-02-03T04:05,abc1234,")


def test_a_cpu_run_stays_out_of_the_default_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "RESULTS", tmp_path / "results")
    record("a", None, {**ENV, "device": "cpu"}, [figure("c", "v", "ms", 1.0)])
    assert not (tmp_path / "results").exists()
    record("a", None, ENV, [figure("c", "v", "ms", 1.0)])  # a GPU run goes there
    assert (tmp_path / "results" / "latest.json").exists()


def test_an_old_style_file_path_stands_for_its_folder(tmp_path):
    assert results_dir(str(tmp_path / "memory.json")) == tmp_path and results_dir(str(tmp_path)) == tmp_path
    assert results_dir(None) == harness.RESULTS


def test_figures_from_rows_take_numbers_only():
    row = {"model": "llama", "tokens": 16, "variant": "float8 eager", "ms": 1.5}
    rows = [{**row, "ms_rounds": [1, 2], "fullgraph": True, "error": None, "skipped": "why"}]
    assert figures_from_rows(rows, keys=["model", "tokens"]) == [
        figure("model llama, tokens 16", "float8 eager", "ms", 1.5)
    ]
    assert figures_from_rows([{"case": "linear", "variant": "bf16", "us": 3}], "host", ["case"]) == [
        figure("host, linear", "bf16", "us", 3)
    ]


def test_record_merges_a_folder_from_another_machine(tmp_path, monkeypatch):
    here, there = tmp_path / "here", tmp_path / "there"
    monkeypatch.setattr(harness, "_APPENDED", {})
    record("a", str(here), ENV, [figure("c", "ours", "ms", 1.0)])
    record("b", str(here), ENV, [figure("c", "ours", "ms", 2.0)])
    monkeypatch.setattr(harness, "_APPENDED", {})
    record("a", str(there), {**ENV, "date": "2030-03-04", "commit": "def5678"}, [figure("c", "ours", "ms", 0.5)])
    (there / "bench.png").write_bytes(b"png")
    assert merge(there, here) == ["a"]
    latest = json.loads((here / "latest.json").read_text())
    assert latest["a"]["figures"][0]["value"] == 0.5 and latest["a"]["commit"] == "def5678"
    assert latest["b"]["figures"][0]["value"] == 2.0
    assert history(here)[-1] == "2030-03-04,def5678,Some GPU,a,c,ours,ms,0.5" and len(history(here)) == 4
    assert (here / "bench.png").read_bytes() == b"png" and "## a" in (here / "latest.md").read_text()
    merge(there, here)  # again: the same rows are not added twice
    assert len(history(here)) == 4
