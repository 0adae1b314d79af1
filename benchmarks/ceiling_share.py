"""How much of the synchronous ceiling N workers get, per seed, from saved runs.

Reads the ceiling (`batch_scaling.py --rates`: `ceiling.csv`) and a rule's runs
(`curves.csv`); prints (and writes to `--out`/shares.md), per worker count and seed, the
share of the ceiling in two framings, and the rule's final minus plain's, at the last
point and smoothed over the last 400 minibatches (as the GPU A-SGD paper smooths):

- *against the recipe*: the rule's speed-up over plain Keras at the user's recipe, over
  the ceiling's (each batch size at its best rate; Shallue et al. 2019, arXiv:1811.03600);
- *strict*: the ceiling's steps over the rule's steps, both to the ceiling's target.

    python -m benchmarks.run ceiling_share \
        --ceiling results/synchronous_rounds/ceiling/ceiling.csv \
        --curves results/workers_rate/anneal_to_one/mnist1d64k_2_4/curves.csv
"""

import csv
import math
import os

import numpy as np

from benchmarks import harness


def read(paths):
    """Rows of every CSV in `paths`, as dicts of strings."""
    rows = []
    for path in paths:
        with open(path, newline="") as f:
            rows += list(csv.DictReader(f))
    return rows


def ceilings(rows):
    """`{(seed, N): (steps, speed-up, target)}`: each batch size's fastest rate."""
    out = {}
    for row in rows:
        key = (int(row["seed"]), int(row["workers"]))
        steps, target = float(row["steps_to_target"]), float(row["target"])
        if key not in out or steps < out[key][0]:
            out[key] = (steps, float(row["speedup"]), target)
    return out


def runs(rows, method, variant):
    """`{(seed, N): run}` of one method and rule, each with its held-out points; the plain
    runs under N = 1."""
    out = {}
    for row in rows:
        plain = row["method"] == "plain"
        if not plain and (row["method"] != method or (variant and row["lr_scaling"] != variant)):
            continue
        key = (int(row["seed"]), int(row["workers"]))
        run = out.setdefault(key, dict(speedup=float(row["speedup"]), points=[]))
        run["points"].append((int(row["step"]), float(row["accuracy"])))
    return out


def _tail_mean(points, span):
    """The mean accuracy of the held-out points in a run's last `span` steps."""
    last = max(s for s, _ in points)
    return float(np.mean([a for s, a in points if s > last - span]))


def shares(ceiling, rules):
    """Table rows per (N, seed): the rule's speed-up, the ceiling, both shares, and its
    final and smoothed final minus plain's."""
    table = []
    for (seed, n), run in sorted(rules.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if n == 1 or (seed, n) not in ceiling:
            continue
        steps, speedup, target = ceiling[(seed, n)]
        points, plain = sorted(run["points"]), sorted(rules[(seed, 1)]["points"])
        reached = next((s for s, a in points if a >= target), math.inf)
        table.append(
            dict(
                workers=n,
                seed=seed,
                speedup=run["speedup"],
                ceiling=speedup,
                recipe=run["speedup"] / speedup if speedup else 0.0,
                strict=steps / reached if math.isfinite(reached) else 0.0,
                final=points[-1][1] - plain[-1][1],
                smoothed=_tail_mean(points, 400 / n) - _tail_mean(plain, 400),
            )
        )
    return table


def summary(table):
    """Markdown lines: every cell, then the means per N."""
    head = ["workers", "seed", "speed-up", "ceiling", "share, against the recipe", "strict",
            "final - plain's", "smoothed - plain's"]  # fmt: skip
    cells = [
        [r["workers"], r["seed"], f"{r['speedup']:.2f}x", f"{r['ceiling']:.2f}x",
         f"{r['recipe']:.2f}", f"{r['strict']:.2f}", f"{100 * r['final']:+.1f}",
         f"{100 * r['smoothed']:+.1f}"]
        for r in table
    ]  # fmt: skip
    means = []
    for n in sorted({r["workers"] for r in table}):
        group = [r for r in table if r["workers"] == n]
        mean = {k: np.mean([r[k] for r in group]) for k in group[0] if k != "seed"}
        low = {k: min(r[k] for r in group) for k in group[0]}
        means.append(
            [n, f"{len(group)} seeds", f"{mean['speedup']:.2f}x", f"{mean['ceiling']:.2f}x",
             f"{mean['recipe']:.2f} (of the means: {mean['speedup'] / mean['ceiling']:.2f}; "
             f"lowest {low['recipe']:.2f})",
             f"{mean['strict']:.2f} (lowest {low['strict']:.2f})",
             f"{100 * mean['final']:+.1f} (lowest {100 * low['final']:+.1f})",
             f"{100 * mean['smoothed']:+.1f} (lowest {100 * low['smoothed']:+.1f})"]
        )  # fmt: skip
    return harness.markdown_table(head, cells) + [""] + harness.markdown_table(head, means)


def main(argv=None):
    p = harness.parser(__doc__, out=None, workers=None, seeds=None)
    p.add_argument("--ceiling", nargs="+", required=True, help="ceiling.csv files")
    p.add_argument("--curves", nargs="+", required=True, help="curves.csv files of the rule")
    p.add_argument("--method", default="async_outer", help="the runs' method")
    p.add_argument("--variant", default="", help="the runs' lr_scaling column (default: any)")
    p.add_argument("--setup", default="", help="the rows of this setup only (default: all)")
    args = p.parse_args(argv)
    pick = lambda rows: [r for r in rows if not args.setup or r["setup"] == args.setup]  # noqa: E731
    rules = runs(pick(read(args.curves)), args.method, args.variant)
    rules = {
        (seed, n): run
        for (seed, n), run in rules.items()
        if (args.workers is None or n in args.workers or n == 1)
        and (args.seeds is None or seed in args.seeds)
    }
    table = shares(ceilings(pick(read(args.ceiling))), rules)
    if not table:
        raise SystemExit("No run of the rule has a ceiling of its seed and worker count.")
    lines = summary(table)
    print("\n".join(lines))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        harness.write_lines(os.path.join(args.out, "shares.md"), lines)
