"""Learning-rate callbacks at 2 workers against plain Keras, over seeds and outer rates.

Two recipes on digits (the 64-pixel MLP of tests/cluster/test_keras_surface.py, batch 32,
`n_sync` 10), each run by plain Keras and by the strategy on 2 workers from one seed:
`decay` (SGD(0.1, m 0.9), 12 epochs, 0.8x an epoch, ReduceLROnPlateau(min_lr=0) on
val_loss, validated every 2 epochs) and `to_zero` (SGD(0.05), 6 epochs at the rates 0.05,
0, 0.05, then 0.8x, until ReduceLROnPlateau(factor=0) sets 0 at the second validation).
`--rates`: `default` (the strategy's), a constant `OuterSGD(r)`, or `sync` (no cluster: plain
Keras on batches of 2 x 32, synchronous training of 2 workers at the user's rate). Writes
`runs.jsonl` (a row per recipe and seed) and `summary.md` to `--out`.

    python -m benchmarks.run schedule_cases --recipes decay,to_zero --rates default,0.6667,1.0 \\
        --seeds 0,1,2,3,4
"""

import contextlib
import json
import os

from benchmarks import harness

OUT = "results/schedule_cases"  # the default --out

RECIPES = ("decay", "to_zero")


def _fit(strategy, recipe, seed, data, batch_size=32):
    """Held-out accuracy of one run of `recipe` (plain Keras where `strategy` is None)."""
    import keras

    (x, y), (xt, yt) = data
    keras.utils.set_random_seed(seed)
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = keras.Sequential(
            [keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)]
        )
        optimizer = (
            keras.optimizers.SGD(0.1, momentum=0.9)
            if recipe == "decay"
            else keras.optimizers.SGD(0.05)
        )
        harness.compile_classifier(model, optimizer, metrics=["accuracy"])
    if recipe == "decay":
        epochs = 12
        callbacks = [
            keras.callbacks.LearningRateScheduler(lambda e, lr: lr * 0.8 if e else lr),
            keras.callbacks.ReduceLROnPlateau("val_loss", factor=0.5, patience=1, min_lr=0.0),
        ]
    else:
        epochs, schedule = 6, {0: 0.05, 1: 0.0, 2: 0.05}
        callbacks = [
            keras.callbacks.LearningRateScheduler(lambda e, lr: schedule.get(e, 0.8 * lr)),
            keras.callbacks.ReduceLROnPlateau(
                "val_loss", factor=0.0, patience=0, min_delta=1e9, min_lr=0.0
            ),
        ]
    model.fit(
        x,
        y,
        batch_size=batch_size,
        epochs=epochs,
        validation_data=(xt, yt),
        validation_freq=2,
        verbose=0,
        callbacks=callbacks,
    )
    return float(model.evaluate(xt, yt, verbose=0)[1])


def _strategy(cluster, rate):
    import tf_asgd

    outer = None if rate == "default" else tf_asgd.OuterSGD(float(rate))
    return tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=10, outer_optimizer=outer)


def main(argv=None):
    p = harness.parser(__doc__, out=OUT, seeds=[0, 1, 2, 3, 4])
    p.add_argument("--recipes", type=harness.str_list, default=list(RECIPES))
    p.add_argument("--rates", type=harness.str_list, default=["default"])
    args = p.parse_args(argv)
    for recipe in args.recipes:
        if recipe not in RECIPES:
            p.error(f"--recipes: {recipe!r} is not one of {', '.join(RECIPES)}")
    import tf_asgd

    (x, y), (xt, yt) = tf_asgd.data.load_digits()
    data = (x.reshape(len(x), -1), y), (xt.reshape(len(xt), -1), yt)
    os.makedirs(args.out, exist_ok=True)
    runs_path = os.path.join(args.out, "runs.jsonl")
    needs_cluster = any(rate != "sync" for rate in args.rates)
    with (
        harness.local_cluster(2) if needs_cluster else contextlib.nullcontext() as cluster,
        open(runs_path, "a") as runs,
    ):
        for recipe in args.recipes:
            for seed in args.seeds:
                row = {"recipe": recipe, "seed": seed, "plain": _fit(None, recipe, seed, data)}
                for rate in args.rates:
                    if rate == "sync":
                        row[rate] = _fit(None, recipe, seed, data, batch_size=64)
                    else:
                        row[rate] = _fit(_strategy(cluster, rate), recipe, seed, data)
                print(json.dumps(row), flush=True)
                runs.write(json.dumps(row) + "\n")
    write_summary(runs_path, os.path.join(args.out, "summary.md"))


def write_summary(runs_path, out_path):
    """Per recipe and outer rate: the gaps to plain Keras over seeds, in points."""
    with open(runs_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    cells = {}
    for row in rows:
        for rate, acc in row.items():
            if rate not in ("recipe", "seed", "plain"):
                gap = 100.0 * (acc - row["plain"])
                cells.setdefault((row["recipe"], rate), []).append(gap)
    table = harness.markdown_table(
        ["recipe", "outer rate", "seeds", "gap to plain Keras (points)", "worst", "within 3"],
        [
            [
                recipe,
                rate,
                len(gaps),
                " / ".join(f"{g:+.1f}" for g in gaps),
                f"{min(gaps):+.1f}",
                "yes" if min(gaps) >= -3.0 else "no",
            ]
            for (recipe, rate), gaps in sorted(cells.items())
        ],
    )
    harness.write_lines(out_path, table)
