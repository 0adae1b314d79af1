"""Windows across epoch ends, side by side: what does an epoch's barrier cost?

One `LocalCluster` of `--workers` workers, each minibatch costing `--device-ms` of emulated
device time; the MNIST-1D CNN on `--data`, epochs of `--steps` steps. In alternating rounds
`fit` with `epoch_barrier=True` (each epoch's end waits for its windows) for `--epochs`, and
`False` (the workers go on with the next epoch's) for `--budget` times as many. Reports
medians of `fit`'s time, samples/s, the workers' busy share (window time over workers x
`fit` time), the device's share of a window (its steps' emulated time over its time: near
1, the device and not the CPU is the bottleneck), held-out accuracy at each epoch's end,
and the time to the barrier's final accuracy minus 1 point. Writes `epoch_barrier.csv`,
`epoch_barrier.md` and `accuracy_vs_seconds.png` to `--out`.

    python tools/epoch_barrier.py                      # 8 workers, n_sync 100
    python tools/epoch_barrier.py --workers 2 --n-sync 10 --epochs 2 --rounds 1
"""

import os
import statistics
import sys
import time

import harness

CONFIGS = (True, False)  # epoch_barrier


def run_config(cluster, barrier, data, args):
    """One `fit` of a fresh model with `epoch_barrier=barrier`; its row."""
    import keras

    import tf_asgd

    EpochEnds = _epoch_ends()
    strategy = tf_asgd.AsyncParameterServerStrategy(
        cluster.resolver,
        n_sync=args.n_sync,
        epoch_barrier=barrier,
        per_worker_dataset_fn=tf_asgd.data.emulated_device_time(args.device_ms),
    )
    ds = harness.train_dataset(data, args.batch_size, args.seed)
    keras.utils.set_random_seed(args.seed)
    with strategy.scope():
        model = harness.build_model("mnist1d_cnn", data)
        harness.compile_classifier(model, harness.make_optimizer(args.optimizer), ["accuracy"])
    model.fit(ds, steps_per_epoch=args.n_sync * args.workers, epochs=1, verbose=0)  # trace
    warm = len(strategy.window_log(model))
    epochs = args.epochs if barrier else round(args.epochs * args.budget)
    ends = EpochEnds()
    model.fit(ds, steps_per_epoch=args.steps, epochs=epochs, verbose=0, callbacks=[ends])
    seconds = ends.at[-1][0]
    log = [r for r in strategy.window_log(model)[warm:] if not r.replayed]
    busy = sum(r.finished_at - r.started_at for r in log)
    device = sum(r.samples / args.batch_size * args.device_ms / 1000 for r in log)
    held_out = harness.HeldOut("mnist1d_cnn", data)
    curve = [(t, held_out(weights)[0]) for t, weights in ends.at]
    return dict(
        epoch_barrier=barrier,
        workers=args.workers,
        n_sync=args.n_sync,
        epochs=epochs,
        seconds=seconds,
        samples_per_s=args.steps * epochs * args.batch_size / seconds,
        busy_share=busy / (args.workers * seconds),
        device_share=device / busy if busy else float("nan"),
        windows=len(log),
        test_accuracy=curve[-1][1],
        curve=curve,
    )


def _epoch_ends():
    import keras

    class EpochEnds(keras.callbacks.Callback):
        """Seconds since `fit` began, and the central weights, at each epoch's end."""

        def on_train_begin(self, logs=None):
            self.t0, self.at = time.perf_counter(), []

        def on_epoch_end(self, epoch, logs=None):
            self.at.append((time.perf_counter() - self.t0, self.model.get_weights()))

    return EpochEnds


def _time_to(curve, target):
    return next((t for t, accuracy in curve if accuracy >= target), float("inf"))


def report(rows, args):
    """The markdown lines: the medians per config, the time to the target, the ratios."""

    def median(barrier, key):
        return statistics.median(r[key] for r in rows if r["epoch_barrier"] == barrier)

    target = median(True, "test_accuracy") - 0.01
    for r in rows:
        r["seconds_to_target"] = _time_to(r["curve"], target)
    keys = ("epochs", "seconds", "samples_per_s", "busy_share", "device_share", "windows")
    keys += ("test_accuracy", "seconds_to_target")
    header = ["epoch_barrier", "epochs", "fit seconds", "samples/s", "workers busy"]
    header += ["device share", "windows", "final accuracy", f"seconds to {target:.3f}"]
    cells = [[str(b)] + [f"{median(b, k):.3g}" for k in keys] for b in CONFIGS]
    ratio = median(False, "samples_per_s") / median(True, "samples_per_s")
    sooner = median(True, "seconds_to_target") / median(False, "seconds_to_target")
    return [
        f"{args.workers} workers, 1 PS, all tasks in one process; MNIST-1D CNN on {args.data}, "
        f"{args.optimizer}, batch {args.batch_size}, emulated device time {args.device_ms:g} ms "
        f"a minibatch, n_sync {args.n_sync}, epochs of {args.steps} steps ({args.epochs} with "
        f"the barrier, {args.budget:g} times as many without); median of {args.rounds} rounds; "
        f"{os.cpu_count()} CPU cores. Target: the barrier's median final minus 1 point.",
        "",
        *harness.markdown_table(header, cells),
        "",
        f"- samples/s without the barrier over with it: {ratio:.2f}",
        f"- time to {target:.3f}, with the barrier over without it: {sooner:.2f}",
    ]


def plot(rows, path):
    panel = dict(title="held-out accuracy at each epoch's end", xlabel="seconds of fit")
    panel["ylabel"], panel["series"] = "accuracy", []
    for r in rows:
        label = f"epoch_barrier={r['epoch_barrier']}, round {r['round']}"
        panel["series"].append((label, [t for t, _ in r["curve"]], [a for _, a in r["curve"]]))
    harness.plot_panels(path, [panel], ncols=1)


def main(argv=None):
    p = harness.parser(
        __doc__, out="results/epoch_barrier", workers=[8], n_sync=[100], seeds=[0], device_ms=[20.0]
    )
    p.add_argument("--data", default="mnist1d64k", help="a harness data set")
    p.add_argument("--optimizer", default="adam_4e-3")
    p.add_argument("--steps", type=int, default=400, help="steps per epoch")
    p.add_argument("--epochs", type=int, default=10, help="with the barrier")
    p.add_argument("--budget", type=float, default=2.0, help="without it: times --epochs")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    for name in ("workers", "n_sync", "device_ms"):
        setattr(args, name, harness.single(p, args, name))
    args.seed = harness.single(p, args, "seeds")
    data = harness.load_data(args.data)
    rows = []
    t0 = time.time()
    with harness.local_cluster(args.workers) as cluster:
        for k in range(args.rounds):
            for barrier in CONFIGS if k % 2 == 0 else CONFIGS[::-1]:  # drift hits both alike
                row = run_config(cluster, barrier, data, args)
                row["round"] = k
                print({k: v for k, v in row.items() if k != "curve"}, flush=True)
                rows.append(row)
    os.makedirs(args.out, exist_ok=True)
    lines = report(rows, args)
    plot(rows, os.path.join(args.out, "accuracy_vs_seconds.png"))
    for r in rows:
        r["curve"] = " ".join(f"{t:.2f}:{a:.4f}" for t, a in r["curve"])
    harness.write_csv(os.path.join(args.out, "epoch_barrier.csv"), rows)
    harness.write_lines(os.path.join(args.out, "epoch_barrier.md"), lines)
    print("\n".join(lines))
    print(f"epoch_barrier took {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
