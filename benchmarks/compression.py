"""Compressed pushes and pulls on an emulated bandwidth-limited network: throughput, bytes.

For each workers x bandwidth x model x n_sync x codec x pull codec, the workers and 1 PS
(one process per task) train `model.fit` on synthetic 28x28 batches of 64 for `--windows`
windows per worker after a warm-up fit, and report samples/s and the bytes that crossed
each way per sample. A bandwidth other than `none` limits the loopback of this run's own
network namespace (the suite re-executes itself in one). Models: `gem_convnet` (164k
parameters) and `mlp` (3.7M: bandwidth-bound), as in `harness.throughput_model`. Writes
`runs.jsonl`, `runs.csv`, `summary.md` and `speedup.png` under `--out`.

    python -m benchmarks.run compression --models mlp,gem_convnet --bandwidths none,1gbit,100mbit
"""

import itertools
import json
import operator
import os
import time

from benchmarks import harness

OUT = "results/compression"  # the default --out
BATCH = 64  # synthetic 28x28 images a batch


def run(cluster, model_name, codec, pulls, n_sync, workers, windows):
    """One cell: samples/s and bytes per sample each way, after a warm-up fit."""
    import keras

    import tf_asgd

    compression = tf_asgd.Compression("topk", fraction=0.01) if codec == "topk" else codec
    strategy = tf_asgd.AsyncParameterServerStrategy(
        cluster.resolver, n_sync=n_sync, compression=compression, pull_compression=pulls
    )
    with strategy.scope():
        model = harness.throughput_model(model_name)
        harness.compile_classifier(model, keras.optimizers.SGD(0.01))
    data = harness.synthetic_images(BATCH)
    steps = n_sync * workers * windows
    model.fit(data, epochs=1, steps_per_epoch=n_sync * workers, verbose=0)  # warm-up
    before = strategy.model_stats(model)
    t0 = time.perf_counter()
    model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
    seconds = time.perf_counter() - t0
    after = strategy.model_stats(model)
    samples = steps * BATCH
    return {
        "model": model_name,
        "params": int(sum(v.numpy().size for v in model.trainable_variables)),
        "codec": codec,
        "pulls": pulls,
        "n_sync": n_sync,
        "workers": workers,
        "steps": steps,
        "seconds": seconds,
        "samples_per_s": samples / seconds,
        "pushed_bytes_per_sample": (after.bytes_pushed - before.bytes_pushed) / samples,
        "pulled_bytes_per_sample": (after.bytes_pulled - before.bytes_pulled) / samples,
    }


def main(argv=None):
    p = harness.parser(__doc__, out=OUT, workers=[2, 4], n_sync=[1, 10])
    p.add_argument("--models", type=harness.str_list, default=["mlp", "gem_convnet"])
    p.add_argument("--bandwidths", type=harness.str_list, default=["none", "1gbit", "100mbit"])
    p.add_argument("--codecs", type=harness.str_list, default=["none", "bf16", "int8", "topk"])
    p.add_argument("--pulls", type=harness.str_list, default=["none", "bf16"])
    p.add_argument(
        "--pull-codecs",
        type=harness.str_list,
        default=None,
        help="the push codecs run with compressed pulls (default: --codecs)",
    )
    p.add_argument("--windows", type=int, default=4, help="timed windows per worker")
    args = p.parse_args(argv)
    if any(b != "none" for b in args.bandwidths):
        from tf_asgd.cluster import network

        network.reexec_in_loopback_namespace()  # returns inside this run's own namespace
    import tf_asgd

    os.makedirs(args.out, exist_ok=True)
    rows = []
    with open(os.path.join(args.out, "runs.jsonl"), "a") as log:
        for workers, bandwidth in itertools.product(args.workers, args.bandwidths):
            limit = None if bandwidth == "none" else bandwidth
            with tf_asgd.LocalCluster(workers, num_ps=1, bandwidth=limit) as cluster:
                for model_name, codec, n_sync, pulls in _cells(args):
                    row = run(cluster, model_name, codec, pulls, n_sync, workers, args.windows)
                    row["bandwidth"] = bandwidth
                    print(json.dumps(row), flush=True)
                    log.write(json.dumps(row) + "\n")
                    rows.append(row)
    add_ratios(rows)
    harness.write_csv(os.path.join(args.out, "runs.csv"), rows)
    write_summary(rows, os.path.join(args.out, "summary.md"))
    plot(rows, os.path.join(args.out, "speedup.png"))


def _cells(args):
    """`(model, codec, n_sync, pulls)` per cell of one cluster, each pull codec's cells
    together (the uncompressed cell first: the others' baseline)."""
    with_pulls = args.codecs if args.pull_codecs is None else args.pull_codecs
    return [
        (model_name, codec, n_sync, pulls)
        for model_name in args.models
        for n_sync in args.n_sync
        for pulls in args.pulls
        for codec in (args.codecs if pulls == "none" else with_pulls)
    ]


def add_ratios(rows):
    """Sets each row's `x_none`: its samples/s over the same cell's (workers, model,
    bandwidth, n_sync) with nothing compressed, None where that run is absent."""
    key = operator.itemgetter("model", "bandwidth", "n_sync", "workers")
    base = {key(r): r["samples_per_s"] for r in rows if r["codec"] == r["pulls"] == "none"}
    for r in rows:
        r["x_none"] = r["samples_per_s"] / base[key(r)] if key(r) in base else None


def plot(rows, path):
    """One bar panel per model x bandwidth: each push codec's `x_none`, with float32 and
    with bf16 pulls, per workers x n_sync."""
    panels = []
    for model_name in dict.fromkeys(r["model"] for r in rows):
        for bandwidth in dict.fromkeys(r["bandwidth"] for r in rows):
            cells = [r for r in rows if r["model"] == model_name and r["bandwidth"] == bandwidth]
            groups = list(dict.fromkeys((r["workers"], r["n_sync"]) for r in cells))
            series = []
            for pulls, codec in dict.fromkeys((r["pulls"], r["codec"]) for r in cells):
                mine = {
                    (r["workers"], r["n_sync"]): r["x_none"]
                    for r in cells
                    if (r["pulls"], r["codec"]) == (pulls, codec)
                }
                y = [mine.get(g) or 0.0 for g in groups]
                series.append((f"push {codec}, pull {pulls}", range(len(groups)), y))
            panels.append(
                {
                    "title": f"{model_name}, {bandwidth}; groups: "
                    + ", ".join(f"{w}w n_sync {n}" for w, n in groups),
                    "xlabel": "group",
                    "ylabel": "samples/s over uncompressed",
                    "kind": "bar",
                    "series": series,
                    "hline": (1.0, "uncompressed"),
                }
            )
    harness.plot_panels(path, panels, ncols=3, panel_size=(6.0, 3.6))


def write_summary(rows, path):
    """One row per cell; `x none` is samples/s over the same cell with nothing compressed."""
    header = ["workers", "model", "bandwidth", "n_sync", "codec", "pulls", "samples/s"]
    header += ["x none", "pushed B/sample", "pulled B/sample"]
    cells = [
        [
            r["workers"],
            f"{r['model']} ({r['params'] / 1e6:.2f}M)",
            r["bandwidth"],
            r["n_sync"],
            r["codec"],
            r["pulls"],
            f"{r['samples_per_s']:.0f}",
            "" if r["x_none"] is None else f"{r['x_none']:.2f}",
            f"{r['pushed_bytes_per_sample']:.0f}",
            f"{r['pulled_bytes_per_sample']:.0f}",
        ]
        for r in rows
    ]
    harness.write_lines(path, harness.markdown_table(header, cells))
