"""Many-worker simulator runs: GEM's stability claim at 16 to 100 workers.

Runs `tf_asgd.sim.simulator` (the very update rules of the cluster, with NumPy, on its
default MLP, batch and momentum) for every method x worker count x learning rate, and
writes to `--out`:

- `stability.csv`, `stability.png`: final and best held-out loss per run, and whether it
  stayed stable (finite final loss at most half the initial);
- `curves.csv`, `curves_eta<eta>.png`: held-out loss and accuracy against samples seen;
- `pi.csv`, `pi.png`: GEM's pi per tensor (mean and median) over time;
- `staleness.csv`, `staleness.png`: staleness histograms per timing / delay distribution.

    python -m benchmarks.run simulator --workers 16,100 --etas 0.1 --pushes 500  # seconds
"""

import itertools
import json
import os
import time

import numpy as np

from benchmarks import harness, metrics
from tf_asgd.sim import simulator

OUT = "results/simulator"  # the default --out


def main(argv=None):
    p = harness.parser(__doc__, out=OUT, workers=[16, 32, 100], n_sync=[1], seeds=[0])
    p.add_argument("--methods", default="downpour,dynsgd,gem")
    p.add_argument("--etas", type=harness.float_list, default=[0.05, 0.1, 0.3, 1.0])
    p.add_argument("--pushes", type=int, default=3000)
    p.add_argument("--timing", default="exponential", choices=simulator.TIMINGS)
    p.add_argument("--delay", default=None, choices=simulator.DELAYS)
    p.add_argument("--eval-every", type=int, default=50)
    args = p.parse_args(argv)
    args.n_sync = harness.single(p, args, "n_sync")
    args.seed = harness.single(p, args, "seeds")
    methods = args.methods.split(",")
    (x, y), held_out = simulator.digits_features()

    t0 = time.time()
    stability, curves, pis, runs = _sweep(args, methods, x, y, held_out)
    harness.write_csv(os.path.join(args.out, "stability.csv"), stability)
    harness.write_csv(os.path.join(args.out, "curves.csv"), curves)
    if pis:
        harness.write_csv(os.path.join(args.out, "pi.csv"), pis)
        _plot_pi(args, runs)
    _plot_curves(args, methods, runs)
    _plot_stability(args, methods, stability)
    _staleness_distributions(args, x, y)
    print(f"wrote {args.out} in {time.time() - t0:.1f} s", flush=True)
    return 0


def _sweep(args, methods, x, y, held_out):
    """Every eta x worker count x method; returns (stability, curves, pi rows, runs)."""
    stability, curves, pis, runs = [], [], [], {}
    for eta, workers, method in itertools.product(args.etas, args.workers, methods):
        r = simulator.simulate(
            x,
            y,
            method=method,
            workers=workers,
            pushes=args.pushes,
            n_sync=args.n_sync,
            eta=eta,
            timing=args.timing,
            delay=args.delay,
            eval_every=args.eval_every,
            eval_data=held_out,
            seed=args.seed,
        )
        runs[(eta, workers, method)] = r
        losses = [rec["loss"] for rec in r.records]
        final, initial = losses[-1], losses[0]
        # Stable: it learned (held-out loss at most half the initial one), finite.
        stable = bool(np.isfinite(final) and final <= 0.5 * initial and not r.diverged)
        stability.append(
            dict(
                method=method,
                workers=workers,
                eta=eta,
                pushes=r.records[-1]["push"],
                initial_loss=initial,
                final_loss=final,
                best_loss=float(np.min(losses)),
                final_accuracy=r.records[-1]["accuracy"],
                mean_staleness=metrics.mean_staleness(r.staleness_histogram),
                stable=int(stable),
            )
        )
        curves += [dict(method=method, workers=workers, eta=eta, **rec) for rec in r.records]
        pis += [dict(workers=workers, eta=eta, **row) for row in r.pi]
        print(json.dumps(stability[-1]), flush=True)
    return stability, curves, pis, runs


