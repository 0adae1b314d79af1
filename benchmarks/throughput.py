"""Throughput, side by side in one run: plain Keras, stock PS training, tf_asgd.

Samples/s in alternating rounds, one synthetic data set: `keras` (plain `fit`), `pss`
(stock `ParameterServerStrategy` with `tf_keras`, at each `--pss-spe`) and `asgd` (at each
`--n-sync`) on a `LocalCluster` per `--processes`, each in a fresh child process. Medians
over rounds, ratios to Keras and stock PS, bytes per sample (method: docs/benchmarks.md)
in `raw.csv`, `summary.csv`, `summary.md` (`--out`).

    python -m benchmarks.run throughput                       # the full default run
    python -m benchmarks.run throughput --workers 2 --processes separate --pss-spe 1,10
    python -m benchmarks.run throughput --modes asgd --trees before=/tmp/before,head=.

`--trees`: each `asgd` configuration once per tree a round (its package first on
`PYTHONPATH`; `git worktree add /tmp/before REV`), with per-round ratios to the first tree.
"""

import argparse
import atexit
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import harness, metrics

OUT = "results/throughput"  # the default --out

RESULT = "BENCH_RESULT "  # starts a child's output line that holds a measurement
_BENCHMARKS = os.path.dirname(os.path.abspath(__file__))


