"""Time to accuracy: plain Keras on one emulated device against tf_asgd on N of them.

Each minibatch costs `--device-ms` of device time that uses no CPU, for plain Keras and for
every worker. Per setup (`--setups`), worker count, `n_sync`, push (`+`pull) codec
(`--compressions`) and outer rate (`--outer-rates`): time and samples to plain's final
held-out accuracy minus 1 point, the speed-up, final accuracy, the `stable` and `final_ok`
checks, and CPU use (`cpu_bound` runs measure the CPU, not the devices). `--bandwidth`
limits the cluster's loopback, `--slow-worker` slows worker 0. Writes `runs.csv`,
`curves.csv`, `speedups.md` and `accuracy_vs_{time,samples}.png` to `--out`.

    python -m benchmarks.run time_to_accuracy --quick                # a smoke run
    python -m benchmarks.run time_to_accuracy --setups mnist1d_adam --workers 4,8,16 --n-sync 10,100
"""

import collections
import dataclasses
import functools
import itertools
import math
import os
import time

import numpy as np

from benchmarks import harness, metrics, setups

OUT = "results/time_to_accuracy"  # the default --out

QUICK = dict(
    setups=["mnist1d_adam"],
    workers=[2],
    n_sync=[10],
    seeds=[0],
    device_ms=[4.0],
    plain_steps=150,
    evals=5,
    out="results/time_to_accuracy/quick",
)

MAX_DROP = 0.05  # `stable`: after the first quarter, never further below the running best
MAX_FINAL_GAP = 0.02  # `final_ok`: the final accuracy at most this far below plain's


def curve_callback(
    held_out, eval_every, batch_size, committed_steps=None, pids=(), pause_clock=True
):
    """A Keras callback that takes a `held_out` point every `eval_every` scheduled steps.

    `committed_steps(scheduled)` is the steps in the central weights (tf_asgd; None: all).
    `pids`: other processes whose CPU time counts. `pause_clock`: leave evaluations out of
    the clock and the CPU time (plain Keras stops meanwhile; tf_asgd's workers train on).
    Call `start(model)` right before `fit` and `finish(steps)` after it. `points`: dicts of
    step, samples, wall_s and cpu_s (since `start`), accuracy, loss; none repeats a step.
    `clock(t)` turns a `time.perf_counter()` reading into `wall_s`'s clock.
    """
    import keras

    class Curve(keras.callbacks.Callback):
        def start(self, model):
            self.set_model(model)
            self.points, self.evals, self.eval_cpu = [], [], 0.0
            self.first_step_end = None
            self.next = eval_every
            self.cpu0 = _cpu(pids)
            self.t0 = time.perf_counter()
            self.point(0)

        def clock(self, t):
            if not pause_clock:
                return t - self.t0
            return t - self.t0 - sum(d for s, d in self.evals if s + d <= t)

        def cpu(self):
            return _cpu(pids) - self.cpu0 - (self.eval_cpu if pause_clock else 0.0)

        def on_train_batch_end(self, batch, logs=None):
            if self.first_step_end is None:
                self.first_step_end = self.clock(time.perf_counter())
            if batch + 1 >= self.next:
                self.point(batch + 1)
                while self.next <= batch + 1:
                    self.next += eval_every

        def finish(self, steps):
            self.point(steps, final=True)

        def point(self, scheduled, final=False):
            t, c0 = time.perf_counter(), time.process_time()
            wall, cpu = self.clock(t), self.cpu()
            weights = self.model.get_weights()
            # Read after the weights: never fewer steps than they hold.
            steps = scheduled if committed_steps is None or final else committed_steps(scheduled)
            if not self.points or steps != self.points[-1]["step"]:
                acc, loss = held_out(weights)
                self.points.append(
                    dict(
                        step=steps,
                        samples=steps * batch_size,
                        wall_s=wall,
                        cpu_s=cpu,
                        accuracy=acc,
                        loss=loss,
                    )
                )
            self.evals.append((t, time.perf_counter() - t))
            self.eval_cpu += time.process_time() - c0

    return Curve()


