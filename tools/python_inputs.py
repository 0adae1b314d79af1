"""A `keras.utils.PyDataset` against the same data as NumPy arrays: samples/s of `fit`.

With arrays each worker reads its own shard; with a PyDataset the chief reads every batch
and sends it with each closure (`tf_asgd.runtime.python_inputs`), so the chief's CPU can stop it
scaling. For each worker count (`--workers`), the digits convnet trains on `--samples`
images, once on arrays and once on a PyDataset of them, alternating, `--rounds` times;
`--getitem-ms` adds a per-batch sleep in `__getitem__` (`--py-workers` enqueuer threads).
Reports samples/s, the PyDataset / arrays ratio, the chief's and the tasks' CPU, and where
the PyDataset stops scaling. Method and how to read it: docs/architecture.md (Tools).

Writes `python_inputs.csv` and `python_inputs.md` to `--out`.

    python tools/python_inputs.py --workers 2,4 --samples 38400 --rounds 3
"""

import os
import statistics
import sys
import time

import harness


def digits_arrays(samples):
    """The digits training images tiled to `samples` examples."""
    import numpy as np

    import tf_asgd

    (x, y), _ = tf_asgd.data.load_digits()
    reps = -(-samples // len(x))
    return np.concatenate([x] * reps)[:samples], np.concatenate([y] * reps)[:samples]


def py_dataset(x, y, batch_size, getitem_ms, workers):
    """A PyDataset of `(x, y)` in batches of `batch_size`, each batch taking
    `getitem_ms` of sleep to make (Python-side loading that uses no CPU)."""
    import keras

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return -(-len(x) // batch_size)

        def __getitem__(self, i):
            if getitem_ms:
                time.sleep(getitem_ms / 1000.0)
            return x[i * batch_size : (i + 1) * batch_size], y[
                i * batch_size : (i + 1) * batch_size
            ]

    return Batches(workers=workers)


def measure(workers, x, y, args):
    """One cluster of `workers`: a row per input and round."""
    import keras

    import tf_asgd

    def model_for(strategy):
        with strategy.scope():
            model = getattr(tf_asgd.models, args.model)()
            return harness.compile_classifier(model, keras.optimizers.SGD(0.05, momentum=0.9))

    inputs = {
        "arrays": lambda model: model.fit(x, y, batch_size=args.batch_size, epochs=1, verbose=0),
        "PyDataset": lambda model: model.fit(
            py_dataset(x, y, args.batch_size, args.getitem_ms, args.py_workers), epochs=1, verbose=0
        ),
    }
    rows = []
    with harness.local_cluster(workers) as cluster:
        host_pid = list(cluster.pids().values())[0]
        strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=args.n_sync)
        models = {name: model_for(strategy) for name in inputs}
        for name, fit in inputs.items():
            fit(models[name])  # warm-up: traces the window, sizes the closures
        for r in range(args.rounds):
            for name, fit in inputs.items():
                c0, h0 = time.process_time(), harness.cpu_seconds(host_pid)
                t0 = time.perf_counter()
                fit(models[name])
                wall = time.perf_counter() - t0
                chief = time.process_time() - c0
                host = harness.cpu_seconds(host_pid) - h0
                row = dict(
                    workers=workers,
                    input=name,
                    round=r,
                    samples=len(x),
                    seconds=wall,
                    samples_per_s=len(x) / wall,
                    chief_cpu_ms_per_1000=1e6 * chief / len(x),
                    host_cpu_ms_per_1000=1e6 * host / len(x),
                    chief_cpu_share=chief / wall,
                    host_cpu_share=host / wall,
                    load_avg=os.getloadavg()[0],
                )
                print(row, flush=True)
                rows.append(row)
    return rows


def summarize(rows):
    """Median of the rounds per (workers, input), with the PyDataset / arrays ratio."""
    out = []
    for w in sorted({r["workers"] for r in rows}):
        for name in ("arrays", "PyDataset"):
            mine = [r for r in rows if r["workers"] == w and r["input"] == name]
            row = dict(workers=w, input=name, rounds=len(mine))
            for key in (
                "samples_per_s",
                "chief_cpu_ms_per_1000",
                "host_cpu_ms_per_1000",
                "chief_cpu_share",
                "host_cpu_share",
            ):
                row[key] = statistics.median(r[key] for r in mine)
            out.append(row)
        arrays, py = out[-2], out[-1]
        py["ratio_to_arrays"] = py["samples_per_s"] / arrays["samples_per_s"]
        arrays["ratio_to_arrays"] = 1.0
    return out


def verdict(summary):
    """Where the PyDataset stops scaling, in words, from the medians."""
    ws = sorted({r["workers"] for r in summary})
    get = {(r["workers"], r["input"]): r for r in summary}
    lines = []
    lo, hi = ws[0], ws[-1]
    ups = {}
    for name in ("arrays", "PyDataset"):
        ups[name] = get[(hi, name)]["samples_per_s"] / get[(lo, name)]["samples_per_s"]
        lines.append(f"{name}: {hi} workers gave {ups[name]:.2f}x the samples/s of {lo}.")
    py = get[(hi, "PyDataset")]
    ceiling = 1e6 / py["chief_cpu_ms_per_1000"] if py["chief_cpu_ms_per_1000"] else float("inf")
    lines.append(
        f"At {hi} workers the chief's CPU was {py['chief_cpu_share']:.2f} of a core with the "
        f"PyDataset ({get[(hi, 'arrays')]['chief_cpu_share']:.2f} with arrays); the chief alone "
        f"could send at most about {ceiling:.0f} samples/s at its measured CPU per sample."
    )
    cores = os.cpu_count()
    busy = py["chief_cpu_share"] + py["host_cpu_share"]
    ratio = py["ratio_to_arrays"]
    if ups["PyDataset"] < 0.9 * ups["arrays"] and py["chief_cpu_share"] > 0.8:
        lines.append(f"The PyDataset stops scaling before {hi} workers: the chief is the limit.")
    elif ratio < 0.8 and py["chief_cpu_share"] < 0.5:
        lines.append(
            f"The PyDataset gave {ratio:.2f} of the arrays' samples/s at {hi} workers with the "
            "chief's CPU mostly idle: waiting for its batches (`__getitem__`, one at a time "
            "unless `workers` > 1) bounds it, not the workers."
        )
    elif busy > 0.8 * cores:
        lines.append(
            f"Both are bound by the machine at {hi} workers: chief and tasks used {busy:.1f} of "
            f"{cores} cores, so more workers cannot add samples/s here."
        )
    elif ups["PyDataset"] < 0.9 * ups["arrays"]:
        lines.append(f"The PyDataset scales less than arrays up to {hi} workers.")
    else:
        lines.append(f"The PyDataset scales as arrays do up to {hi} workers.")
    load = os.getloadavg()[0]
    if load > cores:
        lines.append(
            f"The machine was shared (load average {load:.1f} on {cores} cores): CPU shares "
            "below what the runs could use, and idle time, may be other processes' doing."
        )
    return lines


def main(argv=None):
    p = harness.parser(__doc__, out="results/python_inputs", workers=[2, 4], n_sync=[10])
    p.add_argument("--model", default="digits_convnet")
    p.add_argument("--samples", type=int, default=38400, help="training examples per fit")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--getitem-ms",
        type=float,
        default=0.0,
        help="sleep per PyDataset batch (Python-side loading)",
    )
    p.add_argument(
        "--py-workers", type=int, default=1, help="PyDataset(workers=...): Keras's enqueuer threads"
    )
    args = p.parse_args(argv)
    args.n_sync = harness.single(p, args, "n_sync")
    t0 = time.time()
    x, y = digits_arrays(args.samples)
    rows = []
    for w in args.workers:
        rows += measure(w, x, y, args)
    summary = summarize(rows)
    os.makedirs(args.out, exist_ok=True)
    harness.write_csv(os.path.join(args.out, "python_inputs.csv"), rows)
    header = [
        "workers",
        "input",
        "samples/s",
        "PyDataset / arrays",
        "chief CPU ms / 1000",
        "host CPU ms / 1000",
        "chief CPU share",
        "host CPU share",
    ]
    cells = [
        [
            r["workers"],
            r["input"],
            f"{r['samples_per_s']:.0f}",
            f"{r['ratio_to_arrays']:.2f}",
            f"{r['chief_cpu_ms_per_1000']:.0f}",
            f"{r['host_cpu_ms_per_1000']:.0f}",
            f"{r['chief_cpu_share']:.2f}",
            f"{r['host_cpu_share']:.2f}",
        ]
        for r in summary
    ]
    lines = [
        f"Model `{args.model}`, {args.samples} samples per fit, batch {args.batch_size}, n_sync "
        f"{args.n_sync}, 1 PS, all tasks in one process; PyDataset `__getitem__` sleep "
        f"{args.getitem_ms} ms, {args.py_workers} enqueuer thread(s); medians of {args.rounds} "
        f"rounds; {os.cpu_count()} CPU cores (load average {os.getloadavg()[0]:.1f} at the end).",
        "",
        *harness.markdown_table(header, cells),
        "",
        *verdict(summary),
    ]
    harness.write_lines(os.path.join(args.out, "python_inputs.md"), lines)
    print("\n".join(lines))
    print(f"python_inputs took {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
