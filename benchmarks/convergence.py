"""Convergence against plain Keras: held-out accuracy and loss against samples seen.

Every run trains an unmodified Keras model with an unmodified optimizer on the digits,
side by side with plain Keras `fit` given the same samples and seed, for each model,
optimizer, worker count, `n_sync`, setup (a strategy configuration: `default`, `average`,
`capped`, `sqrt`, `dynsgd`, `none`, `diloco`, `delayed_nesterov`, `reset`, `gem`) and
seed. Setups and the divergence rule: docs/benchmarks.md (How each suite measures).

Writes to `--out`: `curves.csv` (every epoch of every run), `summary.csv` (one row a run),
`summary.md` (min/max over seeds) and `curves_<model>_<optimizer>.png`.

Example (a few minutes):
    python -m benchmarks.run convergence --models mlp --optimizers sgd --workers 4 \
        --n-sync 10 --seeds 0,1
"""

import collections
import os
import time

import numpy as np

from benchmarks import harness, metrics

OUT = "results/convergence"  # the default --out

SETUPS = (
    "default",
    "average",
    "capped",
    "sqrt",
    "dynsgd",
    "none",
    "diloco",
    "delayed_nesterov",
    "reset",
    "gem",
)


def make_model(name, input_shape):
    """The digits MLP (Flatten, Dense 64 relu, Dense 10) or the small convnet."""
    import keras

    import tf_asgd

    if name == "mlp":
        return keras.Sequential(
            [
                keras.Input(input_shape),
                keras.layers.Flatten(),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
    if name == "convnet":
        return tf_asgd.models.digits_convnet()
    raise ValueError(f"Unknown model {name!r}; expected mlp or convnet.")


def make_optimizer(name, gem=False):
    """`SGD(0.05, momentum=0.9)` or `Adam(1e-3)`; with `gem`, SGD wrapped in GEM."""
    import keras

    import tf_asgd

    if name == "sgd":
        opt = keras.optimizers.SGD(0.05, momentum=0.9)
        return tf_asgd.optimizers.GEM(opt, kappa=1.0) if gem else opt
    if name == "adam":
        return keras.optimizers.Adam(1e-3)
    raise ValueError(f"Unknown optimizer {name!r}; expected sgd or adam.")


def strategy_kwargs(setup, workers):
    """The strategy arguments of a setup, beyond `n_sync`."""
    from tf_asgd.rules import outer_optimizers

    return {
        "default": {},
        "gem": {},
        "average": dict(outer_optimizer=outer_optimizers.OuterSGD(1.0 / workers)),
        "capped": dict(outer_optimizer=harness.capped_outer_optimizer(workers)),
        "sqrt": dict(
            outer_optimizer=outer_optimizers.OuterSGD(harness.sqrt_outer_learning_rate(workers))
        ),
        "reset": dict(worker_state="reset"),
        "dynsgd": dict(staleness="dynsgd", outer_optimizer=outer_optimizers.OuterSGD()),
        "none": dict(staleness="none", outer_optimizer=outer_optimizers.OuterSGD()),
        "diloco": dict(
            outer_optimizer=outer_optimizers.OuterSGD(0.7 / workers, 0.9, nesterov=True)
        ),
        "delayed_nesterov": dict(outer_optimizer=outer_optimizers.DelayedNesterov(0.7, 0.9)),
    }[setup]


def schedule(n_sync, workers, args, steps_per_pass):
    """`(steps_per_epoch, epochs)` of a run (plain Keras gets the same)."""
    if n_sync <= steps_per_pass:
        return steps_per_pass, args.epochs
    return workers * n_sync, max(args.epochs, args.min_windows)


def train(
    data, model_name, opt_name, seed, steps_per_epoch, epochs, args, strategy=None, gem=False
):
    """One run; returns per-epoch rows (samples, val_loss, val_accuracy)."""
    import keras

    (x, y), (xt, yt) = data
    keras.utils.set_random_seed(seed)
    if strategy is None:
        model = make_model(model_name, x.shape[1:])
        model = harness.compile_classifier(model, make_optimizer(opt_name), ["accuracy"])
    else:
        with strategy.scope():
            model = make_model(model_name, x.shape[1:])
            model = harness.compile_classifier(model, make_optimizer(opt_name, gem), ["accuracy"])
    # Plain Keras: one pass of 45 steps per epoch, or `steps_per_epoch` drawn
    # from the data repeated (Keras then reshuffles per pass, as the workers do).
    import tensorflow as tf

    if steps_per_epoch == args.steps_per_pass and strategy is None:
        history = model.fit(
            x, y, batch_size=args.batch_size, epochs=epochs, validation_data=(xt, yt), verbose=0
        )
    elif strategy is None:
        ds = (
            tf.data.Dataset.from_tensor_slices((x, y))
            .shuffle(len(x), seed=seed)
            .batch(args.batch_size)
            .repeat()
        )
        history = model.fit(
            ds, steps_per_epoch=steps_per_epoch, epochs=epochs, validation_data=(xt, yt), verbose=0
        )
    else:
        history = model.fit(
            x,
            y,
            batch_size=args.batch_size,
            epochs=epochs,
            steps_per_epoch=None if steps_per_epoch == args.steps_per_pass else steps_per_epoch,
            validation_data=(xt, yt),
            verbose=0,
        )
    h = history.history
    return [
        dict(
            epoch=e + 1,
            samples=(e + 1) * steps_per_epoch * args.batch_size,
            val_loss=float(h["val_loss"][e]),
            val_accuracy=float(h["val_accuracy"][e]),
        )
        for e in range(epochs)
    ]


def summarize(rows, plain):
    """One summary row of a run against its plain-Keras twin (same seed, same samples)."""
    first = rows[0]["val_loss"]
    final, plain_final = rows[-1]["val_accuracy"], plain[-1]["val_accuracy"]
    target = plain_final - 0.01
    return dict(
        final_accuracy=final,
        plain_accuracy=plain_final,
        gap_points=100 * (plain_final - final),
        diverged=int(
            any(r["val_loss"] > 2 * first or not np.isfinite(r["val_loss"]) for r in rows)
        ),
        samples_ratio=metrics.first_reaching(rows, target, "samples", "val_accuracy")
        / metrics.first_reaching(plain, target, "samples", "val_accuracy"),
    )


def write_summary(out, summary):
    """`summary.md`: a row per (model, optimizer, n_sync, workers, setup), min/max over seeds."""
    groups = collections.defaultdict(list)
    for r in summary:
        if r["setup"] != "plain":
            groups[(r["model"], r["optimizer"], r["n_sync"], r["workers"], r["setup"])].append(r)
    rows = []
    for key, runs in sorted(groups.items()):
        acc = [r["final_accuracy"] for r in runs]
        plain = [r["plain_accuracy"] for r in runs]
        gap = [r["gap_points"] for r in runs]
        ratio = [r["samples_ratio"] for r in runs]
        rows.append(
            [
                *key,
                len(runs),
                f"{min(plain):.3f}-{max(plain):.3f}",
                f"{min(acc):.3f}-{max(acc):.3f}",
                f"{max(gap):.1f}",
                sum(r["diverged"] for r in runs),
                f"{max(ratio):.2f}",
            ]
        )
    header = [
        "model",
        "optimizer",
        "n_sync",
        "workers",
        "setup",
        "seeds",
        "plain acc",
        "acc",
        "worst gap (points)",
        "diverged",
        "worst samples ratio",
    ]
    harness.write_lines(os.path.join(out, "summary.md"), harness.markdown_table(header, rows))


def plot(out, curves):
    """`curves_<model>_<optimizer>_n<n_sync>.png`: held-out accuracy and loss
    against samples seen, a panel per worker count; each setup (and plain
    Keras) as its mean over seeds with a min-max band."""
    runs = collections.defaultdict(
        list
    )  # (model, opt, n_sync, workers, setup) -> rows of all seeds
    for r in curves:
        runs[
            (
                r["model"],
                r["optimizer"],
                r["n_sync"],
                r["workers"],
                r["setup"],
                r["steps_per_epoch"],
            )
        ].append(r)
    figures = collections.defaultdict(list)
    for (model, opt, n_sync, workers, setup, spe), rows in runs.items():
        if setup != "plain":
            figures[(model, opt, n_sync)].append((workers, setup, spe, rows))
    for (model, opt, n_sync), members in sorted(figures.items()):
        panels = []
        for metric, ylabel in (
            ("val_accuracy", "held-out accuracy"),
            ("val_loss", "held-out loss"),
        ):
            for workers in sorted({w for w, *_ in members}):
                series = []
                for w, setup, spe, rows in sorted(members, key=lambda m: m[1]):
                    if w != workers:
                        continue
                    if not series:  # plain Keras with the same samples
                        plain = runs.get((model, opt, 0, 1, "plain", spe), [])
                        series.append(_band("plain Keras", plain, metric))
                    series.append(_band(setup, rows, metric))
                panels.append(
                    dict(
                        title=f"{model}, {opt}, n_sync {n_sync}, {workers} workers",
                        xlabel="samples seen",
                        ylabel=ylabel,
                        series=series,
                        logy=metric == "val_loss",
                    )
                )
        harness.plot_panels(
            os.path.join(out, f"curves_{model}_{opt}_n{n_sync}.png"), panels, ncols=len(panels) // 2
        )


def _band(label, rows, metric):
    """`(label, samples, mean, min, max)` over the seeds of one setup."""
    by_epoch = collections.defaultdict(list)
    for r in rows:
        by_epoch[r["samples"]].append(r[metric])
    xs = sorted(by_epoch)
    values = [np.asarray(by_epoch[x], np.float64) for x in xs]
    return (
        label,
        xs,
        [v.mean() for v in values],
        [v.min() for v in values],
        [v.max() for v in values],
    )


def merge(dirs, out):
    """Combines the CSVs of several runs of this suite; rewrites the table and plots."""
    numeric = ("n_sync", "workers", "seed", "steps_per_epoch", "epoch", "samples", "diverged")
    tables = {"curves.csv": [], "summary.csv": []}
    for d in dirs:
        for name, rows in tables.items():
            for row in harness.read_csv(os.path.join(d, name)):
                rows.append(
                    {
                        k: (
                            int(float(v))
                            if k in numeric
                            else v
                            if k in ("setup", "model", "optimizer")
                            else float(v)
                        )
                        for k, v in row.items()
                    }
                )
    os.makedirs(out, exist_ok=True)
    curves = _unique(
        tables["curves.csv"],
        ("setup", "model", "optimizer", "n_sync", "workers", "seed", "steps_per_epoch", "epoch"),
    )
    summary = tables["summary.csv"]
    harness.write_csv(os.path.join(out, "curves.csv"), curves)
    harness.write_csv(os.path.join(out, "summary.csv"), summary)
    write_summary(out, summary)
    plot(out, curves)
    print(f"merged {len(dirs)} directories into {out}: {len(summary)} runs")
    return 0


def _unique(rows, key):
    """`rows` without repeats of `key` (plain-Keras twins appear once per directory)."""
    seen, out = set(), []
    for r in rows:
        k = tuple(r[f] for f in key)
        if k not in seen:
            seen.add(k)
            out.append(r)
    return out


def main(argv=None):
    p = harness.parser(
        __doc__,
        out=OUT,
        workers=[2, 4, 8],
        n_sync=[10, 100],
        seeds=[0, 1, 2, 3, 4],
    )
    p.add_argument("--models", type=harness.str_list, default=["mlp", "convnet"])
    p.add_argument("--optimizers", type=harness.str_list, default=["sgd", "adam"])
    p.add_argument("--setups", type=harness.str_list, default=["default", "dynsgd"])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--min-windows", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument(
        "--merge",
        type=harness.str_list,
        default=None,
        help="instead of training: combine the curves.csv and summary.csv of these "
        "output directories (runs split over several invocations) into --out",
    )
    args = p.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out)
    for s in args.setups:
        if s not in SETUPS:
            p.error(f"unknown setup {s!r}; expected some of {', '.join(SETUPS)}")
    os.makedirs(args.out, exist_ok=True)

    import tf_asgd

    data = tf_asgd.data.load_digits()
    args.steps_per_pass = int(np.ceil(len(data[0][0]) / args.batch_size))
    curves, summary, plain_cache = [], [], {}
    t0 = time.time()

    def plain_run(model, opt, seed, spe, epochs):
        key = (model, opt, seed, spe, epochs)
        if key not in plain_cache:
            plain_cache[key] = train(data, model, opt, seed, spe, epochs, args)
            curves.extend(
                dict(
                    setup="plain",
                    model=model,
                    optimizer=opt,
                    n_sync=0,
                    workers=1,
                    seed=seed,
                    steps_per_epoch=spe,
                    **r,
                )
                for r in plain_cache[key]
            )
        return plain_cache[key]

    for workers in args.workers:
        with harness.local_cluster(workers) as cluster:
            for model in args.models:
                for opt in args.optimizers:
                    for n_sync in args.n_sync:
                        spe, epochs = schedule(n_sync, workers, args, args.steps_per_pass)
                        for setup in args.setups:
                            if setup == "gem" and opt != "sgd":
                                continue
                            for seed in args.seeds:
                                plain = plain_run(model, opt, seed, spe, epochs)
                                strategy = tf_asgd.AsyncParameterServerStrategy(
                                    cluster.resolver,
                                    n_sync=n_sync,
                                    **strategy_kwargs(setup, workers),
                                )
                                rows = train(
                                    data,
                                    model,
                                    opt,
                                    seed,
                                    spe,
                                    epochs,
                                    args,
                                    strategy=strategy,
                                    gem=setup == "gem",
                                )
                                tags = dict(
                                    setup=setup,
                                    model=model,
                                    optimizer=opt,
                                    n_sync=n_sync,
                                    workers=workers,
                                    seed=seed,
                                    steps_per_epoch=spe,
                                )
                                curves.extend(dict(**tags, **r) for r in rows)
                                summary.append(dict(**tags, **summarize(rows, plain)))
                                s = summary[-1]
                                print(
                                    f"[{time.time() - t0:6.0f}s] {model} {opt} n_sync {n_sync} "
                                    f"{workers}w {setup} seed {seed}: "
                                    f"acc {s['final_accuracy']:.3f} "
                                    f"(plain {s['plain_accuracy']:.3f}) diverged {s['diverged']} "
                                    f"samples x{s['samples_ratio']:.2f}",
                                    flush=True,
                                )
                                harness.write_csv(os.path.join(args.out, "curves.csv"), curves)
                                harness.write_csv(os.path.join(args.out, "summary.csv"), summary)
                                write_summary(args.out, summary)
    plot(args.out, curves)
    print(
        f"wrote {args.out}/summary.md, summary.csv, curves.csv and plots "
        f"in {time.time() - t0:.0f} s"
    )
