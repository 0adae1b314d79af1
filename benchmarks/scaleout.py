"""Scale-out with emulated GPU workers: speed-up over 1 worker, and where time goes.

Each worker's minibatch costs `--device-ms` of device time that uses no CPU
(`tf_asgd.data.sleep_transformation`); the rest is real Keras 3 `fit` under
`AsyncParameterServerStrategy`, all tasks in one child process. Per worker count and
`n_sync`: samples/s, the speed-up over 1 worker at the same `n_sync`, the fraction of the
device limit, and the coordinator's and the task host's CPU time per push. `--ceiling` also
measures the maximal push rate with no device time. Method: docs/benchmarks.md. Writes
`scaleout.csv`, `scaleout.md`, `scaleout.png` to `--out`.

    python -m benchmarks.run scaleout --workers 1,2 --n-sync 10 --device-ms 5 --seconds 1
"""

import os
import time

from benchmarks import harness

OUT = "results/scaleout"  # the default --out


def emulated_dataset(input_shape, batch_size, step_ms, num_classes=10, seed=0):
    """A dataset of synthetic minibatches, each delayed by `step_ms` of device time."""
    import numpy as np
    import tensorflow as tf

    from tf_asgd.data import sleep_transformation

    rng = np.random.default_rng(seed)
    x = rng.random((4 * batch_size,) + tuple(input_shape), dtype=np.float32)
    y = rng.integers(0, num_classes, 4 * batch_size).astype("int64")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)
    if step_ms > 0:
        ds = ds.apply(sleep_transformation(step_ms * 1000))
    return ds


def _fit_seconds(model, ds, steps):
    t0 = time.perf_counter()
    model.fit(ds, steps_per_epoch=steps, epochs=1, verbose=0)
    return time.perf_counter() - t0