def _plot_curves(args, methods, runs):
    """One figure per eta, a loss and an accuracy panel per worker count."""
    for eta in args.etas:
        panels = []
        for workers in args.workers:
            for key, label in (("loss", "held-out loss"), ("accuracy", "held-out accuracy")):
                series = []
                for method in methods:
                    recs = runs[(eta, workers, method)].records
                    series.append(
                        (method, [r["samples"] for r in recs], [min(r[key], 10.0) for r in recs])
                    )
                panels.append(
                    dict(
                        title=f"{workers} workers, eta {eta}",
                        xlabel="samples seen",
                        ylabel=label,
                        series=series,
                        ylim=(0, 1) if key == "accuracy" else None,
                    )
                )
        harness.plot_panels(
            os.path.join(args.out, f"curves_eta{eta:g}.png"),
            panels,
            ncols=2,
            title="Simulated async SGD on digits (MLP), "
            f"{args.timing if not args.delay else args.delay} staleness",
        )


def _plot_stability(args, methods, stability):
    """The stability map: final loss against eta, one panel per worker count."""
    panels = []
    for workers in args.workers:
        series = []
        for method in methods:
            rows = [s for s in stability if s["workers"] == workers and s["method"] == method]
            series.append(
                (method, [s["eta"] for s in rows], [min(s["final_loss"], 10.0) for s in rows])
            )
        panels.append(
            dict(
                title=f"{workers} workers: final held-out loss",
                xlabel="eta",
                ylabel="loss (capped at 10)",
                series=series,
                logx=True,
                logy=True,
            )
        )
    harness.plot_panels(os.path.join(args.out, "stability.png"), panels, ncols=len(panels))


def _plot_pi(args, runs):
    """pi over time, per tensor: GEM runs at the largest worker count."""
    panels = []
    wmax = max(args.workers)
    for eta in args.etas:
        rows = runs[(eta, wmax, "gem")].pi if (eta, wmax, "gem") in runs else []
        if not rows:
            continue
        names = [k[: -len(":mean")] for k in rows[0] if k.endswith(":mean")]
        pushes = [r["push"] for r in rows]
        series = [
            (f"{n} {stat}", pushes, [r[f"{n}:{stat}"] for r in rows])
            for stat in ("mean", "median")
            for n in names
        ]
        panels.append(
            dict(
                title=f"GEM pi per tensor, {wmax} workers, eta {eta}",
                xlabel="push",
                ylabel="pi",
                series=series,
            )
        )
    harness.plot_panels(os.path.join(args.out, "pi.png"), panels, ncols=2)


def _staleness_distributions(args, x, y):
    """The staleness distributions the simulator can produce (Downpour, short runs)."""
    wmid = args.workers[len(args.workers) // 2]
    rows, series = [], []
    settings = [("timing", t) for t in simulator.TIMINGS] + [("delay", d) for d in simulator.DELAYS]
    for kind, value in settings:
        r = simulator.simulate(
            x,
            y,
            method="downpour",
            workers=wmid,
            pushes=max(10 * wmid, 200),
            eta=0.01,
            eval_every=10**9,
            seed=args.seed,
            **{kind: value},
        )
        h = r.staleness_histogram
        for tau, count in enumerate(h):
            rows.append(
                dict(kind=kind, distribution=value, workers=wmid, staleness=tau, count=int(count))
            )
        series.append((f"{kind}={value}", np.arange(len(h)), h / h.sum()))
    harness.write_csv(os.path.join(args.out, "staleness.csv"), rows)
    harness.plot_panels(
        os.path.join(args.out, "staleness.png"),
        [
            dict(
                title=f"staleness distributions, {wmid} workers",
                xlabel="staleness (pushes)",
                ylabel="fraction of pushes",
                series=series,
            )
        ],
        ncols=1,
        panel_size=(8, 4),
    )
