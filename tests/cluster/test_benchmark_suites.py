"""Each benchmark suite runs on a tiny setting and writes well-formed files.

Never a speed: only that each suite runs end to end through `benchmarks.run` on a real
local cluster (or the simulator) and that its CSV, Markdown and PNG outputs are complete.
"""

import contextlib
import csv
import io
import json
import math
import os
import types

import pytest

from benchmarks import run as runner

from helpers import ROOT

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _suite(name):
    """The module of suite `name`."""
    return runner.suite_module(name)


def _run(name, *args):
    """Runs `python -m benchmarks.run NAME ARGS` in this process (without starting
    TensorFlow again), its stdout and stderr captured; checks the run's `run.json`."""
    out, err = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = runner.main([name, *args])
        folder = runner.out_folder(_suite(name), list(args))
        if folder and os.path.isdir(folder):
            with open(os.path.join(folder, "run.json")) as f:
                record = json.load(f)
            assert record["command"].startswith(f"python -m benchmarks.run {name}"), record
            assert record["commit"] and record["status"] == 0, record
    finally:
        os.chdir(cwd)
    proc = types.SimpleNamespace(returncode=code or 0, stdout=out.getvalue(), stderr=err.getvalue())
    assert proc.returncode == 0, _errors(proc.stderr)
    return proc


def _errors(stderr):
    """The tool's stderr without TF's shutdown noise (lines about functions
    it could not remove from tasks already stopped), head and tail."""
    noise = (
        "Failed to remove function remotely",
        "GRPC error information",
        "Error received from peer",
        "remote target has been disconnected",
    )
    lines = [line for line in stderr.splitlines() if not any(n in line for n in noise)]
    text = "\n".join(lines)
    return text if len(text) < 6000 else text[:3000] + "\n[...]\n" + text[-3000:]


def _csv(path, columns):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows, path
    assert set(columns) <= set(rows[0]), (path, rows[0].keys())
    return rows


def _png(path):
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC, path
    assert os.path.getsize(path) > 5000, path


def _positive(rows, key):
    for r in rows:
        v = float(r[key])
        assert math.isfinite(v) and v > 0, (key, r)


def test_simulator_suite(tmp_path):
    _run(
        "simulator",
        "--out",
        str(tmp_path),
        "--workers",
        "16,32",
        "--etas",
        "0.1",
        "--pushes",
        "60",
        "--eval-every",
        "20",
    )
    stab = _csv(tmp_path / "stability.csv", ["method", "workers", "eta", "final_loss", "stable"])
    assert {(r["method"], r["workers"]) for r in stab} == {
        (m, w) for m in ("downpour", "dynsgd", "gem") for w in ("16", "32")
    }
    curves = _csv(tmp_path / "curves.csv", ["method", "push", "samples", "loss", "accuracy"])
    assert len(curves) == 6 * 4  # 6 runs x (initial + 3 evaluations)
    pi = _csv(tmp_path / "pi.csv", ["push", "dense_1/kernel:mean", "dense_2/bias:median"])
    assert all(0 <= float(r["dense_1/kernel:mean"]) <= 5 for r in pi)
    stale = _csv(tmp_path / "staleness.csv", ["distribution", "staleness", "count"])
    assert {r["distribution"] for r in stale} >= {"constant", "exponential", "geometric"}
    for name in ("stability.png", "curves_eta0.1.png", "pi.png", "staleness.png"):
        _png(tmp_path / name)


def test_scaleout_suite_and_sleep_op(tmp_path):
    import time

    from benchmarks import scaleout

    ds = scaleout.emulated_dataset((8, 8, 1), 2, step_ms=30)
    t = time.perf_counter()
    for _ in ds.take(4):
        pass
    assert time.perf_counter() - t >= 4 * 0.03  # the device time is really spent
    _run(
        "scaleout",
        "--out",
        str(tmp_path),
        "--workers",
        "1,2",
        "--n-sync",
        "2",
        "--device-ms",
        "2",
        "--seconds",
        "0.2",
        "--max-pushes",
        "8",
        "--ceiling",
    )
    rows = _csv(
        tmp_path / "scaleout.csv",
        [
            "workers",
            "n_sync",
            "samples_per_s",
            "speedup",
            "chief_cpu_ms_per_push",
            "host_cpu_ms_per_push",
            "windows_per_closure",
        ],
    )
    assert all(float(r["windows_per_closure"]) >= 1 for r in rows)
    assert {(r["kind"], r["workers"]) for r in rows} == {
        (k, w) for k in ("emulated", "ceiling") for w in ("1", "2")
    }
    _positive(rows, "samples_per_s")
    _positive(rows, "mb_per_push")
    assert "| emulated | 2 | 2 |" in (tmp_path / "scaleout.md").read_text()
    _png(tmp_path / "scaleout.png")