# The child side: one configuration, measured in a process of its own.
def _synthetic(shape, batch_size):
    """A function that makes a dataset of 8 fixed batches of random images (10 classes)."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.random((8 * batch_size, *shape), dtype=np.float32)
    y = rng.integers(0, 10, 8 * batch_size).astype("int64")
    return lambda: tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)


def _keras3_model(name):
    import tf_asgd

    return getattr(tf_asgd.models, name)()


def _tf_keras_model(name):
    """The same architecture as `tf_asgd.models.<name>`, built with tf_keras."""
    import tf_keras

    ref = _keras3_model(name)
    keys = ("filters", "kernel_size", "strides", "padding", "activation", "units", "pool_size")
    layers = [tf_keras.Input(ref.input_shape[1:])]
    for layer in ref.layers:
        cfg = layer.get_config()
        kwargs = {k: cfg[k] for k in keys if k in cfg}
        layers.append(getattr(tf_keras.layers, type(layer).__name__)(**kwargs))
    return tf_keras.Sequential(layers), ref.count_params()


def _emit(args, mode, n_sync, steps, seconds, pulled=0.0, pushed=0.0, **extra):
    """Prints one measurement for the parent; `pulled` and `pushed` are bytes per sample."""
    row = dict(
        mode=mode,
        processes=args.processes,
        workers=args.workers,
        n_sync=n_sync,
        steps=steps,
        seconds=seconds,
        samples_per_s=steps * args.batch_size / seconds,
        bytes_pulled_per_sample=pulled,
        bytes_pushed_per_sample=pushed,
        **extra,
    )
    print(RESULT + json.dumps(row), flush=True)


def _timed_fit(model, data, steps):
    t = time.perf_counter()
    model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0)
    return time.perf_counter() - t


def _plan_steps(rate, seconds, unit):
    """Steps for about `seconds` at `rate` steps/s: a multiple of `unit`, at least two."""
    return max(2, int(round(rate * seconds / unit))) * unit


def _measure(fit, rate, seconds, unit):
    """`(steps, seconds taken)` of `fit(steps)` (which returns seconds) for about `seconds`,
    steps planned from `rate` (steps/s) in multiples of `unit`. A fit can stall for seconds
    at its start (results/throughput/README.md), so a rate estimated in a stall plans too
    short a run: one under half of `seconds` is planned again at the faster rate, up to 3
    runs; the last one counts."""
    for _ in range(3):
        steps = _plan_steps(rate, seconds, unit)
        dt = fit(steps)
        rate = max(rate, steps / dt)
        if dt >= seconds / 2:
            break
    return steps, dt


def _child_main(args):
    """Runs one child's measurement. A cluster's fork server is forked from the child once
    TensorFlow is imported, before its runtime starts: one import of TensorFlow per child."""
    if args.child == "keras":
        child_keras(args)
        return
    if args.child == "pss":
        os.environ["TF_USE_LEGACY_KERAS"] = "1"  # tf.keras is tf_keras: before TF loads
    import tensorflow  # noqa: F401 (before the fork server is forked)

    from tf_asgd.cluster import task_server

    with task_server.fork_server_from_here():
        (child_pss if args.child == "pss" else child_asgd)(args)


def child_keras(args):
    import keras

    model = _keras3_model(args.model)
    ds = _synthetic(model.input_shape[1:], args.batch_size)().repeat()
    harness.compile_classifier(model, keras.optimizers.SGD(0.05, momentum=0.9))
    _timed_fit(model, ds, 20)
    rate = 50 / _timed_fit(model, ds, 50)
    steps, seconds = _measure(lambda n: _timed_fit(model, ds, n), rate, args.seconds, 10)
    _emit(args, "keras", 0, steps, seconds)


def child_pss(args):
    import tensorflow as tf  # with TF_USE_LEGACY_KERAS=1 (`_child_main`)
    import tf_keras

    with harness.local_cluster(args.workers, processes=args.processes) as cluster:
        strategy = tf.distribute.experimental.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            model, nparams = _tf_keras_model(args.model)
            optimizer = tf_keras.optimizers.SGD(0.05, momentum=0.9)
            harness.compile_classifier(
                model, optimizer, keras_module=tf_keras, steps_per_execution=args.spe
            )
        batches = _synthetic(model.input_shape[1:], args.batch_size)
        data = tf_keras.utils.experimental.DatasetCreator(lambda context: batches().repeat())
        _timed_fit(model, data, 20)
        rate = 40 / _timed_fit(model, data, 40)
        unit = 10 if args.spe == 1 else args.spe
        steps, seconds = _measure(lambda n: _timed_fit(model, data, n), rate, args.seconds, unit)
        per_sample = 4.0 * nparams / args.batch_size  # the whole model each way, every step
        _emit(args, "pss", args.spe, steps, seconds, per_sample, per_sample)


def child_asgd(args):
    import keras

    import tf_asgd

    with harness.local_cluster(args.workers, processes=args.processes) as cluster:
        strategy = tf_asgd.AsyncParameterServerStrategy(
            cluster.resolver, n_sync=args.n_sync[0], staleness="dynsgd"
        )
        with strategy.scope():
            model = _keras3_model(args.model)
            harness.compile_classifier(model, keras.optimizers.SGD(0.05, momentum=0.9))
        ds = _synthetic(model.input_shape[1:], args.batch_size)()
        rate = {}
        for n in args.n_sync:  # warm-up (traces once) and a first rate estimate
            strategy.n_sync = n
            window = n * args.workers
            _timed_fit(model, ds, window)
            rate[n] = window / _timed_fit(model, ds, window)
            # A second estimate over more windows (automatic K adapts here); the faster
            # one counts (a stall at a fit's start only slows it).
            steps = _plan_steps(rate[n], min(1.0, args.seconds), window)
            rate[n] = max(rate[n], steps / _timed_fit(model, ds, steps))
        for n in args.n_sync:
            strategy.n_sync = n
            stats = {}

            def fit(steps, stats=stats):
                stats["before"] = strategy.model_stats(model)  # the last run's counts
                return _timed_fit(model, ds, steps)

            steps, seconds = _measure(fit, rate[n], args.seconds, n * args.workers)
            before, after = stats["before"], strategy.model_stats(model)
            samples = steps * args.batch_size
            pulled = (after.bytes_pulled - before.bytes_pulled) / samples
            pushed = (after.bytes_pushed - before.bytes_pushed) / samples
            _emit(
                args, "asgd", n, steps, seconds, pulled, pushed, mean_staleness=after.mean_staleness
            )


# The parent side: runs the children, then writes the tables.
@functools.cache
def _benchmarks_only():
    """A folder that holds only a link to these benchmarks: first on a child's path, it
    gives the child this code, and no `tf_asgd`, whichever tree follows it."""
    folder = tempfile.mkdtemp(prefix="tf_asgd_benchmarks_")
    atexit.register(shutil.rmtree, folder, True)
    os.symlink(_BENCHMARKS, os.path.join(folder, "benchmarks"))
    return folder


def _run_child(args, mode, workers, processes, spe, tree):
    """Runs one configuration in a fresh child process; returns its measurements."""
    flags = {
        "--child": mode,
        "--workers": workers,
        "--processes": processes,
        "--spe": spe,
        "--model": args.model,
        "--batch-size": args.batch_size,
        "--seconds": args.seconds,
        "--n-sync": ",".join(str(n) for n in args.n_sync),
    }
    cmd = [sys.executable, "-m", "benchmarks.run", "throughput"]
    for flag, value in flags.items():
        cmd += [flag, str(value)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    # The child runs these benchmarks' code, whatever the tree holds, against the tree's
    # package (else the one beside them), before the installed one.
    package = os.path.abspath(tree[1]) if tree is not None else os.path.dirname(_BENCHMARKS)
    folder = _benchmarks_only()  # also the working folder: `-m` puts it first on the path
    env["PYTHONPATH"] = os.pathsep.join([folder, package, env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=env, timeout=args.child_timeout, cwd=folder
    )
    rows = [
        dict(json.loads(line[len(RESULT) :]), tree=tree[0] if tree else "")
        for line in proc.stdout.splitlines()
        if line.startswith(RESULT)
    ]
    if proc.returncode != 0 or not rows:
        raise RuntimeError(
            f"bench child {mode} x{workers} failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
        )
    return rows


def summarize(raw, batch_size):
    """Medians per configuration and the ratios between them."""
    groups = {}
    for r in raw:
        key = (r["mode"], r["processes"], r["workers"], r["n_sync"], r["tree"])
        groups.setdefault(key, []).append(r)
    med = {k: statistics.median(r["samples_per_s"] for r in v) for k, v in groups.items()}
    keras_sps = next((v for k, v in med.items() if k[0] == "keras"), None)
    # Stock PS at steps_per_execution 1 (the reference), and the faster of its runs.
    pss, best_pss = {}, {}
    for (mode, processes, workers, spe, _), v in med.items():
        if mode == "pss":
            if spe == 1:
                pss[processes, workers] = v
            best_pss[processes, workers] = max(v, best_pss.get((processes, workers), 0.0))
    rows = []
    order = {"keras": 0, "pss": 1, "asgd": 2}
    for key in sorted(groups, key=lambda k: (order[k[0]], *k[1:])):
        mode, processes, workers, n_sync, tree = key
        v, sps = groups[key], med[key]
        ref_pss = pss.get((processes, workers))
        ref_best = best_pss.get((processes, workers))
        rows.append(
            dict(
                mode=mode,
                tree=tree,
                workers=workers,
                n_sync=n_sync,
                processes=processes,
                runs=len(v),
                samples_per_s=sps,
                steps_per_s=sps / batch_size,
                min_samples_per_s=min(r["samples_per_s"] for r in v),
                max_samples_per_s=max(r["samples_per_s"] for r in v),
                ratio_to_keras=sps / keras_sps if keras_sps else "",
                ratio_to_pss=sps / ref_pss if ref_pss else "",
                ratio_to_best_pss=sps / ref_best if ref_best else "",
                bytes_pulled_per_sample=statistics.median(r["bytes_pulled_per_sample"] for r in v),
                bytes_pushed_per_sample=statistics.median(r["bytes_pushed_per_sample"] for r in v),
                mean_staleness=statistics.median(r.get("mean_staleness", 0.0) for r in v),
            )
        )
    return rows


def tree_ratios(raw, names):
    """Lines: per `asgd` configuration, each tree's samples/s over the first tree's in each
    round (runs of one round are minutes apart at most), and the median of those ratios."""
    by = {}
    for r in raw:
        if r["mode"] == "asgd":
            key = (r["processes"], r["workers"], r["n_sync"])
            by.setdefault(key, {}).setdefault(r["round"], {})[r["tree"]] = r["samples_per_s"]
    lines = [f"Samples/s over tree {names[0]!r}'s, per round (median first):"]
    for (processes, workers, n_sync), rounds in sorted(by.items()):
        for name in names[1:]:
            ratios = [
                got[name] / got[names[0]] for got in rounds.values() if {name, names[0]} <= set(got)
            ]
            if ratios:
                each = " ".join(f"{x:.3f}" for x in ratios)
                lines.append(
                    f"- {name}, {processes}, {workers} worker(s), n_sync {n_sync}: "
                    f"{statistics.median(ratios):.3f} ({each})"
                )
    return lines


def _two_places(v):
    """A float with 2 decimals; anything else (an empty ratio) as it is."""
    return f"{v:.2f}" if isinstance(v, float) else str(v)


# summary.md's columns: (title, cell of a summary row).
COLUMNS = (
    ("mode", lambda r: r["mode"]),
    ("tree", lambda r: r["tree"] or "-"),
    ("workers", lambda r: r["workers"] or "-"),
    ("n_sync", lambda r: r["n_sync"] or "-"),
    ("processes", lambda r: r["processes"]),
    ("samples/s", lambda r: f"{r['samples_per_s']:.0f}"),
    ("steps/s", lambda r: f"{r['steps_per_s']:.1f}"),
    ("x keras", lambda r: _two_places(r["ratio_to_keras"])),
    ("x pss", lambda r: _two_places(r["ratio_to_pss"])),
    ("x best pss", lambda r: _two_places(r["ratio_to_best_pss"])),
    ("pulled B/sample", lambda r: f"{r['bytes_pulled_per_sample']:.0f}"),
    ("pushed B/sample", lambda r: f"{r['bytes_pushed_per_sample']:.0f}"),
    ("mean staleness", lambda r: _two_places(r["mean_staleness"])),
)


def markdown(rows, args):
    """summary.md's lines: what was run, then one table row per configuration."""
    intro = (
        f"Model `{args.model}`, synthetic batches of {args.batch_size}, one PS, `LocalCluster` "
        "with every task in one process (`shared`) or one process per task (`separate`); "
        f"medians of {args.rounds} round(s) of a run of about {args.seconds} s each; "
        f"{os.cpu_count()} CPU cores. For `pss` rows n_sync is `steps_per_execution`. `x pss` "
        "is over stock PS with steps_per_execution 1, same worker count and process mode; "
        "`x best pss` over the faster stock run."
    )
    table = harness.markdown_table(
        [title for title, _ in COLUMNS], [[cell(r) for _, cell in COLUMNS] for r in rows]
    )
    return [intro, "", *table]


