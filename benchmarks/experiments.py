"""The GPU A-SGD paper's experiments on a local cluster: n_sync, workers, cold against warm start.

Each run trains a fresh digits convnet on the digits with Keras 3 `fit` under
`AsyncParameterServerStrategy` and records every window as it finishes; curves are the
training error over the last `--smooth` minibatches against wall time and samples seen.
Sweeps (`--sweeps`): `nsync` (`--n-sync` at `--nsync-workers`), `workers` (`--workers` at
`--workers-nsync`), `start` (cold against warm start, `--warm-steps`). `--device-ms` adds
emulated device time per minibatch. Method: docs/benchmarks.md. Writes `windows.csv` (a row
per window), `summary.csv`, `staleness.csv`, `<sweep>_curves.png` and `<sweep>_staleness.png`.

    python -m benchmarks.run experiments --sweeps nsync --n-sync 1,10 --steps 200
"""

import os
import time

import numpy as np

from benchmarks import harness, metrics

OUT = "results/experiments"  # the default --out


def _metric_index(model):
    """Where the loss's and the accuracy's total and count are in `model.metrics_variables`."""
    paths = [v.path for v in model.metrics_variables]

    def find(*words):
        for i, p in enumerate(paths):
            if all(w in p for w in words):
                return i
        raise KeyError(f"no metric variable with {words} in {paths}")

    return tuple(find(m, part) for m in ("loss", "accuracy") for part in ("total", "count"))