def test_throughput_suite(tmp_path):
    """Every mode once; tf_asgd from two trees (this checkout twice), side by side."""
    _run(
        "throughput",
        "--out",
        str(tmp_path),
        "--workers",
        "1",
        "--n-sync",
        "2",
        "--modes",
        "keras,pss,asgd",
        "--rounds",
        "1",
        "--seconds",
        "0.2",
        "--processes",
        "shared",
        "--pss-spe",
        "1",
        "--trees",
        f"here={ROOT},again={ROOT}",
    )
    rows = _csv(
        tmp_path / "summary.csv",
        [
            "mode",
            "workers",
            "n_sync",
            "samples_per_s",
            "ratio_to_keras",
            "ratio_to_pss",
            "bytes_pulled_per_sample",
            "processes",
            "ratio_to_best_pss",
        ],
    )
    assert [(r["mode"], r["n_sync"], r["tree"]) for r in rows] == [
        ("keras", "0", ""),
        ("pss", "1", ""),
        ("asgd", "2", "again"),
        ("asgd", "2", "here"),
    ]
    assert [r["processes"] for r in rows] == ["one", "shared", "shared", "shared"]
    _positive(rows, "samples_per_s")
    asgd = rows[2]
    # One pull and one push of the whole model per window of 2 steps of 64 samples.
    assert float(asgd["bytes_pulled_per_sample"]) == pytest.approx(
        float(rows[1]["bytes_pulled_per_sample"]) / 2, rel=1e-5
    )
    assert float(rows[0]["ratio_to_keras"]) == 1.0 and float(rows[1]["ratio_to_pss"]) == 1.0
    assert len(_csv(tmp_path / "raw.csv", ["mode", "round", "seconds", "tree"])) == 4
    summary = (tmp_path / "summary.md").read_text()
    assert "| asgd | here | 1 | 2 |" in summary
    ratio = float(summary.split("- again, shared, 1 worker(s), n_sync 2: ")[1].split()[0])
    by_tree = {r["tree"]: float(r["samples_per_s"]) for r in rows if r["mode"] == "asgd"}
    assert ratio == pytest.approx(by_tree["again"] / by_tree["here"], abs=1e-3)


def test_throughput_suite_fails_when_every_run_failed(tmp_path):
    """A bench whose every child fails (here each is stopped by --child-timeout before it
    can measure) exits 1 and says so, instead of writing an empty table."""
    module = _suite("throughput")
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = module.main(
            ["--out", str(tmp_path), "--modes", "keras", "--rounds", "1", "--child-timeout", "0.01"]
        )
    assert code == 1
    assert "FAILED keras x0 one in round 0" in err.getvalue()
    assert "every run failed" in err.getvalue()


def test_experiments_suite(tmp_path):
    _run(
        "experiments",
        "--out",
        str(tmp_path),
        "--sweeps",
        "nsync,start",
        "--n-sync",
        "1,4",
        "--nsync-workers",
        "2",
        "--start-workers",
        "2",
        "--start-nsync",
        "4",
        "--warm-steps",
        "8",
        "--steps",
        "40",
        "--device-ms",
        "0",
        "--smooth",
        "8",
    )
    windows = _csv(tmp_path / "windows.csv", ["run", "time", "samples", "error", "loss"])
    runs = {r["run"] for r in windows}
    assert runs == {"nsync:n_sync=1", "nsync:n_sync=4", "start:cold start", "start:warm start"}
    for run in runs:
        rows = [r for r in windows if r["run"] == run]
        samples = [float(r["samples"]) for r in rows]
        assert samples == sorted(samples) and samples[-1] == 40 * 32  # every minibatch recorded
        assert all(0 <= float(r["error"]) <= 1 for r in rows)
    summary = _csv(tmp_path / "summary.csv", ["run", "wall_s", "test_accuracy", "mean_staleness"])
    assert len(summary) == 4
    for name in ("nsync_curves.png", "nsync_staleness.png", "start_curves.png"):
        _png(tmp_path / name)


