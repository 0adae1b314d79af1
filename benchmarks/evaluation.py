"""Evaluation on the workers against evaluation on the chief, side by side.

Per worker count, one `LocalCluster` and a seeded digits convnet whose forward pass costs
`--device-ms` of emulated device time per batch wherever it runs; `model.evaluate` on
`--examples` images with `evaluation="chief"` and `"workers"` in alternating rounds. Writes
`evaluation.csv` (a row per timed call) and `evaluation.md` (each mode's median seconds, the
speed-up, the largest difference between the modes' metrics). Method: docs/benchmarks.md.

    python -m benchmarks.run evaluation --workers 1,2 --device-ms 20 --examples 200 --rounds 1
"""

import itertools
import os
import time

from benchmarks import harness, metrics

OUT = "results/evaluation"  # the default --out

MODES = ("chief", "workers")


def device_time_model(step_ms):
    """The digits convnet behind a layer that sleeps `step_ms` per batch."""
    import keras
    import tensorflow as tf

    import tf_asgd

    micros = int(round(step_ms * 1000))

    class DeviceTime(keras.layers.Layer):
        def call(self, x):
            # One `get_next` (`get_single_element` would ask twice, and the
            # sleep op sleeps before each ask: twice the time).
            ds = tf.data.Dataset.from_tensors(x).apply(tf_asgd.data.sleep_transformation(micros))
            return iter(ds).get_next()

        def compute_output_spec(self, x):
            return keras.KerasTensor(x.shape, x.dtype)

    inputs = keras.Input((8, 8, 1))
    return keras.Model(inputs, tf_asgd.models.digits_convnet()(DeviceTime()(inputs)))


def _evaluate(strategy, model, mode, data, args):
    """`model.evaluate` on `data` with `strategy.evaluation = mode`: the metrics by name."""
    strategy.evaluation = mode
    x, y = data
    return model.evaluate(x, y, batch_size=args.batch_size, verbose=0, return_dict=True)


def run_workers(workers, data, args):
    """Rows of the timed calls on a cluster of `workers` workers, for each
    `--device-ms` (one seeded model each)."""
    import keras

    import tf_asgd

    rows = []
    with harness.local_cluster(workers) as cluster:
        strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=10)
        for step_ms in args.device_ms:
            keras.utils.set_random_seed(args.seed)
            with strategy.scope():
                model = harness.compile_classifier(
                    device_time_model(step_ms), keras.optimizers.SGD(0.05), metrics=["accuracy"]
                )
            # Each path traced once, untimed; the modes' metrics compared.
            chief, on_workers = (_evaluate(strategy, model, m, data, args) for m in MODES)
            diff = max(abs(chief[k] - on_workers[k]) for k in chief)
            for k, mode in metrics.alternating(MODES, args.rounds):
                t0 = time.perf_counter()
                out = _evaluate(strategy, model, mode, data, args)
                seconds = time.perf_counter() - t0
                row = dict(
                    workers=workers,
                    step_ms=step_ms,
                    mode=mode,
                    round=k,
                    seconds=seconds,
                    batches=-(-len(data[0]) // args.batch_size),
                    loss=out["loss"],
                    accuracy=out["accuracy"],
                    max_metric_diff=diff,
                )
                print(row, flush=True)
                rows.append(row)
    return rows


def _table(rows, args):
    """The Markdown table: per device time and worker count, each mode's median seconds
    (and per batch), the speed-up and the largest difference between the modes' metrics."""
    batches = rows[0]["batches"]
    header = ["step ms", "workers", "chief s", "workers s", "chief ms/batch"]
    header += ["workers ms/batch", "speed-up", "max metric diff"]
    cells = []
    for step_ms, workers in itertools.product(args.device_ms, args.workers):
        mine = [r for r in rows if r["workers"] == workers and r["step_ms"] == step_ms]
        chief, on_workers = (metrics.median_of(mine, "seconds", mode=m) for m in MODES)
        cells.append(
            [f"{step_ms:g}", workers, f"{chief:.2f}", f"{on_workers:.2f}"]
            + [f"{1000 * s / batches:.1f}" for s in (chief, on_workers)]
            + [f"{chief / on_workers:.2f}", f"{mine[0]['max_metric_diff']:.1e}"]
        )
    return harness.markdown_table(header, cells)


def main(argv=None):
    p = harness.parser(__doc__, out=OUT, workers=[1, 2, 4], device_ms=[0.0, 20.0], seeds=[0])
    p.add_argument("--examples", type=int, default=1797)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    args.seed = harness.single(p, args, "seeds")
    import numpy as np

    import tf_asgd

    (x, y), (xt, yt) = tf_asgd.data.load_digits()
    x, y = np.concatenate([x, xt]), np.concatenate([y, yt])
    reps = -(-args.examples // len(x))
    data = (np.tile(x, (reps, 1, 1, 1))[: args.examples], np.tile(y, reps)[: args.examples])
    rows = [row for workers in args.workers for row in run_workers(workers, data, args)]
    harness.write_csv(os.path.join(args.out, "evaluation.csv"), rows)
    batches = rows[0]["batches"]
    lines = [
        "# Evaluation on the workers vs on the chief",
        "",
        f"`python -m benchmarks.run evaluation --workers {','.join(map(str, args.workers))} "
        f"--device-ms {','.join(f'{v:g}' for v in args.device_ms)} --examples {args.examples} "
        f"--batch-size {args.batch_size} --rounds {args.rounds}`: {batches} batches of the "
        "digits convnet, each costing `step ms` of emulated device time in the model's forward "
        "pass, on whichever task runs it (the chief in `chief` mode, a worker in `workers` "
        f"mode). Median of {args.rounds} timed `evaluate` calls per mode, alternating; "
        "speed-up = chief s / workers s. `max metric diff`: the largest difference between "
        "the two modes' loss and accuracy.",
        "",
    ] + _table(rows, args)
    harness.write_lines(os.path.join(args.out, "evaluation.md"), lines)
    print("\n".join(lines))