def _parser():
    p = harness.parser(__doc__, out=OUT, workers=[1, 2, 4], n_sync=[1, 10, 100])
    p.add_argument("--model", default="gem_mnist_convnet")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--modes", default="keras,pss,asgd")
    p.add_argument(
        "--processes",
        default="shared,separate",
        help="cluster process modes: shared (all tasks in one process), separate",
    )
    p.add_argument("--pss-spe", default="1,10", help="steps_per_execution of the stock PS runs")
    p.add_argument("--spe", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=3.0, help="target length of one measurement")
    p.add_argument("--child-timeout", type=float, default=600)
    p.add_argument(
        "--trees",
        type=harness.str_list,
        default=[],
        help="asgd runs once per tree, NAME=PATH each; ratios to the first tree",
    )
    p.add_argument("--child", choices=("keras", "pss", "asgd"), help=argparse.SUPPRESS)
    return p


def main(argv=None):
    p = _parser()
    args = p.parse_args(argv)
    if args.child:
        args.workers = harness.single(p, args, "workers")
        args.processes = args.processes.split(",")[0]
        _child_main(args)
        return 0

    modes = args.modes.split(",")
    spes = harness.int_list(args.pss_spe)
    trees = [tuple(t.split("=", 1)) for t in args.trees] or [None]
    # (mode, workers, processes, steps_per_execution, tree): asgd runs once per tree.
    runs = [("keras", 0, "one", 1, None)]
    for processes in harness.str_list(args.processes):
        runs += [("pss", w, processes, s, None) for w in args.workers for s in spes]
        runs += [("asgd", w, processes, 1, t) for w in args.workers for t in trees]
    runs = [c for c in runs if c[0] in modes]
    raw, failures = [], []
    t0 = time.time()
    # Each round visits every configuration; odd rounds backwards.
    for rnd, (mode, w, processes, spe, tree) in metrics.alternating(runs, args.rounds):
        try:
            rows = _run_child(args, mode, w, processes, spe, tree)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            # A failed child (e.g. a server that did not come up) loses only its own run.
            run = f"{mode} x{w} {processes}"
            print(f"FAILED {run} in round {rnd}: {str(e)[-500:]}", file=sys.stderr, flush=True)
            failures.append(f"{run} round {rnd}")
            continue
        for r in rows:
            r["round"] = rnd
            print(json.dumps(r), flush=True)
        raw += rows
    rows = summarize(raw, args.batch_size)
    os.makedirs(args.out, exist_ok=True)
    harness.write_csv(os.path.join(args.out, "raw.csv"), raw)
    harness.write_csv(os.path.join(args.out, "summary.csv"), rows)
    lines = markdown(rows, args)
    if failures:
        lines += ["", "Failed runs (not in the medians): " + ", ".join(failures)]
    if len(trees) > 1:
        lines += ["", *tree_ratios(raw, [t[0] for t in trees])]
    harness.write_lines(os.path.join(args.out, "summary.md"), lines)
    print("\n".join(lines) + "\n")
    print(f"bench took {time.time() - t0:.0f} s", flush=True)
    if not raw:
        print("bench: every run failed (above); nothing was measured.", file=sys.stderr)
        return 1
    return 0