def test_epoch_barrier_suite(tmp_path):
    """The three fits side by side: with the barrier, without it for as many epochs and
    for twice as many; the rows and the ratios' table."""
    _run(
        "epoch_barrier",
        "--out",
        str(tmp_path),
        "--workers",
        "2",
        "--n-sync",
        "5",
        "--device-ms",
        "2",
        "--steps",
        "10",
        "--epochs",
        "2",
        "--rounds",
        "1",
        "--data",
        "mnist1d",
    )
    rows = _csv(
        tmp_path / "epoch_barrier.csv",
        ["epoch_barrier", "epochs", "seconds", "samples_per_s", "busy_share", "test_accuracy"],
    )
    assert [(r["epoch_barrier"], r["epochs"]) for r in rows] == [
        ("True", "2"),
        ("False", "2"),
        ("False", "4"),
    ]
    _positive(rows, "samples_per_s")
    assert [int(r["windows"]) for r in rows] == [4, 4, 8]  # 2 windows an epoch, all recorded
    md = (tmp_path / "epoch_barrier.md").read_text()
    assert "samples/s without the barrier over with it" in md


def test_evaluation_suite(tmp_path):
    _run(
        "evaluation",
        "--out",
        str(tmp_path),
        "--workers",
        "2",
        "--device-ms",
        "2",
        "--examples",
        "100",
        "--rounds",
        "1",
    )
    rows = _csv(tmp_path / "evaluation.csv", ["workers", "mode", "seconds", "max_metric_diff"])
    assert sorted(r["mode"] for r in rows) == ["chief", "workers"]
    _positive(rows, "seconds")
    assert all(float(r["max_metric_diff"]) <= 1e-6 for r in rows)
    md = (tmp_path / "evaluation.md").read_text()
    assert "speed-up" in md and "max metric diff" in md and "ms/batch" in md


def test_time_to_accuracy_suite(tmp_path):
    proc = _run("time_to_accuracy", "--quick", "--out", str(tmp_path))
    lines = [line for line in proc.stdout.splitlines() if "seed 0:" in line]
    assert len(lines) == 2 and "plain seed 0" in lines[0] and "2w n_sync 10" in lines[1], lines
    runs = _csv(
        tmp_path / "runs.csv",
        [
            "setup",
            "method",
            "workers",
            "n_sync",
            "seed",
            "device_ms",
            "train_s",
            "startup_s",
            "cpu_util",
            "cpu_bound",
            "device_fraction",
            "final_accuracy",
            "target",
            "time_to_target_s",
            "speedup",
            "samples_to_target",
            "samples_ratio",
            "worst_drop_points",
            "stable",
            "final_ok",
            "must_hold",
        ],
    )
    assert [(r["method"], r["workers"]) for r in runs] == [("plain", "1"), ("tf_asgd", "2")]
    plain, asgd = runs
    assert int(asgd["samples"]) == 2 * int(plain["samples"])  # tf_asgd's budget: 2x samples
    curves = _csv(tmp_path / "curves.csv", ["method", "step", "samples", "time_s", "accuracy"])

    def curve(method):
        pts = [r for r in curves if r["method"] == method]
        return [(float(r["time_s"]), int(r["samples"]), float(r["accuracy"])) for r in pts]

    cp, ca = curve("plain"), curve("tf_asgd")
    assert cp[0][1] == ca[0][1] == 0 and ca[-1][1] == int(asgd["samples"])
    assert all(b[0] >= a[0] and b[1] > a[1] for a, b in zip(ca, ca[1:]))  # time and samples grow
    # The speed-up arithmetic, redone from the curves.
    target = cp[-1][2] - 0.01
    assert math.isclose(float(asgd["target"]), target, rel_tol=1e-5)

    def first(points, index):
        return next((p[index] for p in points if p[2] >= target), math.inf)

    t_plain, t_asgd = first(cp, 0), first(ca, 0)
    assert math.isclose(float(asgd["plain_time_to_target_s"]), t_plain, rel_tol=1e-4)
    if math.isfinite(t_asgd):
        assert math.isclose(float(asgd["speedup"]), t_plain / t_asgd, rel_tol=1e-4)
        assert math.isclose(float(asgd["samples_ratio"]), first(ca, 1) / first(cp, 1), rel_tol=1e-4)
    else:
        assert float(asgd["speedup"]) == 0 and "never reached" in lines[1]
    best, drop = 0.0, 0.0
    for _, samples, acc in ca:
        best = max(best, acc)
        if samples >= ca[-1][1] / 4:
            drop = max(drop, best - acc)
    assert math.isclose(float(asgd["worst_drop_points"]), 100 * drop, abs_tol=1e-3)
    final_ok = ca[-1][2] >= cp[-1][2] - 0.02
    assert int(asgd["must_hold"]) == int(drop <= 0.05 and final_ok)
    assert 0 < float(asgd["cpu_util"]) and int(asgd["cpu_bound"]) == (float(asgd["cpu_util"]) > 0.7)
    md = (tmp_path / "speedups.md").read_text()
    assert "| mnist1d_adam | 10 | 2 | 2x | 1 |" in md and "speed-up" in md
    for name in ("accuracy_vs_time.png", "accuracy_vs_samples.png"):
        _png(tmp_path / name)


