"""A straggler, side by side: does one slow worker hold back the others?

One `LocalCluster` of `--workers` workers, each minibatch costing `--device-ms` of emulated
device time, the digits convnet on the digits. In alternating rounds: `uniform`,
`straggler` (the last worker `--slow` times slower, staleness `dynsgd`) and
`straggler_drop` (the same with `--max-staleness`). Reports medians over rounds of `fit`'s
time and where it goes, samples/s, windows/s per fast worker, staleness, dropped pushes and
held-out accuracy, and the ratios with the straggler over without next to the ideal
`(W - 1 + 1/slow) / W`. Method: docs/benchmarks.md (How each suite measures).

Writes `straggler.csv`, `straggler.md` and `straggler.png` (each push's staleness) to `--out`.

    python -m benchmarks.run straggler                          # the default run
    python -m benchmarks.run straggler --workers 3 --steps 100 --epochs 1 --rounds 1
"""

import os
import statistics
import time

from benchmarks import harness, metrics

OUT = "results/straggler"  # the default --out

CONFIGS = ("uniform", "straggler", "straggler_drop")


def run_config(cluster, name, data, args):
    """One `fit` of a fresh model under configuration `name`; returns
    (summary row, window log)."""
    import keras
    import tensorflow as tf

    import tf_asgd

    slowest = args.workers - 1
    slowdown = {} if name == "uniform" else {slowest: args.slow}
    strategy = tf_asgd.AsyncParameterServerStrategy(
        cluster.resolver,
        n_sync=args.n_sync,
        staleness="dynsgd",
        max_staleness=args.max_staleness if name == "straggler_drop" else None,
        per_worker_dataset_fn=tf_asgd.data.emulated_device_time(args.device_ms, slowdown),
    )
    (x, y), (x_test, y_test) = data
    ds = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .shuffle(len(x))
        .batch(args.batch_size, drop_remainder=True)
    )
    keras.utils.set_random_seed(args.seed)
    with strategy.scope():
        model = tf_asgd.models.digits_convnet()
        harness.compile_classifier(
            model, keras.optimizers.SGD(args.eta, momentum=args.momentum), metrics=["accuracy"]
        )
    model.fit(ds, steps_per_epoch=args.n_sync * args.workers, epochs=1, verbose=0)  # trace
    warm = len(strategy.window_log(model))
    t0, wall0 = time.perf_counter(), time.time()
    model.fit(ds, steps_per_epoch=args.steps, epochs=args.epochs, verbose=0)
    seconds = time.perf_counter() - t0
    log = strategy.window_log(model)[warm:]
    _, acc = model.evaluate(x_test, y_test, verbose=0, batch_size=256)
    fast = [r for r in log if r.worker != slowest]
    slow = [r for r in log if r.worker == slowest]
    # The fast workers' steady state: from their first push to their last.
    # Before it, fit starts (per-worker datasets are built; the first windows
    # run); after it, fit only waits for the straggler's last window.
    # A loaded machine can leave the fast workers fewer than 2 windows: no rate then.
    first = min((r.finished_at for r in fast), default=wall0)
    last = max((r.finished_at for r in fast), default=wall0)
    rate = (len(fast) - 1) / slowest / (last - first) if last > first else float("nan")
    row = dict(
        config=name,
        workers=args.workers,
        slow=args.slow if slowdown else 1.0,
        seconds=seconds,
        samples_per_s=len(log) * args.n_sync * args.batch_size / seconds,
        fast_windows_per_worker_s=rate,
        start_s=first - wall0,
        end_wait_s=wall0 + seconds - last,
        slow_windows=len(slow),
        slow_mean_staleness=statistics.fmean(r.staleness for r in slow) if slow else float("nan"),
        fast_mean_staleness=statistics.fmean(r.staleness for r in fast) if fast else float("nan"),
        dropped_stale=strategy.stats().dropped_stale,
        test_accuracy=acc,
    )
    return row, log