def _cpu(pids):
    return time.process_time() + sum(harness.cpu_seconds(p) for p in pids)


def run_plain(setup, seed, args):
    """Plain Keras on one emulated device; returns (run row, curve points)."""
    import keras

    import tf_asgd

    recipe, data = _recipe(setup, args)
    steps = recipe.steps
    keras.utils.set_random_seed(seed)
    model = setups.build_model(recipe.model, data)
    harness.compile_classifier(model, setups.make_optimizer(recipe.optimizer, steps))
    ds = tf_asgd.data.emulated_device_time(recipe.device_ms)(
        setups.train_dataset(data, recipe.batch, seed), 0
    ).repeat()
    held_out = setups.HeldOut(recipe.model, data)
    curve = curve_callback(held_out, _eval_every(recipe, args), recipe.batch)
    curve.start(model)
    model.fit(ds, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=[curve], shuffle=False)
    end = curve.clock(time.perf_counter())
    curve.finish(steps)
    # Start-up: the first step's excess over the others (tracing).
    step_s = (end - curve.first_step_end) / max(1, steps - 1)
    startup = max(0.0, curve.first_step_end - step_s)
    row = _row(setup, "plain", 1, 0, seed, steps, recipe)
    row.update(_timings(row, curve, end, startup, args.cores))
    return row, curve.points


def parse_outer(spec):
    """`(rate, of_limit)` from `"0.5"` or `"0.667*limit"`; `ValueError` for anything else."""
    fraction, star, limit = spec.partition("*")
    rate = float(fraction)
    if not rate > 0 or (star and limit != "limit"):
        raise ValueError(spec)
    return rate, bool(star)


def _outer_options(outer, workers, optimizer):
    """The strategy's keyword arguments for an `--outer-rates` value on `workers` workers;
    under `rise` the setup's `optimizer` sets the workers' rate."""
    from tf_asgd.rules import outer_optimizers

    if outer == "default":
        return {}
    if outer == "sync":
        return {"synchronous": True}
    if outer == "rise":
        return {
            "outer_optimizer": outer_optimizers.default_outer_optimizer(workers),
            "lr_scaling": setups.auto_worker_rate(optimizer),
        }
    rate, of_limit = parse_outer(outer)
    if of_limit:
        rate *= outer_optimizers.stability_limit(workers)
    return {"outer_optimizer": outer_optimizers.OuterSGD(rate)}


def variant(row):
    """A run's cell label beside its setup, workers and n_sync: its compression (push+pull)
    and, where not the default, its outer rate ("none", "int8+bf16", "outer 0.667")."""
    codec, outer = row["compression"], row["outer"]
    if outer == "default":
        return codec
    return f"outer {outer}" if codec == "none" else f"{codec}, outer {outer}"


def run_asgd(cluster, setup, workers, n_sync, seed, args, compression, outer, budget):
    """tf_asgd on the `workers` emulated devices of `cluster`, with `compression` (push, then
    optionally `+` pull codec), an `--outer-rates` value and `budget` times plain's samples;
    returns (run row, curve points)."""
    import keras

    import tf_asgd

    recipe, data = _recipe(setup, args)
    steps = int(round(budget * recipe.steps))
    # Worker 0 a straggler at `--slow-worker` times the device time (1: none).
    slow = {0: args.slow_worker} if args.slow_worker != 1 else None
    push, _, pull = compression.partition("+")
    strategy = tf_asgd.AsyncParameterServerStrategy(
        cluster.resolver,
        n_sync=n_sync,
        # Fed as a user feeds fit: the seeded pipeline as it is (fit shards it over the
        # workers); per_worker_dataset_fn only emulates each worker's device.
        per_worker_dataset_fn=tf_asgd.data.emulated_device_time(recipe.device_ms, slow),
        compression=push,
        pull_compression=pull or "none",
        **_outer_options(outer, workers, recipe.optimizer),
    )
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        model = setups.build_model(recipe.model, data)
        harness.compile_classifier(model, setups.make_optimizer(recipe.optimizer, steps))

    def committed(scheduled):
        return min(scheduled, strategy.stats().windows * n_sync)

    curve = curve_callback(
        setups.HeldOut(recipe.model, data),
        _eval_every(recipe, args),
        recipe.batch,
        committed,
        pids=list(cluster.pids().values()),
        pause_clock=False,
    )
    wall0 = time.time()
    curve.start(model)
    train = setups.train_dataset(data, recipe.batch, seed)
    model.fit(train, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=[curve])
    end = curve.clock(time.perf_counter())
    curve.finish(steps)
    stats = strategy.model_stats(model)
    # Start-up: until the first window started on a worker (same machine, same clock).
    log = strategy.window_log(model)
    first = min((r.started_at for r in log if math.isfinite(r.started_at)), default=wall0)
    startup = curve.clock(curve.t0 + first - wall0)
    row = _row(setup, "tf_asgd", workers, n_sync, seed, steps, recipe, compression, outer, budget)
    row.update(_timings(row, curve, end, startup, args.cores))
    row.update(
        windows=stats.windows,
        mean_staleness=stats.mean_staleness,
        max_staleness=stats.max_staleness,
        pushed_bytes_per_window=stats.bytes_pushed_per_window,
        pulled_bytes_per_window=stats.bytes_pulled_per_window,
    )
    return row, curve.points