def test_compression_suite(tmp_path):
    """One worker count, no bandwidth limit, two push codecs, and int8 also with bf16 pulls:
    a row per cell with the bytes each way (bf16 pulls half of float32's), the table and
    the plot."""
    _run(
        "compression",
        *("--out", str(tmp_path), "--models", "gem_convnet", "--bandwidths", "none"),
        *("--codecs", "none,int8", "--pulls", "none,bf16", "--pull-codecs", "int8"),
        *("--n-sync", "2", "--workers", "2", "--windows", "1"),
    )
    runs = _csv(tmp_path / "runs.csv", ["model", "codec", "pulls", "samples_per_s"])
    assert [(r["codec"], r["pulls"]) for r in runs] == [
        ("none", "none"),
        ("int8", "none"),
        ("int8", "bf16"),
    ]
    pulled = {(r["codec"], r["pulls"]): float(r["pulled_bytes_per_sample"]) for r in runs}
    pushed = {(r["codec"], r["pulls"]): float(r["pushed_bytes_per_sample"]) for r in runs}
    assert pulled["int8", "bf16"] == pytest.approx(pulled["none", "none"] / 2, rel=1e-3)
    assert pushed["int8", "bf16"] < pushed["none", "none"] / 3.5
    summary = (tmp_path / "summary.md").read_text()
    assert "| pulls |" in summary and "bf16" in summary
    _png(tmp_path / "speedup.png")


def test_time_to_accuracy_suite_with_compression_and_an_outer_rate(tmp_path):
    """`--compressions int8+bf16 --outer-rates 0.5*limit`: int8 pushes and bf16 pulls under
    a constant outer rate, a cell of their own and the bytes each way per window."""
    _run(
        "time_to_accuracy",
        *("--quick", "--out", str(tmp_path), "--compressions", "int8+bf16"),
        *("--outer-rates", "0.5*limit"),
    )
    plain, asgd = _csv(
        tmp_path / "runs.csv", ["method", "compression", "outer", "pulled_bytes_per_window"]
    )
    assert (plain["compression"], asgd["compression"]) == ("none", "int8+bf16")
    assert asgd["outer"] == "0.5*limit"
    pulled, pushed = int(asgd["pulled_bytes_per_window"]), int(asgd["pushed_bytes_per_window"])
    assert 3.5 * pushed < 2 * pulled  # int8 pushes against float32; the pull is bf16
    assert "| int8+bf16, outer 0.5*limit |" in (tmp_path / "speedups.md").read_text()