def main(argv=None):
    p = harness.parser(__doc__, out=OUT, workers=[4], n_sync=[5], seeds=[0], device_ms=[20.0])
    p.add_argument("--slow", type=float, default=10.0, help="the straggler's slowdown factor")
    p.add_argument("--max-staleness", type=int, default=4)
    p.add_argument("--steps", type=int, default=600, help="steps per epoch")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--eta", type=float, default=0.05)
    p.add_argument(
        "--momentum",
        type=float,
        default=0.0,
        help="the workers' SGD momentum (0.9 made 4 async workers diverge in some runs)",
    )
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    for name in ("workers", "n_sync", "device_ms"):
        setattr(args, name, harness.single(p, args, name))
    args.seed = harness.single(p, args, "seeds")
    if args.workers < 2:
        p.error("--workers must be at least 2 (one straggler and one fast worker)")
    import tf_asgd

    data = tf_asgd.data.load_digits()
    rows, logs = [], {}
    t0 = time.time()
    with harness.local_cluster(args.workers) as cluster:
        for k, name in metrics.alternating(CONFIGS, args.rounds):
            row, log = run_config(cluster, name, data, args)
            row["round"] = k
            print(row, flush=True)
            rows.append(row)
            logs.setdefault(name, log)

    def median(name, key):
        return metrics.median_of(rows, key, config=name)

    os.makedirs(args.out, exist_ok=True)
    harness.write_csv(os.path.join(args.out, "straggler.csv"), rows)
    w = args.workers
    ideal = (w - 1 + 1 / args.slow) / w
    header = [
        "config",
        "fit seconds",
        "to first push",
        "after last fast push",
        "samples/s",
        "windows/s per fast worker",
        "straggler windows",
        "straggler mean staleness",
        "fast mean staleness",
        "dropped stale",
        "test accuracy",
    ]
    keys = (
        "seconds",
        "start_s",
        "end_wait_s",
        "samples_per_s",
        "fast_windows_per_worker_s",
        "slow_windows",
        "slow_mean_staleness",
        "fast_mean_staleness",
        "dropped_stale",
        "test_accuracy",
    )
    cells = [[name] + [f"{median(name, key):.3g}" for key in keys] for name in CONFIGS]

    def over_uniform(name, key):
        return median(name, key) / median("uniform", key)

    lines = [
        f"{w} workers (worker {w - 1} {args.slow:g}x slower), 1 PS, all tasks in one process; "
        f"digits convnet, SGD eta {args.eta:g} momentum {args.momentum:g}, "
        f"batch {args.batch_size}, emulated device time {args.device_ms:g} ms per "
        f"minibatch, n_sync {args.n_sync}, {args.epochs} epochs of {args.steps} steps; "
        f"median of {args.rounds} rounds; {os.cpu_count()} CPU cores.",
        "",
        *harness.markdown_table(header, cells),
        "",
        "Ratios, with the straggler over uniform:",
        "",
        "- windows/s per fast worker: "
        f"{over_uniform('straggler', 'fast_windows_per_worker_s'):.2f} "
        f"(dropping: {over_uniform('straggler_drop', 'fast_windows_per_worker_s'):.2f}); "
        "1.00 = not held back",
        f"- samples/s: {over_uniform('straggler', 'samples_per_s'):.2f} "
        f"(dropping: {over_uniform('straggler_drop', 'samples_per_s'):.2f}); "
        f"ideal {ideal:.2f}",
    ]
    harness.write_lines(os.path.join(args.out, "straggler.md"), lines)

    panels = []
    for name in CONFIGS[1:]:
        log = logs[name]
        start = min(r.finished_at for r in log)
        series = [
            (
                f"worker {k}" + (" (straggler)" if k == w - 1 else ""),
                [r.finished_at - start for r in log if r.worker == k and r.pushed],
                [r.staleness for r in log if r.worker == k and r.pushed],
            )
            for k in range(w)
        ]
        panel = dict(
            title=f"{name}: staleness of each push",
            xlabel="seconds",
            ylabel="staleness (pushes since its pull)",
            series=series,
            kind="scatter",
        )
        if name == "straggler_drop":
            panel["hline"] = (args.max_staleness, f"max_staleness {args.max_staleness}")
        panels.append(panel)
    harness.plot_panels(os.path.join(args.out, "straggler.png"), panels)
    print("\n".join(lines))
    print(f"straggler took {time.time() - t0:.0f} s", flush=True)
    return 0