def summarize(points, plain_points):
    """The time-to-accuracy figures of a run against its plain-Keras twin."""
    plain_final, final = plain_points[-1]["accuracy"], points[-1]["accuracy"]
    target = plain_final - 0.01
    t, tp = (metrics.first_reaching(p, target, "time_s") for p in (points, plain_points))
    s, sp = (metrics.first_reaching(p, target, "samples") for p in (points, plain_points))
    drop = metrics.worst_drop(points)
    stable, final_ok = drop <= MAX_DROP, final >= plain_final - MAX_FINAL_GAP
    return dict(
        final_accuracy=final,
        plain_final_accuracy=plain_final,
        target=target,
        time_to_target_s=t,
        plain_time_to_target_s=tp,
        speedup=_ratio(tp, t),
        samples_to_target=s,
        plain_samples_to_target=sp,
        samples_ratio=s / sp if sp > 0 else math.nan,  # nan: plain there at its start
        final_gap_points=100 * (plain_final - final),
        worst_drop_points=100 * drop,
        stable=int(stable),
        final_ok=int(final_ok),
        must_hold=int(stable and final_ok),
    )


def _ratio(plain_s, asgd_s):
    """Plain's time over tf_asgd's; 0 if tf_asgd never reached the target, 1 if both at 0."""
    if not math.isfinite(asgd_s):
        return 0.0
    return plain_s / asgd_s if asgd_s > 0 else (1.0 if plain_s == 0 else math.inf)


def run_line(row):
    """One line of a run's result."""
    if row["method"] == "plain":
        head = (
            f"{row['setup']} plain seed {row['seed']}: final {row['final_accuracy']:.3f}, "
            f"target {row['target']:.3f} at {row['time_to_target_s']:.1f} s"
        )
    else:
        reached = (
            f"target at {row['time_to_target_s']:.1f} s "
            f"(plain {row['plain_time_to_target_s']:.1f}), speed-up {row['speedup']:.2f}x, "
            f"samples x{row['samples_ratio']:.2f}"
            if math.isfinite(row["time_to_target_s"])
            else "target never reached"
        )
        codec = variant(row)
        head = (
            f"{row['setup']} {row['workers']}w n_sync {row['n_sync']}"
            + ("" if codec == "none" else f" {codec}")
            + ("" if row["budget"] == 1.0 else f" {row['budget']:g}x samples")
            + f" seed {row['seed']}: {reached}; final {row['final_accuracy']:.3f} "
            f"(plain {row['plain_final_accuracy']:.3f}), "
            f"worst drop {row['worst_drop_points']:.1f} pts, "
            f"must-hold {'yes' if row['must_hold'] else 'NO'}"
        )
    cpu = f"cpu {100 * row['cpu_util']:.0f}% of {row['cores']} cores"
    return (
        f"{head}; {row['train_s']:.1f} s (+{row['startup_s']:.1f} s start-up), "
        f"device {row['device_fraction']:.2f}, {cpu}" + (" CPU-BOUND" if row["cpu_bound"] else "")
    )