def test_time_to_accuracy_suite_refuses_a_bad_outer_rate(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _suite("time_to_accuracy").main(["--outer-rates", "0.5*n"])
    assert exit_info.value.code == 2
    assert "is not 'default', 'sync', 'rise' or a number > 0" in capsys.readouterr().err


def test_ceiling_suite(tmp_path):
    proc = _run("ceiling", "--quick", "--steps", "100", "--out", str(tmp_path))
    runs = _csv(
        tmp_path / "runs.csv",
        ["method", "workers", "n_sync", "lr_scaling", "final_accuracy", "steps_to_target"],
    )
    assert [(r["method"], r["workers"], r["n_sync"], r["lr_scaling"]) for r in runs] == [
        ("plain", "1", "0", "x1"),
        ("large_batch", "2", "0", "x1"),
        ("large_batch", "2", "0", "linear"),
        ("local_sgd", "2", "10", "x1"),
        ("lr_only", "2", "0", "linear"),
    ]
    curves = _csv(tmp_path / "curves.csv", ["method", "lr_scaling", "step", "accuracy"])
    plain = [(int(r["step"]), float(r["accuracy"])) for r in curves if r["method"] == "plain"]
    assert [s for s, _ in plain] == [20, 40, 60, 80, 100]
    target = plain[-1][1] - 0.01
    base = next(s for s, a in plain if a >= target)
    for run in runs:
        points = [
            (int(r["step"]), float(r["accuracy"]))
            for r in curves
            if (r["method"], r["lr_scaling"]) == (run["method"], run["lr_scaling"])
        ]
        assert math.isclose(float(run["target"]), target, rel_tol=1e-5)
        reached = next((s for s, a in points if a >= target), math.inf)
        assert float(run["steps_to_target"]) == reached
        assert float(run["speedup"]) == pytest.approx(base / reached if reached < math.inf else 0)
    # The scaled optimizers: the setup's own, and its rate times N.
    tool = _suite("ceiling")
    assert tool.scaled_optimizer("adam_1e-2", 2.0).get_config()["learning_rate"] == pytest.approx(
        0.02
    )
    assert "| mnist1d_adam | local SGD, n_sync 10 |" in (tmp_path / "summary.md").read_text()
    assert "speed-up" in proc.stdout
    _png(tmp_path / "accuracy_vs_steps.png")


def test_ceiling_large_batch_at_plain_samples(tmp_path):
    # Plain's 100 steps of batch B against the batch 2 x B for plain's samples: 50 steps,
    # rounded to the held-out grid of 20 (as --outer-steps sizes the copies' runs).
    _run("ceiling", "--quick", "--steps", "100", "--methods", "large_batch", "--scalings",
         "linear", "--large-batch-samples", "1", "--out", str(tmp_path))  # fmt: skip
    curves = _csv(tmp_path / "curves.csv", ["method", "step", "accuracy"])
    steps = {
        m: [int(r["step"]) for r in curves if r["method"] == m] for m in ("plain", "large_batch")
    }
    assert steps == {"plain": [20, 40, 60, 80, 100], "large_batch": [20, 40]}


def test_ceiling_outer_rounds_and_the_best_rate_ceiling(tmp_path):
    """`sync_outer` through `OuterSGD(1/N)` is local SGD's averaging; `--rates` gives each
    batch size its best rate, batch B's best at 1x."""
    import numpy as np

    tool = _suite("ceiling")
    setup, data = "digits_adam", tool.setups.load_data("digits")
    from tf_asgd.rules import outer_optimizers

    average = outer_optimizers.OuterSGD(0.5)
    rounds, noise = tool.outer_rounds(setup, data, 2, 5, 0, 40, 10, average, asynchronous=False)
    local = tool.local_sgd(setup, data, 2, 5, 0, 40, 10)
    assert [s for s, _ in rounds] == [s for s, _ in local] == [10, 20, 30, 40]
    np.testing.assert_allclose([a for _, a in rounds], [a for _, a in local], atol=0.01)
    assert all(v >= 0 for v in noise)  # the rounds' noise scale, first and last quarter
    stale, none = tool.outer_rounds(setup, data, 2, 5, 0, 40, 10, average, asynchronous=True)
    assert [s for s, _ in stale] == [10, 20, 30, 40] and stale != rounds
    assert all(np.isnan(none))  # asynchronous pushes: not measured
    synchronous = outer_optimizers.default_synchronous_outer_optimizer(4)
    assert tool.outer_rule("default", 4, True) == synchronous
    assert tool.outer_rule("diloco", 4, False) == outer_optimizers.DelayedNesterov(0.7, 0.9)

    _run("ceiling", "--setups", setup, "--rates", "1e-3,4e-3", "--workers", "2",
         "--steps", "60", "--evals", "6", "--out", str(tmp_path))  # fmt: skip
    rows = _csv(tmp_path / "ceiling.csv", ["workers", "rate", "steps_to_target", "speedup"])
    assert [(r["workers"], float(r["rate"])) for r in rows] == [
        ("1", 1e-3), ("1", 4e-3), ("2", 1e-3), ("2", 4e-3)
    ]  # fmt: skip
    assert max(float(r["speedup"]) for r in rows if r["workers"] == "1") == 1.0
    assert "| digits_adam | 2 x B |" in (tmp_path / "ceiling.md").read_text()


def test_faults_suite(tmp_path):
    """Snapshot cost side by side, and one PS killed halfway through a fit against the same
    fit without a fault: every window applied once, the recovery counted."""
    _run("faults", "--mode", "cost,faults", "--models", "gem_convnet", "--rounds", "1",
         "--seconds", "1", "--setups", "digits_convnet", "--workers", "2", "--seeds", "0",
         "--out", str(tmp_path))  # fmt: skip
    cost = _csv(tmp_path / "cost.csv", ["model", "snapshot_every", "samples_per_s", "read_s"])
    assert [r["snapshot_every"] for r in cost] == ["off", "60", "2"]
    _positive(cost, "samples_per_s")
    assert all(int(r["snapshots"]) >= 1 for r in cost[1:])
    free, faulted = _csv(tmp_path / "faults.csv", ["fault", "test_accuracy", "rolled_back"])
    assert (free["fault"], faulted["fault"]) == ("False", "True")
    assert faulted["recoveries"] == "1" and faulted["applied_twice"] == "0"
    assert faulted["version_is_applied"] == "True"
    assert "| digits_convnet | 2 | 0 |" in (tmp_path / "tables.md").read_text()
