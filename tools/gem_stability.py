r"""GEM's stability claim on a real local cluster (Hermans & Louppe 2018, MNIST).

At eta = 0.1, mu = 0.9, with many workers and n_sync = 1, the paper expects
plain Downpour to diverge or stall while GEM trains, and GEM to generalise at
least as well as its single-worker momentum-SGD proxy. This tool runs, on the
offline digits data and one local cluster:

- proxy: single-process Keras `fit`, SGD(eta, momentum=mu) (the target process);
- downpour: each worker SGD(eta, momentum=mu), pushes applied as they come;
- dynsgd: the same, pushes scaled by 1/(tau+1) on the PS;
- gem (kappa 1 and 2): GEM(SGD(eta, momentum=mu)), pushes applied as they come;

all for the same number of epochs (samples seen), and writes
`results/gem_stability/results.csv`, `results.md` and `curves.png`.

    python tools/gem_stability.py            # 8 workers, 20 epochs, a few minutes
    python tools/gem_stability.py --workers=4 --epochs=5 --out=/tmp/gem
"""

import csv
import os
import sys
import time

from absl import app, flags

flags.DEFINE_integer("workers", 8, "Worker tasks in the local cluster.")
flags.DEFINE_integer("epochs", 20, "Epochs (passes over the training split) for every method.")
flags.DEFINE_integer("batch_size", 64, "Per-worker batch size (the paper: 64).")
flags.DEFINE_float("eta", 0.1, "Learning rate of the proxy and of every worker.")
flags.DEFINE_float("mu", 0.9, "Momentum of the proxy and of every worker.")
flags.DEFINE_integer("n_sync", 1, "Local steps per window (the paper: 1).")
flags.DEFINE_list("methods", "proxy,downpour,dynsgd,gem_k1,gem_k2", "Methods to run.")
flags.DEFINE_integer("seed", 0, "Seed for weights and data order.")
flags.DEFINE_string("out", "results/gem_stability", "Output directory.")
FLAGS = flags.FLAGS


def _compile(model, optimizer):
    import keras

    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def run_method(method, cluster, data):
    """Trains one method; returns a result row and its per-epoch history."""
    import keras
    import numpy as np

    import tf_asgd

    (x, y), (xt, yt) = data
    keras.utils.set_random_seed(FLAGS.seed)
    sgd = lambda: keras.optimizers.SGD(FLAGS.eta, momentum=FLAGS.mu)  # noqa: E731
    started = time.time()
    row = {"method": method, "workers": 1 if method == "proxy" else FLAGS.workers,
           "n_sync": "" if method == "proxy" else FLAGS.n_sync, "epochs": FLAGS.epochs}
    if method == "proxy":
        model = _compile(tf_asgd.models.digits_convnet(), sgd())
        strategy = None
    else:
        rule = "dynsgd" if method == "dynsgd" else "none"
        strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=FLAGS.n_sync, staleness=rule)
        with strategy.scope():
            opt = sgd()
            if method.startswith("gem"):
                opt = tf_asgd.optimizers.GEM(opt, kappa=float(method.split("_k")[1]))
            model = _compile(tf_asgd.models.digits_convnet(), opt)
    history, status = {}, "trained"
    try:
        history = model.fit(x, y, batch_size=FLAGS.batch_size, epochs=FLAGS.epochs, verbose=0).history
    except FloatingPointError:
        status = "diverged (every update NaN/Inf)"
    loss, acc = model.evaluate(xt, yt, verbose=0)
    if not np.isfinite(loss):
        status = "diverged (NaN weights)"
    elif status == "trained" and acc < 0.5:
        status = "stalled"
    row.update(status=status, test_accuracy=round(float(acc), 4), test_loss=round(float(loss), 4),
               final_train_loss=round(float(history.get("loss", [np.nan])[-1]), 4),
               seconds=round(time.time() - started, 1))
    if strategy is not None:
        stats = strategy.model_stats(model)
        row.update(windows=stats.windows, mean_staleness=round(stats.mean_staleness, 2),
                   max_staleness=stats.max_staleness, dropped_nonfinite=stats.dropped_nonfinite)
        if "gem_pi_mean" in history:
            row["final_pi_mean"] = round(float(history["gem_pi_mean"][-1]), 3)
    return row, history


def write_results(rows, histories, out):
    os.makedirs(out, exist_ok=True)
    fields = sorted({k for r in rows for k in r}, key=lambda k: list(rows[0]).index(k) if k in rows[0] else 99)
    with open(os.path.join(out, "results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(f"Command: `python tools/gem_stability.py {' '.join(sys.argv[1:])}`\n\n")
        f.write("| " + " | ".join(fields) + " |\n|" + "---|" * len(fields) + "\n")
        for r in rows:
            f.write("| " + " | ".join(str(r.get(k, "")) for k in fields) + " |\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for method, h in histories.items():
        if h.get("loss"):
            axes[0].plot(range(1, len(h["loss"]) + 1), h["loss"], label=method)
            axes[1].plot(range(1, len(h["accuracy"]) + 1), h["accuracy"], label=method)
    axes[0].set(xlabel="epoch", ylabel="training loss", yscale="log",
                title=f"digits, eta={FLAGS.eta}, mu={FLAGS.mu}, {FLAGS.workers} workers, n_sync={FLAGS.n_sync}")
    axes[1].set(xlabel="epoch", ylabel="training accuracy")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "curves.png"), dpi=110)


def main(argv):
    del argv
    import tf_asgd

    data = tf_asgd.data.load_digits(seed=FLAGS.seed)
    rows, histories = [], {}
    with tf_asgd.LocalCluster(num_workers=FLAGS.workers, num_ps=1, shared_process=True) as cluster:
        for method in FLAGS.methods:
            row, histories[method] = run_method(method, cluster, data)
            rows.append(row)
            print(row, flush=True)
    write_results(rows, histories, FLAGS.out)
    print(f"wrote {FLAGS.out}/results.csv, results.md, curves.png")


if __name__ == "__main__":
    app.run(main)
