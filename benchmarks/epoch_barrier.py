"""Windows across epoch ends, side by side: what does an epoch's barrier cost?

The MNIST-1D CNN on `--data`, in alternating rounds: `fit` with `epoch_barrier=True` for
`--epochs` epochs of `--steps` steps, and with `False` for as many and twice as many.
Medians of `fit`'s time, samples/s, the workers' busy share, the device's share of a window
(near 1: the emulated device is the bottleneck, not the CPU) and held-out accuracy after
`fit` (without the barrier an epoch ends before its windows do), with the ratios.

    python -m benchmarks.run epoch_barrier --workers 2 --n-sync 10 --epochs 2 --rounds 1
"""

import os
import time

from benchmarks import harness, metrics, setups

OUT = "results/epoch_barrier"  # the default --out
BATCH = 32

CONFIGS = ((True, 1), (False, 1), (False, 2))  # (epoch_barrier, epochs: times --epochs)


def run_config(cluster, barrier, times, data, args):
    """One `fit` of a fresh model with `epoch_barrier=barrier` for `times` times
    `--epochs`; its row."""
    import keras

    import tf_asgd

    strategy = tf_asgd.AsyncParameterServerStrategy(
        cluster.resolver,
        n_sync=args.n_sync,
        epoch_barrier=barrier,
        per_worker_dataset_fn=tf_asgd.data.emulated_device_time(args.device_ms),
    )
    _, (x_test, y_test) = data
    ds = setups.train_dataset(data, BATCH, args.seed)
    keras.utils.set_random_seed(args.seed)
    with strategy.scope():
        model = setups.build_model("mnist1d_cnn", data)
        harness.compile_classifier(model, setups.make_optimizer(args.optimizer), ["accuracy"])
    model.fit(ds, steps_per_epoch=args.n_sync * args.workers, epochs=1, verbose=0)  # trace
    warm = len(strategy.window_log(model))
    t0 = time.perf_counter()
    epochs = args.epochs * times
    model.fit(ds, steps_per_epoch=args.steps, epochs=epochs, verbose=0)
    seconds = time.perf_counter() - t0
    log = [r for r in strategy.window_log(model)[warm:] if not r.replayed]
    busy = sum(r.finished_at - r.started_at for r in log)
    device = sum(r.samples / BATCH * args.device_ms / 1000 for r in log)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0, batch_size=256)
    return dict(
        epoch_barrier=barrier,
        workers=args.workers,
        n_sync=args.n_sync,
        epochs=epochs,
        seconds=seconds,
        samples_per_s=args.steps * epochs * BATCH / seconds,
        busy_share=busy / (args.workers * seconds),
        device_share=device / busy if busy else float("nan"),
        windows=len(log),
        test_accuracy=accuracy,
    )


def report(rows, args):
    """The markdown lines: the medians per config, and the ratios."""

    def median(barrier, epochs, key):
        return metrics.median_of(rows, key, epoch_barrier=barrier, epochs=epochs)

    configs = list(dict.fromkeys((r["epoch_barrier"], r["epochs"]) for r in rows))
    keys = ("seconds", "samples_per_s", "busy_share", "device_share", "windows", "test_accuracy")
    header = ["epoch_barrier", "epochs", "fit seconds", "samples/s", "workers busy"]
    header += ["device share", "windows", "test accuracy"]
    cells = [[str(b), str(e)] + [f"{median(b, e, k):.3g}" for k in keys] for b, e in configs]
    barrier, same, more = configs
    return [
        f"{args.workers} workers, 1 PS, all tasks in one process; MNIST-1D CNN on {args.data}, "
        f"{args.optimizer}, batch {BATCH}, emulated device time {args.device_ms:g} ms "
        f"a minibatch, n_sync {args.n_sync}, epochs of {args.steps} steps; median of "
        f"{args.rounds} rounds; {os.cpu_count()} CPU cores.",
        "",
        *harness.markdown_table(header, cells),
        "",
        "- samples/s without the barrier over with it: "
        f"{median(*same, 'samples_per_s') / median(*barrier, 'samples_per_s'):.2f}",
        f"- the same epochs: accuracy {median(*same, 'test_accuracy'):.3f} without the barrier, "
        f"{median(*barrier, 'test_accuracy'):.3f} with it",
        f"- {more[1]} epochs without the barrier: "
        f"{median(*more, 'seconds') / median(*barrier, 'seconds'):.2f} times the "
        f"time of {barrier[1]} with it, accuracy {median(*more, 'test_accuracy'):.3f}",
    ]


def main(argv=None):
    p = harness.parser(__doc__, out=OUT, workers=[8], n_sync=[100], seeds=[0], device_ms=[20.0])
    p.add_argument("--data", default="mnist1d64k", help="a harness data set")
    p.add_argument("--optimizer", default="adam_4e-3")
    p.add_argument("--steps", type=int, default=400, help="steps per epoch")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    for name in ("workers", "n_sync", "device_ms"):
        setattr(args, name, harness.single(p, args, name))
    args.seed = harness.single(p, args, "seeds")
    data = setups.load_data(args.data)
    rows = []
    with harness.local_cluster(args.workers) as cluster:
        for k, (barrier, times) in metrics.alternating(CONFIGS, args.rounds):
            rows.append({**run_config(cluster, barrier, times, data, args), "round": k})
            print(rows[-1], flush=True)
    harness.write_csv(os.path.join(args.out, "epoch_barrier.csv"), rows)
    lines = report(rows, args)
    harness.write_lines(os.path.join(args.out, "epoch_barrier.md"), lines)
    print("\n".join(lines))