def _range(values, fmt):
    """`mean (min-max)` of the finite `values` ("-" if none)."""
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return "-"
    lo, hi, mean = min(values), max(values), sum(values) / len(values)
    if lo == hi:
        return fmt.format(mean)
    return f"{fmt.format(mean)} ({fmt.format(lo)}-{fmt.format(hi)})"


# speedups.md's figures per cell: (title, run field, format). `_range` skips the infinite
# times and ratios of runs that never reached the target.
FIGURES = (
    ("plain final", "plain_final_accuracy", "{:.3f}"),
    ("plain s to target", "plain_time_to_target_s", "{:.1f}"),
    ("tf_asgd s to target", "time_to_target_s", "{:.1f}"),
    ("speed-up", "speedup", "{:.2f}"),
    ("samples ratio", "samples_ratio", "{:.2f}"),
    ("final", "final_accuracy", "{:.3f}"),
    ("worst drop (pts)", "worst_drop_points", "{:.1f}"),
)

TABLE_NOTE = (
    "Target: plain Keras's final held-out accuracy minus 1 point. Speed-up: plain's "
    "time to target over tf_asgd's (0: never reached). Must hold: after the first "
    "quarter, accuracy never 5 points below its running best, and the final at most "
    "2 points below plain's. Mean (min-max) over seeds."
)


def write_table(out, runs):
    """`speedups.md`: a row per (setup, n_sync, workers, variant, budget) over seeds."""
    groups = collections.defaultdict(list)
    for r in runs:
        if r["method"] == "tf_asgd":
            groups[(r["setup"], r["n_sync"], r["workers"], variant(r), r["budget"])].append(r)
    compressed = any(key[3] != "none" for key in groups)
    rows = []
    for (setup, n_sync, workers, codec, budget), rs in sorted(groups.items()):
        figures = {field: _range([r[field] for r in rs], fmt) for _, field, fmt in FIGURES}
        never = sum(not math.isfinite(r["time_to_target_s"]) for r in rs)
        if never:
            figures["time_to_target_s"] += f", {never} never"
        rows.append(
            [setup, n_sync, workers, *([codec] if compressed else [])]
            + [f"{budget:g}x", len(rs), rs[0]["device_ms"], *figures.values()]
            + [f"{sum(r['must_hold'] for r in rs)}/{len(rs)}"]
            + [_range([r["cpu_util"] for r in rs], "{:.2f}"), sum(r["cpu_bound"] for r in rs)]
        )
    header = ["setup", "n_sync", "workers"]
    header += ["compression (push+pull), outer rate"] if compressed else []
    header += ["samples", "seeds", "device ms", *(title for title, _, _ in FIGURES)]
    header += ["must hold", "CPU share", "CPU-bound runs"]
    lines = [TABLE_NOTE, "", *harness.markdown_table(header, rows)]
    harness.write_lines(os.path.join(out, "speedups.md"), lines)


# The two figures: (x field, x label, file).
PLOTS = (
    ("time_s", "training time (s)", "accuracy_vs_time.png"),
    ("samples", "samples seen", "accuracy_vs_samples.png"),
)


