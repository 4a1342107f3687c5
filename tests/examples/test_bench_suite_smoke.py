"""`python -m benchmarks --cpu-smoke` runs the whole suite's orchestration on the CPU (tiny shapes, a wall
clock, no compile) and writes what the GPU run will write (latest.json/.md, history.csv, bench.png in --out):
the GPU run will not trip over plumbing, and the records keep their schema."""

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[2]
REQUIRED = [
    "case",
    "shape",
    "ours_ms",
    "ours_compiled_ms",
    "bf16_ms",
    "bf16_compiled_ms",
    "torchao_ms",
    "torchao_rowwise_ms",
    "peak_mem_ours",
    "peak_mem_bf16",
    "floor_ms",
    "fraction_of_floor",
    "device",
    "torch",
    "triton",
    "date",
    "error",
    "errors",
    "skipped",
]
CASES = {"kernels", "gemm", "linear", "mlp", "transformer_layer", "host", "step_linear", "step_mlp"}
TIMED_IN_ROUNDS = {"linear", "mlp", "transformer_layer", "step_linear", "step_mlp"}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--cpu-smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return out, run.stdout, suite_records(out)


def suite_records(out):
    """The suite's records, in case order, from the bench_<case> areas of the folder's latest.json."""
    latest = json.loads((out / "latest.json").read_text())
    records = [r for area, s in latest.items() if area.startswith("bench_") for r in s["detail"]["records"]]
    return sorted(records, key=lambda r: r["letter"])


def test_every_case_runs_without_error(smoke):
    _, _, records = smoke
    assert {r["case"] for r in records} == CASES
    for r in records:
        assert r["error"] is None and r["errors"] == {}, (r["label"], r["error"], r["errors"])
        assert r["ours_ms"] > 0 and r["bf16_ms"] > 0, r["label"]
        assert r["device"] == "cpu" and r["date"]


