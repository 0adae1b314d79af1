"""GEM's stability claim on a real local cluster (Hermans & Louppe 2018, MNIST).

At eta = 0.1, mu = 0.9, many workers and n_sync = 1, the paper expects plain Downpour to
diverge or stall while GEM trains, and GEM to generalise at least as well as its
single-worker momentum-SGD proxy. On the offline digits data and one local cluster it runs
`proxy`, `downpour`, `dynsgd` and `gem` (kappa 1 and 2) for the same number of epochs
(docs/benchmarks.md), and writes `results.csv`, `results.md` and `curves.png` to
`--out` (default `results/gem_stability`).

    python -m benchmarks.run gem_stability            # 8 workers, 20 epochs
    python -m benchmarks.run gem_stability --workers 4 --epochs 5 --out /tmp/gem
"""

import os
import sys
import time

from benchmarks import harness

OUT = "results/gem_stability"  # the default --out


def run_method(method, cluster, data, args):
    """Trains one method; returns a result row and its per-epoch history."""
    import keras
    import numpy as np

    import tf_asgd

    (x, y), (xt, yt) = data
    keras.utils.set_random_seed(args.seed)

    def sgd():
        return keras.optimizers.SGD(args.eta, momentum=args.mu)

    started = time.time()
    row = {
        "method": method,
        "workers": 1 if method == "proxy" else args.workers,
        "n_sync": "" if method == "proxy" else args.n_sync,
        "epochs": args.epochs,
    }
    if method == "proxy":
        model = harness.compile_classifier(
            tf_asgd.models.digits_convnet(), sgd(), metrics=["accuracy"]
        )
        strategy = None
    else:
        rule = "dynsgd" if method == "dynsgd" else "none"
        strategy = tf_asgd.AsyncParameterServerStrategy(
            cluster.resolver, n_sync=args.n_sync, staleness=rule
        )
        with strategy.scope():
            opt = sgd()
            if method.startswith("gem"):
                opt = tf_asgd.optimizers.GEM(opt, kappa=float(method.split("_k")[1]))
            model = harness.compile_classifier(
                tf_asgd.models.digits_convnet(), opt, metrics=["accuracy"]
            )
    history, status = {}, "trained"
    try:
        history = model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, verbose=0).history
    except FloatingPointError:
        status = "diverged (every update NaN/Inf)"
    loss, acc = model.evaluate(xt, yt, verbose=0)
    if not np.isfinite(loss):
        status = "diverged (NaN weights)"
    elif status == "trained" and acc < 0.5:
        status = "stalled"
    row.update(
        status=status,
        test_accuracy=round(float(acc), 4),
        test_loss=round(float(loss), 4),
        final_train_loss=round(float(history.get("loss", [np.nan])[-1]), 4),
        seconds=round(time.time() - started, 1),
    )
    if strategy is not None:
        stats = strategy.model_stats(model)
        row.update(
            windows=stats.windows,
            mean_staleness=round(stats.mean_staleness, 2),
            max_staleness=stats.max_staleness,
            dropped_nonfinite=stats.dropped_nonfinite,
        )
        if "gem_pi_mean" in history:
            row["final_pi_mean"] = round(float(history["gem_pi_mean"][-1]), 3)
    return row, history


def write_results(rows, histories, args):
    out = args.out
    os.makedirs(out, exist_ok=True)
    fields = harness.columns(rows)
    harness.write_csv(os.path.join(out, "results.csv"), rows, fields)
    harness.write_lines(
        os.path.join(out, "results.md"),
        [
            f"Command: `python -m benchmarks.run gem_stability {' '.join(sys.argv[1:])}`",
            "",
            *harness.markdown_table(fields, [[r.get(k, "") for k in fields] for r in rows]),
        ],
    )
    runs = [(method, h) for method, h in histories.items() if h.get("loss")]
    harness.plot_panels(
        os.path.join(out, "curves.png"),
        [
            dict(
                title=f"digits, eta={args.eta}, mu={args.mu}, {args.workers} workers, "
                f"n_sync={args.n_sync}",
                xlabel="epoch",
                ylabel="training loss",
                logy=True,
                series=[(m, range(1, len(h["loss"]) + 1), h["loss"]) for m, h in runs],
            ),
            dict(
                xlabel="epoch",
                ylabel="training accuracy",
                series=[(m, range(1, len(h["accuracy"]) + 1), h["accuracy"]) for m, h in runs],
            ),
        ],
        panel_size=(5.5, 4.0),
    )


def main(argv=None):
    p = harness.parser(__doc__, out=OUT, workers=[8], n_sync=[1], seeds=[0])
    p.add_argument(
        "--epochs",
        type=int,
        default=20,
        help="epochs (passes over the training split) for every method",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=64,
        help="per-worker batch size (the paper: 64)",
    )
    p.add_argument(
        "--eta", type=float, default=0.1, help="learning rate of the proxy and of every worker"
    )
    p.add_argument(
        "--mu", type=float, default=0.9, help="momentum of the proxy and of every worker"
    )
    p.add_argument(
        "--methods",
        type=harness.str_list,
        default="proxy,downpour,dynsgd,gem_k1,gem_k2",
        help="methods to run",
    )
    args = p.parse_args(argv)
    for name in ("workers", "n_sync"):
        setattr(args, name, harness.single(p, args, name))
    args.seed = harness.single(p, args, "seeds")
    import tf_asgd

    data = tf_asgd.data.load_digits(seed=args.seed)
    rows, histories = [], {}
    with harness.local_cluster(args.workers) as cluster:
        for method in args.methods:
            row, histories[method] = run_method(method, cluster, data, args)
            rows.append(row)
            print(row, flush=True)
    write_results(rows, histories, args)
    print(f"wrote {args.out}/results.csv, results.md, curves.png")
    return 0