def plot(out, runs, curves):
    """The two figures: a panel per (setup, n_sync), a line per worker count and variant."""
    by_run = collections.defaultdict(list)
    for p in curves:
        by_run[(p["setup"], p["method"], p["workers"], p["n_sync"], variant(p))].append(p)
    cells = collections.defaultdict(set)  # (setup, n_sync): {(workers, variant)}
    for r in runs:
        if r["method"] == "tf_asgd":
            cells[(r["setup"], r["n_sync"])].add((r["workers"], variant(r)))
    for x_key, xlabel, name in PLOTS:
        panels = []
        for (setup, n_sync), lines in sorted(cells.items()):
            plain = [r for r in runs if r["method"] == "plain" and r["setup"] == setup]
            target = sum(r["final_accuracy"] for r in plain) / len(plain) - 0.01
            plain_run = by_run[(setup, "plain", 1, 0, "none")]
            series = [_mean_line("plain Keras, 1 device", plain_run, x_key)]
            for w, codec in sorted(lines):
                label = f"{w} workers" + ("" if codec == "none" else f", {codec}")
                run = by_run[(setup, "tf_asgd", w, n_sync, codec)]
                series.append(_mean_line(label, run, x_key))
            lo = min(min(s[2]) for s in series if len(s[2]))
            panels.append(
                dict(
                    title=f"{setup}, n_sync {n_sync}, {plain[0]['device_ms']:g} ms/batch device",
                    xlabel=xlabel,
                    ylabel="held-out accuracy",
                    series=series,
                    ylim=(max(0.0, min(lo, target - 0.2)), 1.0),
                    hline=(target, "target"),
                )
            )
        if panels:
            harness.plot_panels(os.path.join(out, name), panels, ncols=min(3, len(panels)))


def _mean_line(label, points, x_key):
    """`(label, x, y, y_min, y_max)`: the k-th point of every seed averaged (seeds share
    their evaluation steps)."""
    seeds = collections.defaultdict(list)
    for p in points:
        seeds[p["seed"]].append(p)
    n = min((len(v) for v in seeds.values()), default=0)
    xs = [np.mean([v[k][x_key] for v in seeds.values()]) for k in range(n)]
    accs = [[v[k]["accuracy"] for v in seeds.values()] for k in range(n)]
    return (label, xs, [np.mean(a) for a in accs], [min(a) for a in accs], [max(a) for a in accs])


@functools.cache
def _data(name):
    """A data set of `setups.load_data`, loaded once per process."""
    return setups.load_data(name)


def _recipe(setup, args):
    """The `setups.Setup` of `setup` under `--plain-steps` and `--device-ms`, and its data."""
    recipe = setups.SETUPS[setup]
    recipe = dataclasses.replace(
        recipe,
        steps=args.plain_steps or recipe.steps,
        device_ms=recipe.device_ms if args.device_ms is None else args.device_ms,
    )
    return recipe, _data(recipe.data)


def _eval_every(recipe, args):
    return max(1, recipe.steps // args.evals)


def _row(
    setup, method, workers, n_sync, seed, steps, recipe, codec="none", outer="default", budget=1.0
):
    """The columns that name a run (plain Keras: budget 1, its own samples)."""
    return dict(
        setup=setup,
        method=method,
        workers=workers,
        n_sync=n_sync,
        compression=codec,
        outer=outer,
        seed=seed,
        device_ms=recipe.device_ms,
        batch_size=recipe.batch,
        steps=steps,
        samples=steps * recipe.batch,
        budget=budget,
    )


def _timings(row, curve, end, startup, cores):
    """A run's timings. Sets each point's `time_s`, training time: `wall_s` less the
    start-up (the time before the first step ran)."""
    points = curve.points
    for pt in points:
        pt["time_s"] = max(0.0, pt["wall_s"] - startup)
    train_s = end - startup
    # CPU share over the points taken while training ran (tracing at the start is
    # CPU-heavy and is not what the run measures).
    trained = [pt for pt in points if pt["step"] > 0]
    first, last = (trained[0], trained[-1]) if len(trained) > 1 else (points[0], points[-1])
    span = max(last["wall_s"] - first["wall_s"], 1e-9)
    return dict(
        startup_s=startup,
        train_s=train_s,
        total_s=end,
        eval_s=sum(d for _, d in curve.evals),
        evals=len(points),
        cpu_s=curve.cpu(),
        cpu_util=(last["cpu_s"] - first["cpu_s"]) / (span * cores),
        device_fraction=row["steps"] / row["workers"] * row["device_ms"] / 1000.0 / train_s,
    )


def _parser():
    p = harness.parser(
        __doc__, out=OUT, workers=[1, 2, 4, 8, 16], n_sync=[10, 100], seeds=[0], device_ms=None
    )
    p.add_argument("--setups", type=harness.str_list, default=["mnist1d_adam", "mnist1d_sgd"])
    p.add_argument(
        "--compressions",
        type=harness.str_list,
        default=["none"],
        help="push codecs, each optionally +pull codec: e.g. none,int8,int8+bf16",
    )
    p.add_argument(
        "--outer-rates",
        type=harness.str_list,
        default=["default"],
        help="default (the strategy's), sync (synchronous rounds), rise (the default with the "
        "PS's first-round rise on 3 and 4 workers kept under any workers' rate) or constant "
        "per-push outer rates, as numbers or fractions of the stability limit: e.g. "
        "default,sync,0.667*limit",
    )
    p.add_argument("--bandwidth", help="limit the cluster's loopback, e.g. 100mbit")
    p.add_argument(
        "--budget",
        type=harness.float_list,
        default=[2.0],
        help="tf_asgd's samples over plain's; several (e.g. 1,2) alternate run by run, "
        "after one plain run per seed",
    )
    p.add_argument(
        "--slow-worker",
        type=float,
        default=1.0,
        help="worker 0's device time as a multiple of the others' (a straggler; 1: none)",
    )
    p.add_argument("--plain-steps", type=int, help="plain Keras's steps (default: the setup's)")
    p.add_argument("--evals", type=int, default=30, help="held-out points over plain's run")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: "
        + ", ".join(f"{k} {v}" for k, v in QUICK.items())
        + " (flags given override these)",
    )
    return p


