"""Compressed pushes on an emulated bandwidth-limited network: throughput and bytes.

For each model x bandwidth x codec x n_sync, 2 workers and 1 PS (all tasks in one child
process) train `model.fit` on synthetic 28x28 batches of 64 for `--windows` windows per
worker after a warm-up fit, and report samples/s and the bytes that crossed each way per
sample (`strategy.model_stats`). A bandwidth other than `none` limits the loopback of this
run's own network namespace (`LocalCluster(bandwidth=...)`): the tool re-executes itself
in one. Models: `gem_convnet` (`models.gem_mnist_convnet`, 164k parameters) and `mlp`
(784-2048-1024-10, 3.7M parameters: bandwidth-bound). Pulls are not compressed.

    python tools/compression.py --models mlp,gem_convnet --bandwidths none,1gbit,100mbit
"""

import json
import os
import time

import _common

CODECS = ("none", "bf16", "int8", "topk")


def _model(name):
    import keras

    import tf_asgd

    if name == "gem_convnet":
        return tf_asgd.models.gem_mnist_convnet()
    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Flatten(),
            keras.layers.Dense(2048, activation="relu"),
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def _dataset(batch=64):
    import tensorflow as tf

    x = tf.random.stateless_uniform([batch, 28, 28, 1], seed=[1, 2])
    y = tf.random.stateless_uniform([batch], seed=[3, 4], maxval=10, dtype=tf.int32)
    return tf.data.Dataset.from_tensors((x, y)).repeat()


def run(cluster, model_name, codec, n_sync, windows, workers=2, batch=64):
    """One cell: samples/s and bytes per sample each way, after a warm-up fit."""
    import keras

    import tf_asgd

    compression = tf_asgd.Compression("topk", fraction=0.01) if codec == "topk" else codec
    strategy = tf_asgd.AsyncParameterServerStrategy(
        cluster.resolver, n_sync=n_sync, compression=compression
    )
    with strategy.scope():
        model = _model(model_name)
        _common.compile_classifier(model, keras.optimizers.SGD(0.01))
    data = _dataset(batch)
    steps = n_sync * workers * windows
    model.fit(data, epochs=1, steps_per_epoch=n_sync * workers, verbose=0)  # warm-up
    before = strategy.model_stats(model)
    t0 = time.perf_counter()
    model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
    seconds = time.perf_counter() - t0
    after = strategy.model_stats(model)
    samples = steps * batch
    return {
        "model": model_name,
        "params": int(sum(v.numpy().size for v in model.trainable_variables)),
        "codec": codec,
        "n_sync": n_sync,
        "workers": workers,
        "steps": steps,
        "seconds": seconds,
        "samples_per_s": samples / seconds,
        "pushed_bytes_per_sample": (after.bytes_pushed - before.bytes_pushed) / samples,
        "pulled_bytes_per_sample": (after.bytes_pulled - before.bytes_pulled) / samples,
        "pushed_bytes_per_window": after.bytes_pushed_per_window,
    }


def main():
    p = _common.parser(__doc__)
    p.add_argument("--out", default="results/compression")
    p.add_argument("--models", type=_common.str_list, default=["mlp", "gem_convnet"])
    p.add_argument("--bandwidths", type=_common.str_list, default=["none", "1gbit", "100mbit"])
    p.add_argument("--codecs", type=_common.str_list, default=list(CODECS))
    p.add_argument("--n-sync", type=_common.int_list, default=[1, 10])
    p.add_argument("--windows", type=int, default=4, help="timed windows per worker")
    args = p.parse_args()
    if any(b != "none" for b in args.bandwidths):
        from tf_asgd.cluster import network

        network.reexec_in_loopback_namespace()  # returns inside this run's own namespace
    import tf_asgd

    os.makedirs(args.out, exist_ok=True)
    rows = []
    with open(os.path.join(args.out, "runs.jsonl"), "a") as log:
        for bandwidth in args.bandwidths:
            limit = None if bandwidth == "none" else bandwidth
            with tf_asgd.LocalCluster(num_workers=2, num_ps=1, bandwidth=limit) as cluster:
                for model_name in args.models:
                    for n_sync in args.n_sync:
                        for codec in args.codecs:
                            row = run(cluster, model_name, codec, n_sync, args.windows)
                            row["bandwidth"] = bandwidth
                            print(json.dumps(row), flush=True)
                            log.write(json.dumps(row) + "\n")
                            rows.append(row)
    write_summary(rows, os.path.join(args.out, "summary.md"))


def write_summary(rows, path):
    """One row per cell; `x none` is samples/s over the uncompressed run of the same cell."""
    base = {
        (r["model"], r["bandwidth"], r["n_sync"]): r["samples_per_s"]
        for r in rows
        if r["codec"] == "none"
    }
    table = _common.markdown_table(
        [
            "model",
            "bandwidth",
            "n_sync",
            "codec",
            "samples/s",
            "x none",
            "pushed B/sample",
            "pulled B/sample",
        ],
        [
            [
                f"{r['model']} ({r['params'] / 1e6:.2f}M)",
                r["bandwidth"],
                r["n_sync"],
                r["codec"],
                f"{r['samples_per_s']:.0f}",
                f"{r['samples_per_s'] / base[r['model'], r['bandwidth'], r['n_sync']]:.2f}"
                if (r["model"], r["bandwidth"], r["n_sync"]) in base
                else "",
                f"{r['pushed_bytes_per_sample']:.0f}",
                f"{r['pulled_bytes_per_sample']:.0f}",
            ]
            for r in rows
        ],
    )
    _common.write_lines(path, table)


if __name__ == "__main__":
    main()
