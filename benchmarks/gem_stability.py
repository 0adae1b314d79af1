"""GEM's stability claim on a real local cluster (Hermans & Louppe 2018, MNIST).

At eta = 0.1, mu = 0.9, many workers and n_sync = 1, the paper expects plain Downpour to
diverge or stall while GEM trains, and GEM to generalise at least as well as its
single-worker momentum-SGD proxy. On the offline digits and one local cluster it runs `proxy`,
`downpour`, `dynsgd` and `gem` (kappa 1 and 2) for the same epochs (docs/benchmarks.md), and
writes `results.csv`, `results.md` and `curves.png` to `--out`.

    python -m benchmarks.run gem_stability            # 8 workers, 20 epochs
    python -m benchmarks.run gem_stability --workers 4 --epochs 5 --out /tmp/gem
"""

import contextlib
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
    started = time.time()
    proxy = method == "proxy"
    row = dict(
        method=method,
        workers=1 if proxy else args.workers,
        n_sync="" if proxy else args.n_sync,
        epochs=args.epochs,
    )
    strategy = None
    if not proxy:  # the proxy is plain single-process Keras
        rule = "dynsgd" if method == "dynsgd" else "none"
        strategy = tf_asgd.AsyncParameterServerStrategy(
            cluster.resolver, n_sync=args.n_sync, staleness=rule
        )
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        opt = keras.optimizers.SGD(args.eta, momentum=args.mu)
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
    """Writes `results.csv`, `results.md` and `curves.png` (loss and accuracy per epoch)."""
    fields = harness.columns(rows)
    harness.write_csv(os.path.join(args.out, "results.csv"), rows, fields)
    harness.write_lines(
        os.path.join(args.out, "results.md"),
        [
            f"Command: `python -m benchmarks.run gem_stability {' '.join(sys.argv[1:])}`",
            "",
            *harness.markdown_table(fields, [[r.get(k, "") for k in fields] for r in rows]),
        ],
    )
    runs = [(method, h) for method, h in histories.items() if h.get("loss")]
    panels = [
        dict(
            xlabel="epoch",
            ylabel=f"training {key}",
            series=[(m, range(1, len(h[key]) + 1), h[key]) for m, h in runs],
        )
        for key in ("loss", "accuracy")
    ]
    panels[0].update(
        title=f"digits, eta={args.eta}, mu={args.mu}, {args.workers} workers, n_sync={args.n_sync}",
        logy=True,
    )
    harness.plot_panels(os.path.join(args.out, "curves.png"), panels, panel_size=(5.5, 4.0))


def main(argv=None):
    p = harness.parser(__doc__, out=OUT, workers=[8], n_sync=[1], seeds=[0])
    p.add_argument("--epochs", type=int, default=20, help="passes over the data, every method")
    p.add_argument("--batch-size", type=int, default=64, help="per-worker batch (the paper's)")
    p.add_argument("--eta", type=float, default=0.1, help="rate of the proxy and every worker")
    p.add_argument("--mu", type=float, default=0.9, help="momentum of the proxy and every worker")
    p.add_argument(
        "--methods",
        type=harness.str_list,
        default="proxy,downpour,dynsgd,gem_k1,gem_k2",
        help="of proxy, downpour, dynsgd, gem_kK (GEM with kappa K) (default: %(default)s)",
    )
    args = p.parse_args(argv)
    args.workers, args.n_sync, args.seed = (
        harness.single(p, args, name) for name in ("workers", "n_sync", "seeds")
    )
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
