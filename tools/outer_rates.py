"""Held-out accuracy on MNIST-1D under constant outer rates, against the stability limit.

Each run trains the MNIST-1D paper's CNN on N workers at `n_sync` with the user's
optimizer unchanged for `--steps` steps, under the default outer rate (`default`) or a
constant per-push rate (`OuterSGD(rate)`; `limit` is `update_rules.stability_limit(N)`);
`--workers 0` runs plain Keras, the reference. Reports final and best held-out accuracy
and the largest fall below the running best (the collapse check). Curves are against
samples, not wall time. Method: docs/architecture.md (Tools).

    python tools/outer_rates.py --workers 8 --rates default,0.25,0.125 --optimizers sgd,adam
"""

import json
import os
import time

import numpy as np

import _common

OPTIMIZERS = {"sgd": "SGD(0.05, momentum=0.9)", "adam": "Adam(1e-2)"}


def _optimizer(name):
    import keras

    if name == "sgd":
        return keras.optimizers.SGD(0.05, momentum=0.9)
    return keras.optimizers.Adam(1e-2)


def _fit(model, steps, eval_every, plain=False):
    """`model.fit` on MNIST-1D: the held-out curve and the wall time. Plain
    Keras reads the arrays shuffled and repeated (its `fit` on arrays stops
    at one pass an epoch), batch 100, as the strategy's workers do."""
    import tensorflow as tf

    import tf_asgd

    (x, y), (x_test, y_test) = tf_asgd.data.load_mnist1d()
    data = dict(x=x, y=y, batch_size=100)
    if plain:
        data = dict(
            x=tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x)).batch(100).repeat()
        )
    start = time.time()
    history = model.fit(
        **data,
        steps_per_epoch=eval_every,
        epochs=steps // eval_every,
        validation_data=(x_test, y_test),
        verbose=0,
    )
    return [float(a) for a in history.history["val_accuracy"]], time.time() - start


def run(workers, n_sync, rate, optimizer, seed, steps, eval_every=300):
    """One run's held-out curve: a dict of the run's settings and results.
    `workers=0` is plain Keras (no strategy) for `steps / 2` steps."""
    import keras

    import tf_asgd

    keras.utils.set_random_seed(seed)
    if workers == 0:
        model = _common.compile_classifier(
            tf_asgd.models.mnist1d_cnn(), _optimizer(optimizer), metrics=["accuracy"]
        )
        curve, wall = _fit(model, steps // 2, eval_every, plain=True)
        return dict(
            workers=0,
            n_sync=0,
            rate="plain Keras",
            rate_value=1.0,
            limit=1.0,
            optimizer=optimizer,
            seed=seed,
            final=round(curve[-1], 4),
            best=round(max(curve), 4),
            max_drop=0.0,
            wall_s=round(wall, 1),
            curve=[round(a, 3) for a in curve],
        )
    outer = {} if rate == "default" else {"outer_optimizer": tf_asgd.OuterSGD(float(rate))}
    with _common.local_cluster(workers) as cluster:
        strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=n_sync, **outer)
        with strategy.scope():
            model = _common.compile_classifier(
                tf_asgd.models.mnist1d_cnn(), _optimizer(optimizer), metrics=["accuracy"]
            )
        curve, wall = _fit(model, steps, eval_every)
    quarter = len(curve) // 4
    best = np.maximum.accumulate(curve)
    rate_value = (
        tf_asgd.rules.update_rules.default_outer_learning_rate(workers)
        if rate == "default"
        else float(rate)
    )
    return dict(
        workers=workers,
        n_sync=n_sync,
        rate=rate,
        rate_value=round(rate_value, 4),
        limit=round(tf_asgd.rules.update_rules.stability_limit(workers), 4),
        optimizer=optimizer,
        seed=seed,
        final=round(curve[-1], 4),
        best=round(max(curve), 4),
        max_drop=round(float(np.max(best[quarter:] - np.array(curve[quarter:]))), 4),
        wall_s=round(wall, 1),
        curve=[round(a, 3) for a in curve],
    )


def main(argv=None):
    p = _common.parser(__doc__)
    p.add_argument("--out", default="results/outer_rates")
    p.add_argument("--workers", type=_common.int_list, default=[8])
    p.add_argument("--n-sync", type=_common.int_list, default=[10])
    p.add_argument("--rates", type=_common.str_list, default=["default"])
    p.add_argument("--optimizers", type=_common.str_list, default=["sgd"])
    p.add_argument("--seeds", type=int, default=1, help="seeds 0 .. N-1")
    p.add_argument("--steps", type=int, default=6000)
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "runs.jsonl")
    for workers in args.workers:
        for n_sync in args.n_sync if workers else [0]:
            for optimizer in args.optimizers:
                for rate in args.rates if workers else ["plain"]:
                    for seed in range(args.seeds):
                        row = run(workers, n_sync, rate, optimizer, seed, args.steps)
                        with open(path, "a") as f:
                            f.write(json.dumps(row) + "\n")
                        print(
                            f"{workers} workers, n_sync {n_sync}, {OPTIMIZERS[optimizer]}, "
                            f"rate {row['rate_value']} ({row['rate_value'] / row['limit']:.2f} "
                            f"of the limit), seed {seed}: final {row['final']:.3f}, best "
                            f"{row['best']:.3f}, largest fall {100 * row['max_drop']:.1f} "
                            f"points",
                            flush=True,
                        )
    write_summary(path, os.path.join(args.out, "summary.md"))
    return 0


def write_summary(runs_path, out_path):
    """A Markdown table of every run in `runs_path` (JSON lines)."""
    with open(runs_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows.sort(
        key=lambda r: (r["workers"], r["n_sync"], r["optimizer"], -r["rate_value"], r["seed"])
    )
    table = _common.markdown_table(
        [
            "workers",
            "n_sync",
            "optimizer",
            "rate",
            "rate / limit",
            "seed",
            "final",
            "best",
            "largest fall (points)",
            "collapse",
        ],
        [
            [
                r["workers"],
                r["n_sync"],
                OPTIMIZERS[r["optimizer"]],
                r["rate"]
                if not r["workers"]
                else f"{r['rate_value']}{' (default)' if r['rate'] == 'default' else ''}",
                f"{r['rate_value'] / r['limit']:.2f}",
                r["seed"],
                f"{r['final']:.3f}",
                f"{r['best']:.3f}",
                f"{100 * r['max_drop']:.1f}",
                "yes" if r["max_drop"] > 0.05 else "no",
            ]
            for r in rows
        ],
    )
    _common.write_lines(out_path, table)


if __name__ == "__main__":
    raise SystemExit(main())
