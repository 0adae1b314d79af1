"""Throughput, side by side in one run: plain Keras, stock PS training, tf_asgd.

On one machine, one model and one synthetic data set, it measures in rounds
(every configuration once per round, the rounds alternating so that drift in
the machine's load hits all of them alike):

1. `keras`: plain single-process Keras 3 `model.fit` (this machine's
   compute limit);
2. `pss`: stock `tf.distribute.experimental.ParameterServerStrategy` with
   `tf_keras` `model.fit` (default `steps_per_execution=1`; every step reads
   all variables from the PS and writes the update back);
3. `asgd`: `tf_asgd.AsyncParameterServerStrategy` with Keras 3 `model.fit`
   at each `--n-sync`.

Every PS configuration runs on a `LocalCluster(shared_process=True)` with
one PS. Each configuration runs in a fresh child process. For each it
reports the median over rounds of samples/s, the ratio to (1) and to (2) at
the same worker count (ratios of medians measured in the same run), and
bytes pulled from / pushed to the PS per sample (tf_asgd: the strategy's
counters; stock PS: the model's size per step, once each way, which is
what its `fit` moves).

Writes `raw.csv` (every measurement), `summary.csv` and `summary.md` to
`--out`.

    python tools/bench.py                       # the full default run
    python tools/bench.py --workers 1 --n-sync 1,10 --rounds 1 --seconds 0.5
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import _common

RESULT = "BENCH_RESULT "


# ---- child side ------------------------------------------------------------


def _synthetic(shape, batch_size, num_classes=10, batches=8, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.random((batches * batch_size,) + tuple(shape), dtype=np.float32)
    y = rng.integers(0, num_classes, batches * batch_size).astype("int64")
    return x, y


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


def _emit(**row):
    print(RESULT + json.dumps(row), flush=True)


def _timed_fit(model, data, steps, **kwargs):
    t = time.perf_counter()
    model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0, **kwargs)
    return time.perf_counter() - t


def _plan_steps(rate, seconds, unit, min_units=2):
    """Steps for about `seconds` at `rate` steps/s, a multiple of `unit`."""
    units = max(min_units, int(round(rate * seconds / unit)))
    return units * unit


def child_keras(args):
    import keras
    import tensorflow as tf

    model = _keras3_model(args.model)
    x, y = _synthetic(model.input_shape[1:], args.batch_size)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch_size).repeat()
    _common.compile_classifier(model, keras.optimizers.SGD(0.05, momentum=0.9))
    dt = _timed_fit(model, ds, 20)
    dt = _timed_fit(model, ds, 50)
    for _ in range(args.inner):
        steps = _plan_steps(50 / dt, args.seconds, 10)
        dt_run = _timed_fit(model, ds, steps)
        _emit(mode="keras", workers=0, n_sync=0, steps=steps, seconds=dt_run,
              samples_per_s=steps * args.batch_size / dt_run, bytes_pulled_per_sample=0.0,
              bytes_pushed_per_sample=0.0)


def child_pss(args):
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    import tensorflow as tf
    import tf_keras

    with _common.local_cluster(args.workers) as cluster:
        strategy = tf.distribute.experimental.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            model, nparams = _tf_keras_model(args.model)
            _common.compile_classifier(model, tf_keras.optimizers.SGD(0.05, momentum=0.9),
                                       keras_module=tf_keras)
        x, y = _synthetic(model.input_shape[1:], args.batch_size)
        batch_size = args.batch_size

        def dataset_fn(input_context):
            return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size).repeat()

        data = tf_keras.utils.experimental.DatasetCreator(dataset_fn)
        dt = _timed_fit(model, data, 20)
        dt = _timed_fit(model, data, 40)
        param_bytes = 4.0 * nparams
        for _ in range(args.inner):
            steps = _plan_steps(40 / dt, args.seconds, 10)
            dt_run = _timed_fit(model, data, steps)
            _emit(mode="pss", workers=args.workers, n_sync=1, steps=steps, seconds=dt_run,
                  samples_per_s=steps * args.batch_size / dt_run,
                  bytes_pulled_per_sample=param_bytes / args.batch_size,
                  bytes_pushed_per_sample=param_bytes / args.batch_size)


def child_asgd(args):
    import keras
    import tensorflow as tf

    import tf_asgd

    n_syncs = [int(n) for n in args.n_sync.split(",")]
    with _common.local_cluster(args.workers) as cluster:
        strategy = tf_asgd.AsyncParameterServerStrategy(
            cluster.resolver, n_sync=n_syncs[0], staleness=args.staleness)
        with strategy.scope():
            model = _keras3_model(args.model)
            _common.compile_classifier(model, keras.optimizers.SGD(0.05, momentum=0.9))
        x, y = _synthetic(model.input_shape[1:], args.batch_size)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch_size)
        rate = {}
        for n in n_syncs:  # warm-up (traces once) and a first rate estimate
            strategy.n_sync = n
            unit = n * args.workers
            _timed_fit(model, ds, unit)
            rate[n] = unit / _timed_fit(model, ds, unit)
        for _ in range(args.inner):
            for n in n_syncs:  # alternate the window sizes
                strategy.n_sync = n
                steps = _plan_steps(rate[n], args.seconds, n * args.workers)
                before = strategy.model_stats(model)
                dt_run = _timed_fit(model, ds, steps)
                after = strategy.model_stats(model)
                samples = steps * args.batch_size
                _emit(mode="asgd", workers=args.workers, n_sync=n, steps=steps, seconds=dt_run,
                      samples_per_s=samples / dt_run,
                      bytes_pulled_per_sample=(after.bytes_pulled - before.bytes_pulled) / samples,
                      bytes_pushed_per_sample=(after.bytes_pushed - before.bytes_pushed) / samples,
                      mean_staleness=after.mean_staleness)


# ---- parent side -----------------------------------------------------------


def _run_child(args, mode, workers):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--workers", str(workers),
           "--model", args.model, "--batch-size", str(args.batch_size), "--seconds", str(args.seconds),
           "--n-sync", args.n_sync, "--inner", str(args.inner), "--staleness", args.staleness]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.child_timeout)
    rows = [json.loads(line[len(RESULT):]) for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not rows:
        raise RuntimeError(f"bench child {mode} x{workers} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return rows


def summarize(raw, batch_size):
    """Medians per configuration and the ratios between them."""
    groups = {}
    for r in raw:
        groups.setdefault((r["mode"], r["workers"], r["n_sync"]), []).append(r)
    med = {k: statistics.median(r["samples_per_s"] for r in v) for k, v in groups.items()}
    keras_sps = next((v for (m, _, _), v in med.items() if m == "keras"), None)
    pss = {w: v for (m, w, _), v in med.items() if m == "pss"}
    rows = []
    order = {"keras": 0, "pss": 1, "asgd": 2}
    for key in sorted(groups, key=lambda k: (order[k[0]], k[1], k[2])):
        mode, workers, n_sync = key
        v = groups[key]
        sps = med[key]
        ref_pss = pss.get(workers) or (statistics.median(pss.values()) if pss else None)
        rows.append(dict(
            mode=mode, workers=workers, n_sync=n_sync, runs=len(v),
            samples_per_s=sps, steps_per_s=sps / batch_size,
            min_samples_per_s=min(r["samples_per_s"] for r in v),
            max_samples_per_s=max(r["samples_per_s"] for r in v),
            ratio_to_keras=sps / keras_sps if keras_sps else "",
            ratio_to_pss=sps / ref_pss if ref_pss else "",
            bytes_pulled_per_sample=statistics.median(r["bytes_pulled_per_sample"] for r in v),
            bytes_pushed_per_sample=statistics.median(r["bytes_pushed_per_sample"] for r in v),
            mean_staleness=statistics.median(r.get("mean_staleness", 0.0) for r in v),
        ))
    return rows


def markdown(rows, args):
    def f(v, d=2):
        return f"{v:.{d}f}" if isinstance(v, float) else str(v)

    header = ["mode", "workers", "n_sync", "samples/s", "steps/s", "x keras", "x pss",
              "pulled B/sample", "pushed B/sample", "mean staleness"]
    cells = [
        [r["mode"], r["workers"] or "-", r["n_sync"] or "-", f"{r['samples_per_s']:.0f}",
         f"{r['steps_per_s']:.1f}", f(r["ratio_to_keras"]), f(r["ratio_to_pss"]),
         f"{r['bytes_pulled_per_sample']:.0f}", f"{r['bytes_pushed_per_sample']:.0f}",
         f(r["mean_staleness"])]
        for r in rows
    ]
    out = [
        f"Model `{args.model}`, synthetic batches of {args.batch_size}, one PS, "
        f"`LocalCluster(shared_process=True)`; medians of {args.rounds} round(s) x {args.inner} "
        f"run(s) of about {args.seconds} s each; {os.cpu_count()} CPU cores. Ratios to `pss` use "
        "the stock run with the same worker count.",
        "",
        *_common.markdown_table(header, cells),
    ]
    return "\n".join(out) + "\n"


def main(argv=None):
    p = _common.parser(__doc__)
    p.add_argument("--out", default="results/bench")
    p.add_argument("--model", default="gem_mnist_convnet")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", default="1,2,4")
    p.add_argument("--pss-workers", default=None, help="worker counts for stock PS (default: --workers)")
    p.add_argument("--n-sync", default="1,10,100")
    p.add_argument("--staleness", default="dynsgd")
    p.add_argument("--modes", default="keras,pss,asgd")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--inner", type=int, default=1, help="measurements per configuration per round")
    p.add_argument("--seconds", type=float, default=3.0, help="target length of one measurement")
    p.add_argument("--child-timeout", type=float, default=600)
    p.add_argument("--child", choices=("keras", "pss", "asgd"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.workers = int(args.workers)
        {"keras": child_keras, "pss": child_pss, "asgd": child_asgd}[args.child](args)
        return 0

    from tf_asgd import plots

    workers = [int(w) for w in args.workers.split(",")]
    pss_workers = [int(w) for w in (args.pss_workers or args.workers).split(",")]
    modes = args.modes.split(",")
    plan = ([("keras", 0)] if "keras" in modes else []) + [("pss", w) for w in pss_workers if "pss" in modes] + [
        ("asgd", w) for w in workers if "asgd" in modes]
    raw, failures = [], []
    t0 = time.time()
    for rnd in range(args.rounds):
        # Alternate: each round visits every configuration; odd rounds backwards.
        for mode, w in plan if rnd % 2 == 0 else plan[::-1]:
            try:
                rows = _run_child(args, mode, w)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                # One failed child (e.g. a server that did not come up) must not
                # lose the other measurements: report it and go on.
                print(f"FAILED {mode} x{w} in round {rnd}: {str(e)[-500:]}", file=sys.stderr, flush=True)
                failures.append(dict(mode=mode, workers=w, round=rnd))
                continue
            for r in rows:
                r["round"] = rnd
                print(json.dumps(r), flush=True)
            raw += rows
    rows = summarize(raw, args.batch_size)
    os.makedirs(args.out, exist_ok=True)
    plots.write_csv(os.path.join(args.out, "raw.csv"), raw)
    plots.write_csv(os.path.join(args.out, "summary.csv"), rows)
    text = markdown(rows, args)
    if failures:
        text += "\nFailed runs (not in the medians): " + ", ".join(
            f"{f['mode']} x{f['workers']} round {f['round']}" for f in failures) + "\n"
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(text)
    print(text)
    print(f"bench took {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