def train_run(strategy, workers, n_sync, steps, args, data, warm_steps=0, name=""):
    """One training run; returns (window rows, summary row, staleness histogram)."""
    import keras
    import tensorflow as tf

    import tf_asgd
    from tf_asgd.data import sleep_transformation

    (x, y), (xt, yt) = data
    # No shuffle seed: each worker draws its own order.
    ds = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .shuffle(len(x))
        .batch(args.batch_size, drop_remainder=True)
    )
    if args.device_ms > 0:
        ds = ds.apply(sleep_transformation(args.device_ms * 1000))
    keras.utils.set_random_seed(args.seed)
    with strategy.scope():
        model = tf_asgd.models.digits_convnet()
        harness.compile_classifier(
            model, keras.optimizers.SGD(args.eta, momentum=args.momentum), metrics=["accuracy"]
        )
    hist0 = strategy.counters.stats(0, 0).staleness_histogram
    t0, wall0 = time.perf_counter(), time.time()
    strategy.n_sync = n_sync
    if warm_steps:  # warm start: one window at a time (each epoch joins), then all workers
        model.fit(ds, steps_per_epoch=n_sync, epochs=max(1, warm_steps // n_sync), verbose=0)
    model.fit(ds, steps_per_epoch=steps - warm_steps, epochs=1, verbose=0)
    wall = time.perf_counter() - t0
    hist = strategy.counters.stats(0, 0).staleness_histogram - hist0
    test_loss, test_acc = model.evaluate(xt, yt, verbose=0, batch_size=256)
    li, lc, ai, ac = _metric_index(model)
    key = dict(run=name, workers=workers, n_sync=n_sync, warm_steps=warm_steps)
    rows, samples = [], 0
    # Every window, in the order its push landed (the worker's clock).
    for record in sorted(strategy.window_log(model), key=lambda r: r.finished_at):
        v = record.state
        count = float(v[ac])
        if count <= 0:
            continue
        samples += count
        rows.append(
            dict(
                key,
                time=record.finished_at - wall0,
                samples=samples,
                minibatches=count / args.batch_size,
                loss=float(v[li]) / float(v[lc]),
                error=1.0 - float(v[ai]) / count,
            )
        )
    summary = dict(
        key,
        steps=steps,
        wall_s=wall,
        samples_per_s=steps * args.batch_size / wall,
        windows=len(rows),
        mean_staleness=metrics.mean_staleness(hist),
        final_train_error_400=_smoothed(rows, args)[-1] if rows else float("nan"),
        test_accuracy=float(test_acc),
        test_loss=float(test_loss),
    )
    return rows, summary, hist


def _smoothed(rows, args):
    return metrics.sliding_mean(
        [r["error"] for r in rows], args.smooth, weights=[r["minibatches"] for r in rows]
    )


def main(argv=None):
    p = harness.parser(
        __doc__, out=OUT, workers=[1, 2, 4, 8], n_sync=[1, 10, 100, 900], seeds=[0], device_ms=[3.0]
    )
    p.add_argument("--sweeps", default="nsync,workers,start")
    p.add_argument("--nsync-workers", type=int, default=2, help="workers of the n_sync sweep")
    p.add_argument("--workers-nsync", type=int, default=10, help="n_sync of the workers sweep")
    p.add_argument("--start-workers", type=int, default=4)
    p.add_argument("--start-nsync", type=int, default=100)
    p.add_argument("--warm-steps", type=int, default=800)
    p.add_argument("--steps", type=int, default=3600, help="minibatches per run (all workers)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--eta", type=float, default=0.02)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--smooth", type=int, default=400, help="smoothing window in minibatches")
    args = p.parse_args(argv)
    args.device_ms = harness.single(p, args, "device_ms")
    args.seed = harness.single(p, args, "seeds")

    import tf_asgd

    data = tf_asgd.data.load_digits()
    sweeps = args.sweeps.split(",")
    plan = {}  # workers -> [(sweep, label, n_sync, warm_steps)]
    if "nsync" in sweeps:
        for n in args.n_sync:
            plan.setdefault(args.nsync_workers, []).append(("nsync", f"n_sync={n}", n, 0))
    if "workers" in sweeps:
        for w in args.workers:
            plan.setdefault(w, []).append(("workers", f"{w} workers", args.workers_nsync, 0))
    if "start" in sweeps:
        for warm in (0, args.warm_steps):
            label = "warm start" if warm else "cold start"
            plan.setdefault(args.start_workers, []).append(("start", label, args.start_nsync, warm))

    windows, summaries, hists = [], [], {}
    t0 = time.time()
    for workers in sorted(plan):
        with harness.local_cluster(workers) as cluster:
            strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=1)
            for sweep, label, n, warm in plan[workers]:
                steps = max(args.steps, 2 * n * workers + warm)
                run = f"{sweep}:{label}"
                rows, summary, hist = train_run(strategy, workers, n, steps, args, data, warm, run)
                hists[run] = hist
                for r in rows + [summary]:
                    r["sweep"] = sweep
                windows += rows
                summaries.append(summary)
                print(summary, flush=True)

    harness.write_csv(os.path.join(args.out, "windows.csv"), windows)
    harness.write_csv(os.path.join(args.out, "summary.csv"), summaries)
    stale_rows = []
    for sweep in sweeps:
        stale_rows += plot_sweep(sweep, summaries, windows, hists, args)
    harness.write_csv(os.path.join(args.out, "staleness.csv"), stale_rows)
    print(f"experiments took {time.time() - t0:.0f} s", flush=True)
    return 0


def plot_sweep(sweep, summaries, windows, hists, args):
    """Draws `<sweep>_curves.png` and `<sweep>_staleness.png`; returns the staleness rows."""
    runs = [s["run"] for s in summaries if s["sweep"] == sweep]
    by_time, by_samples, stale, stale_rows = [], [], [], []
    for run in runs:
        rows = [r for r in windows if r["run"] == run]
        if not rows:
            continue
        label = run.split(":", 1)[1]
        sm = _smoothed(rows, args)
        by_time.append((label, [r["time"] for r in rows], sm))
        by_samples.append((label, [r["samples"] for r in rows], sm))
        h = hists[run]
        last = np.nonzero(h)[0]
        h = h[: (last[-1] + 1) if len(last) else 1]  # up to the largest staleness seen
        stale.append((label, np.arange(len(h)), h / max(1, h.sum())))
        stale_rows += [dict(run=run, staleness=i, count=int(c)) for i, c in enumerate(h)]
    if not runs:
        return stale_rows
    error = dict(
        title=f"training error ({args.smooth}-minibatch window)",
        ylabel="training error",
        ylim=(0, 1),
    )
    harness.plot_panels(
        os.path.join(args.out, f"{sweep}_curves.png"),
        [
            dict(error, xlabel="wall time (s)", series=by_time),
            dict(error, xlabel="samples seen", series=by_samples),
        ],
        ncols=2,
        title=f"digits, digits_convnet, batch {args.batch_size}, eta {args.eta}, "
        f"emulated {args.device_ms} ms/step",
    )
    harness.plot_panels(
        os.path.join(args.out, f"{sweep}_staleness.png"),
        [
            dict(
                title="staleness of pushes",
                xlabel="staleness",
                ylabel="fraction of pushes",
                series=stale,
                kind="bar",
            )
        ],
        ncols=1,
        panel_size=(7, 4),
    )
    return stale_rows