def _plan_steps(model, ds, workers, n, step_ms, args):
    """Warms up (one window per worker: traces the window once), then measures the pace
    with a short fit (which also sizes the closures); returns the steps for a measurement
    of about `--seconds`, within `--min-windows` and `--max-pushes`."""
    _fit_seconds(model, ds, n * workers)
    window_s = max(n * step_ms / 1000.0, 1e-3)
    probe = max(2 * workers, min(workers * int(round(0.5 / window_s)), 200)) * n
    window_s = max(window_s, _fit_seconds(model, ds, probe) / (probe / n) * workers)
    most = -(-args.max_pushes // workers)  # windows per worker within --max-pushes
    return max(args.min_windows, min(int(round(args.seconds / window_s)), most)) * workers * n


def _measure_one(strategy, model, ds, host_pid, workers, n, step_ms, args):
    """One row: a `fit` of `n_sync` `n` timed, with the pushes, bytes and CPU it cost."""
    strategy.n_sync = n
    steps = _plan_steps(model, ds, workers, n, step_ms, args)
    trainer = strategy.model_states.get(model).trainer
    closures = len(trainer.closure_sizes)
    before = strategy.model_stats(model)
    c0, h0 = time.process_time(), harness.cpu_seconds(host_pid)
    dt = _fit_seconds(model, ds, steps)
    chief_cpu, host_cpu = time.process_time() - c0, harness.cpu_seconds(host_pid) - h0
    after = strategy.model_stats(model)
    pushes = after.windows - before.windows
    moved = after.bytes_pulled + after.bytes_pushed - before.bytes_pulled - before.bytes_pushed
    sizes = trainer.closure_sizes[closures:]
    return dict(
        workers=workers,
        n_sync=n,
        step_ms=step_ms,
        ps=args.ps,
        params=model.count_params(),
        steps=steps,
        seconds=dt,
        samples_per_s=steps * args.batch_size / dt,
        pushes=pushes,
        pushes_per_s=pushes / dt,
        ideal_samples_per_s=workers * args.batch_size * 1000.0 / step_ms if step_ms else "",
        chief_cpu_ms_per_push=1000 * chief_cpu / pushes,
        host_cpu_ms_per_push=1000 * host_cpu / pushes,
        mb_per_push=moved / pushes / 1e6,
        mean_staleness=after.mean_staleness,
        windows_per_closure=sum(sizes) / len(sizes) if sizes else 1.0,
        kind="ceiling" if step_ms == 0 else "emulated",
    )


def measure(workers, args):
    """Runs one cluster of `workers`; returns a row per n_sync (and the ceiling's)."""
    import keras

    import tf_asgd

    rows = []
    with harness.local_cluster(workers, args.ps) as cluster:
        host_pid = list(cluster.pids().values())[0]
        strategy = tf_asgd.AsyncParameterServerStrategy(
            cluster.resolver, n_sync=args.n_sync[0], staleness="dynsgd"
        )
        with strategy.scope():
            model = getattr(tf_asgd.models, args.model)()
            harness.compile_classifier(model, keras.optimizers.SGD(0.01))
        ceiling = [(0.0, [1])] if args.ceiling else []
        for step_ms, ns in [(args.device_ms, args.n_sync)] + ceiling:
            # One dataset per device time: a later `fit` on it keeps the workers' iterators.
            ds = emulated_dataset(model.input_shape[1:], args.batch_size, step_ms)
            for n in ns:
                row = _measure_one(strategy, model, ds, host_pid, workers, n, step_ms, args)
                print(row, flush=True)
                rows.append(row)
    return rows


def _two_places(r, key):
    return f"{r[key]:.2f}" if key in r else "-"


# scaleout.md's columns: (title, cell of a row).
COLUMNS = (
    ("kind", lambda r: r["kind"]),
    ("workers", lambda r: r["workers"]),
    ("n_sync", lambda r: r["n_sync"]),
    ("samples/s", lambda r: f"{r['samples_per_s']:.1f}"),
    ("speed-up", lambda r: _two_places(r, "speedup")),
    ("of ideal", lambda r: _two_places(r, "of_ideal")),
    ("pushes/s", lambda r: f"{r['pushes_per_s']:.1f}"),
    ("windows/closure", lambda r: f"{r['windows_per_closure']:.1f}"),
    ("MB/push", lambda r: f"{r['mb_per_push']:.1f}"),
    ("chief CPU ms/push", lambda r: f"{r['chief_cpu_ms_per_push']:.1f}"),
    ("host CPU ms/push", lambda r: f"{r['host_cpu_ms_per_push']:.1f}"),
    ("mean staleness", lambda r: f"{r['mean_staleness']:.2f}"),
)


def _plot(rows, args):
    """The speed-up per n_sync against the worker count, beside the ideal."""
    series = []
    for n in args.n_sync:
        pts = sorted(
            (r["workers"], r["speedup"]) for r in rows if r["n_sync"] == n and "speedup" in r
        )
        series.append((f"n_sync {n}", [a for a, _ in pts], [b for _, b in pts]))
    ws = sorted({r["workers"] for r in rows})
    series.append(("ideal", ws, ws))
    panel = dict(
        title=f"speed-up, emulated {args.device_ms} ms device steps, {args.ps} PS",
        xlabel="workers",
        ylabel="speed-up over 1 worker",
        series=series,
        logx=True,
        logy=True,
    )
    harness.plot_panels(
        os.path.join(args.out, "scaleout.png"), [panel], ncols=1, panel_size=(6, 4.5)
    )


def main(argv=None):
    p = harness.parser(
        __doc__, out=OUT, workers=[1, 2, 4, 8, 16, 32], n_sync=[1, 10, 100], device_ms=[20.0]
    )
    p.add_argument("--model", default="digits_convnet")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--ps", type=int, default=1)
    p.add_argument("--seconds", type=float, default=4.0, help="target length of one measurement")
    p.add_argument("--min-windows", type=int, default=2, help="windows per worker at least")
    p.add_argument("--max-pushes", type=int, default=3000, help="pushes per measurement at most")
    p.add_argument("--ceiling", action="store_true", help="also measure the push-rate ceiling")
    args = p.parse_args(argv)
    args.device_ms = harness.single(p, args, "device_ms")
    t0 = time.time()
    rows = [row for w in args.workers for row in measure(w, args)]
    wmin = min(r["workers"] for r in rows)
    emulated = [r for r in rows if r["kind"] == "emulated"]
    base = {r["n_sync"]: r["samples_per_s"] for r in emulated if r["workers"] == wmin}
    for r in emulated:
        if r["n_sync"] in base:
            r["speedup"] = r["samples_per_s"] / base[r["n_sync"]] * wmin
        if r["ideal_samples_per_s"]:
            # Robust to a slow baseline: throughput as a fraction of the device limit.
            r["of_ideal"] = r["samples_per_s"] / r["ideal_samples_per_s"]
    harness.write_csv(os.path.join(args.out, "scaleout.csv"), rows)
    rows.sort(key=lambda r: (r["kind"], r["n_sync"], r["workers"]))
    lines = [
        f"Model `{args.model}` ({rows[0]['params']} parameters), batch {args.batch_size}, "
        f"emulated device time {args.device_ms} ms/step, {args.ps} PS, staleness `dynsgd`, "
        f"all tasks in one process; {os.cpu_count()} CPU cores. "
        "Speed-up is over 1 worker at the same n_sync.",
        "",
        *harness.markdown_table(
            [title for title, _ in COLUMNS], [[cell(r) for _, cell in COLUMNS] for r in rows]
        ),
    ]
    harness.write_lines(os.path.join(args.out, "scaleout.md"), lines)
    _plot(rows, args)
    print("\n".join(lines))
    print(f"scaleout took {time.time() - t0:.0f} s", flush=True)
    return 0