def main(argv=None):
    p = _parser()
    args = p.parse_args(argv)
    if args.quick:
        harness.apply_quick(args, argv, QUICK)
    args.device_ms = harness.single(p, args, "device_ms")
    args.cores = len(os.sched_getaffinity(0))
    for rate in args.outer_rates:
        try:
            if rate not in ("default", "sync", "rise"):
                parse_outer(rate)
        except ValueError:
            p.error(f"--outer-rates: {rate!r} is not 'default', 'sync', 'rise' or a number > 0")
    for s in args.setups:
        if s not in setups.SETUPS:
            p.error(f"unknown setup {s!r}; expected some of {', '.join(setups.SETUPS)}")
    if args.bandwidth:
        from tf_asgd.cluster import network

        network.reexec_in_loopback_namespace()  # returns inside this run's own namespace
    os.makedirs(args.out, exist_ok=True)
    grid = (args.setups, args.n_sync, args.compressions, args.outer_rates, args.seeds, args.budget)
    cells = list(itertools.product(*grid))
    print(f"{len(args.setups) * len(args.seeds) + len(args.workers) * len(cells)} runs", flush=True)
    runs, curves, plain = [], [], {}
    t0 = time.time()

    def record(row, points, plain_points):
        row.update(summarize(points, plain_points))
        row.update(cores=args.cores, cpu_bound=int(metrics.cpu_bound(row["cpu_util"])))
        runs.append(row)
        tags = ("setup", "method", "workers", "n_sync", "seed", "compression", "outer")
        curves.extend(dict(**{k: row[k] for k in tags}, **pt) for pt in points)
        print(f"[{time.time() - t0:5.0f}s] {run_line(row)}", flush=True)
        harness.write_csv(os.path.join(args.out, "runs.csv"), runs)
        harness.write_csv(os.path.join(args.out, "curves.csv"), curves)

    # Plain Keras first, with no cluster running beside it.
    for setup in args.setups:
        for seed in args.seeds:
            row, points = run_plain(setup, seed, args)
            plain[(setup, seed)] = points
            record(row, points, points)
    for workers in args.workers:
        with harness.local_cluster(workers, bandwidth=args.bandwidth) as cluster:
            for setup, n_sync, codec, outer, seed, budget in cells:
                row, points = run_asgd(
                    cluster, setup, workers, n_sync, seed, args, codec, outer, budget
                )
                record(row, points, plain[(setup, seed)])
                write_table(args.out, runs)
    plot(args.out, runs, curves)
    flagged = sum(r["cpu_bound"] for r in runs)
    note = f"{flagged} CPU-bound run(s)" + (": raise --device-ms" if flagged else "")
    print(f"wrote {args.out} in {time.time() - t0:.0f} s; {note}", flush=True)
    return 0