def test_records_keep_the_schema(smoke):
    _, _, records = smoke
    for r in records:
        missing = [k for k in REQUIRED if k not in r]
        assert not missing, (r["case"], missing)
        assert isinstance(r["shape"], list) and r["shape"]
        if r["case"] != "host":
            assert r["floor_ms"] > 0 and r["fraction_of_floor"] > 0, r["label"]
    gemm = [r for r in records if r["case"] == "gemm"]
    assert all(r["scaled_mm_ms"] > 0 and r["ours_matches_scaled_mm"] for r in gemm)
    assert [r["shape"] for r in records if r["case"] == "transformer_layer"] == [[2, 8, 64, 4, 2, 16, 64]]
    from benchmarks.suite import ROUNDS

    for r in records:
        if r["case"] in TIMED_IN_ROUNDS:  # interleaved rounds, the median kept
            rounds = r["rounds_ms"]
            assert {"ours", "bf16", "bf16_compiled"} <= set(rounds) and all(len(t) == ROUNDS for t in rounds.values())
            assert all(r[f"{k}_ms"] == sorted(t)[ROUNDS // 2] for k, t in rounds.items())
            per_round = sorted(b / o for b, o in zip(rounds["bf16"], rounds["ours"]))
            assert r["speedup_vs_bf16"] == per_round[ROUNDS // 2]  # the median of same-round ratios
            # ours compiled, against the compiled baselines
            per_round = sorted(b / o for b, o in zip(rounds["bf16_compiled"], rounds["ours_compiled"]))
            assert r["compiled_speedup_vs_bf16_compiled"] == per_round[ROUNDS // 2]
    steps = [r for r in records if r["case"].startswith("step_")]
    assert [r["shape"] for r in steps] == [[32, 64, 48], [32, 64, 96]]
    assert all("AdamW" in " ".join(r["notes"]) for r in steps)


def test_torchao_fields_follow_its_availability(smoke):
    out, _, records = smoke
    md = (out / "latest.md").read_text()
    peers = [r for r in records if r["case"] in TIMED_IN_ROUNDS]
    if records[0]["torchao"] is None:
        assert all(r["torchao_ms"] is None and r["torchao_rowwise_ms"] is None for r in peers)
        assert "torchao not importable" in md
    else:
        assert all(r["torchao_ms"] > 0 and r["torchao_rowwise_ms"] > 0 for r in peers)


def test_outputs_written_and_table_printed(smoke):
    out, stdout, records = smoke
    md = (out / "latest.md").read_text()
    header = "| case | shape | ours ms | ours compiled ms | bf16 ms | bf16 compiled ms | torchao tw ms | torchao rw ms "
    assert header in md and header in stdout
    assert md.count("\n| ") >= len(records) + 2
    latest = json.loads((out / "latest.json").read_text())
    assert "kernels" in latest  # case a reuses benchmarks.kernels, which records its own area
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    assert (out / "bench.png").exists() == has_mpl


def test_each_case_is_an_area_and_every_figure_a_history_row(smoke):
    out, _, records = smoke
    latest = json.loads((out / "latest.json").read_text())
    from benchmarks.suite import CASES

    areas = {f"bench_{name}" for name, _ in CASES.values()}
    assert areas | {"kernels"} == set(latest)
    for s in latest.values():
        assert s["device"] == "cpu" and s["date"] and s["torch"] and s["commit"] and s["figures"]
        assert "torchao" in s and "triton" in s
    assert latest["bench_linear"]["command"] == f"python -m benchmarks --cpu-smoke --out {out}"
    assert latest["kernels"]["command"].startswith("python -m benchmarks.kernels --out")
    history = (out / "history.csv").read_text().splitlines()
    assert history[0] == "date,commit,device,area,case,variant,metric,value"
    assert len(history) - 1 == sum(len(s["figures"]) for s in latest.values())  # each written once
    linear = {(f["case"], f["variant"], f["metric"]): f["value"] for f in latest["bench_linear"]["figures"]}
    r = next(r for r in records if r["case"] == "linear")
    assert linear["c Linear fwd+bwd 32x64x48", "ours", "ms"] == r["ours_ms"]
    assert linear["c Linear fwd+bwd 32x64x48", "ours", "speedup_vs_bf16"] == r["speedup_vs_bf16"]


def test_a_failing_case_is_recorded_and_the_rest_runs(tmp_path, monkeypatch):
    from benchmarks import suite

    def boom(env):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setitem(suite.CASES, "c", ("linear", boom))
    records = suite.main(["--cpu-smoke", "--cases", "b,c,f", "--out", str(tmp_path)])
    by_case = {r["case"]: r for r in records}
    assert by_case["linear"]["error"] == "RuntimeError: CUDA out of memory (simulated)"
    assert by_case["gemm"]["ours_ms"] > 0 and by_case["host"]["ours_ms"] > 0
    assert "ERROR RuntimeError: CUDA out of memory" in (tmp_path / "latest.md").read_text()


def test_unknown_case_letter_is_refused():
    from benchmarks import suite

    with pytest.raises(SystemExit):
        suite.parse_args(["--cases", "a,z"])


def test_memory_bench_runs_tiny(tmp_path):
    """`python -m benchmarks.memory --tiny`: the LCE, inference, training-memory and activation cases end to end."""
    run = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "benchmarks.memory", "--tiny", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    latest = json.loads((tmp_path / "latest.json").read_text())
    result = {area.removeprefix("memory_"): s["detail"] for area, s in latest.items()}  # each case its own area
    lce = {r["variant"]: r for r in result["lce"]["rows"]}
    assert all("error" not in r for r in lce.values()), lce
    assert lce["float8 bf16"]["dx_sqnr_db"] >= 60 and lce["float8 FP8 GEMMs"]["dw_sqnr_db"] >= 25
    assert [r["variant"] for r in result["inference"]["rows"]] == ["bf16", "float8 FP8-only weights"]
    train = {r["variant"]: r for r in result["train"]["rows"]}
    assert list(train) == [
        "bf16 eager",
        "float8 eager",
        "float8 eager, lean activations",
        "float8 eager + requantize_weights",
        "torchao tensorwise + compile",
    ]
    assert "error" not in train["float8 eager, lean activations"]
    assert "CUDA" in train["torchao tensorwise + compile"]["error"]  # torchao is measured on the GPU only
    assert "error" not in train["float8 eager + requantize_weights"]
    for case in ("seed #1119 layer", "MLP block"):
        variants = [r["variant"] for r in result["activations"][case]["rows"]]
        assert variants == [
            "bf16 eager",
            "float8 eager",
            "float8 eager, lean activations",
            "float8 ops.convert",
            "float8 ops.convert, lean activations",
        ]
    assert "requantize" not in result["inference"]["host_profile"] and "forward" in result["inference"]["host_profile"]


def test_peak_replay_finds_the_moment_of_the_highest_allocation():
    """benchmarks.peak replays the allocator's history (CUDA only); its replay is checked on a made-up trace."""
    from benchmarks.peak import live_at_peak

    frame = lambda f: [{"filename": f"/x/float8/{f}", "line": 1, "name": "fn"}]  # noqa: E731
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": frame("ops/a.py")},
        {"action": "alloc", "addr": 2, "size": 50, "frames": frame("ops/b.py")},
        {"action": "free_completed", "addr": 1},
        {"action": "alloc", "addr": 3, "size": 60, "frames": frame("ops/b.py")},  # 110 + before: below 150
        {"action": "alloc", "addr": 4, "size": 30, "frames": frame("ops/c.py")},  # 140: still below
    ]
    peak, sites = live_at_peak(trace, before=1000)
    assert peak == 1150
    assert {k.split(":")[0]: v for k, v in sites.items()} == {"ops/a.py": [1, 100], "ops/b.py": [1, 50]}
