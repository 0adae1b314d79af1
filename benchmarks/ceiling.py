"""The synchronous ceiling: how many steps N workers' samples save, with no staleness at all.

Per setup (`setups.SETUPS`), seed and worker count N, against plain Keras at batch B:
`large_batch` (batch N x B at the rate x1, x sqrt(N) or x N), `local_sgd` (N copies
averaged every `--n-sync` steps), `lr_only` (batch B at the scaled rate: a control), and
`sync_outer` / `async_outer` (N copies whose windows go through the PS's own rule,
`--outers`, in synchronous rounds or round-robin with every push N - 1 pushes stale).
Speed-up: steps to plain's final held-out accuracy minus 1 point, plain's over the
variant's (Shallue et al. 2019, arXiv:1811.03600). Writes `runs.csv`, `curves.csv`,
`summary.md` and `accuracy_vs_steps.png` to `--out`.

    python -m benchmarks.run ceiling --quick
    python -m benchmarks.run ceiling --setups mnist1d64k_adam --methods sync_outer,async_outer \
        --outers default,diloco --workers 2,4,8 --n-sync 10 --outer-steps 1 --evals 160
"""

import functools
import math
import os

import numpy as np

from benchmarks import harness, metrics, setups

OUT = "results/batch_scaling"  # the default --out

SCALINGS = {"x1": lambda n: 1.0, "sqrt": math.sqrt, "linear": float}
METHODS = ("large_batch", "local_sgd", "lr_only", "sync_outer", "async_outer")
OUTER_HELP = (
    "outer rules of sync_outer/async_outer: default (the strategy's for N workers, "
    "synchronous or asynchronous), average (1/N a push) or diloco (DelayedNesterov(0.7, 0.9)); "
    "each with +sqrt, +linear, +anneal, +none or +F for the workers' rate, or +anneal:F (N "
    "falling toward F) (lr_scaling; default: the strategy's auto under default, else the "
    "user's rate)"
)


def worker_rate(name, workers, synchronous, optimizer):
    """`(peak, final)`: the factor on the workers' rate after the warm-up and from the
    run's end on, under the outer rule `name`: its `+RULE` suffix, else the strategy's
    `lr_scaling="auto"` for `default` (with the setup's `optimizer`), else 1."""
    from tf_asgd.rules import worker_rate

    base, _, rule = name.partition("+")
    if rule in ("", "auto"):
        rule = setups.auto_worker_rate(optimizer, synchronous) if base == "default" else "none"
    if rule.startswith("anneal:"):
        return float(workers), float(rule.split(":")[1])
    if rule not in worker_rate.WORKER_RATE_RULES:
        rule = float(rule)
    peak = worker_rate.worker_rate_peak(workers, rule)
    return peak, worker_rate.worker_rate_scale(workers, rule)


def outer_rule(name, workers, synchronous, worker_peak=1.0):
    """The outer optimizer `name` (see `OUTER_HELP`) for `workers` workers whose rate
    peaks at `worker_peak` times the setup's (the strategy's default depends on it)."""
    from tf_asgd.rules import outer_optimizers

    name = name.partition("+")[0]

    if name == "default" and synchronous:
        return outer_optimizers.default_synchronous_outer_optimizer(workers)
    if name == "default":
        return outer_optimizers.default_outer_optimizer(workers, worker_peak)
    if name == "average":
        return outer_optimizers.OuterSGD(1.0 / workers)
    if name == "diloco":
        return outer_optimizers.DelayedNesterov(0.7, 0.9)
    raise ValueError(f"Unknown outer rule {name!r}; {OUTER_HELP}.")


QUICK = dict(
    setups=["mnist1d_adam"],
    workers=[2],
    n_sync=[10],
    scalings=["x1", "linear"],
    seeds=[0],
    steps=200,
    evals=5,
    out="results/batch_scaling/quick",
)


def _with_learning_rate(name, rate_of):
    """The setup's optimizer with learning rate `rate_of(its own rate)`."""
    opt = setups.make_optimizer(name)
    config = opt.get_config()
    config["learning_rate"] = rate_of(float(config["learning_rate"]))
    return opt.__class__.from_config(config)


def scaled_optimizer(name, scale, steps=None):
    """The setup's optimizer with its learning rate (a schedule's over `steps`) times
    `scale`."""
    return setups.make_optimizer(name, steps, scale)


def workers_optimizer(name, scale, warmup_steps):
    """The setup's optimizer at its own rate times the factor `scale` = `(peak, final)`:
    from 1 to `peak` over the first `warmup_steps`, then falling toward `final`
    (`worker_rate.annealed_rate_scale`, as the strategy does)."""
    import keras
    import tensorflow.experimental.numpy as tnp

    from tf_asgd.rules import worker_rate

    class WorkersRate(keras.optimizers.schedules.LearningRateSchedule):
        def __init__(self, rate):
            self.rate = rate

        def __call__(self, step):
            factor = worker_rate.annealed_rate_scale(*scale, step, warmup_steps, tnp)
            return self.rate * factor

    return _with_learning_rate(name, WorkersRate)


def warmed_up_optimizer(name, rate, warmup_steps):
    """The setup's optimizer at `rate`, reached linearly over the first `warmup_steps`."""
    import keras

    class LinearWarmup(keras.optimizers.schedules.LearningRateSchedule):
        def __call__(self, step):
            return rate * keras.ops.minimum(
                1.0, (keras.ops.cast(step, "float32") + 1) / warmup_steps
            )

    return _with_learning_rate(name, lambda _: LinearWarmup())


def _model(setup, data, scale, steps_per_execution, optimizer=None):
    model_name, opt = setups.SETUPS[setup].model, setups.SETUPS[setup].optimizer
    model = setups.build_model(model_name, data)
    # One call of `train_function` runs `steps_per_execution` steps, in one tf.function.
    harness.compile_classifier(
        model, optimizer or scaled_optimizer(opt, scale), steps_per_execution=steps_per_execution
    )
    model.make_train_function()
    return model


def large_batch(setup, data, multiple, scale, seed, steps, eval_every, optimizer=None):
    """Held-out points `(step, accuracy)` of batch `multiple * B` at `scale` x the rate
    (or with `optimizer`, built after seeding)."""
    import keras

    batch = setups.SETUPS[setup].batch * multiple
    keras.utils.set_random_seed(seed)
    opt = (
        optimizer() if optimizer else scaled_optimizer(setups.SETUPS[setup].optimizer, scale, steps)
    )
    model = _model(setup, data, scale, eval_every, opt)
    held_out = setups.HeldOut(setups.SETUPS[setup].model, data)
    batches = iter(setups.train_dataset(data, batch, seed).repeat())
    points = []
    for step in range(eval_every, steps + 1, eval_every):
        model.train_function(batches)
        points.append((step, held_out(model.get_weights())[0]))
    return points


def local_sgd(setup, data, workers, n_sync, seed, steps, eval_every):
    """Held-out points of `workers` copies averaged every `n_sync` steps."""
    import keras

    batch = setups.SETUPS[setup].batch
    keras.utils.set_random_seed(seed)
    copies = [_model(setup, data, 1.0, n_sync) for _ in range(workers)]
    center = copies[0].get_weights()
    held_out = setups.HeldOut(setups.SETUPS[setup].model, data)
    # Each copy draws its own shuffle of the whole set, as independent workers would.
    feeds = [
        iter(setups.train_dataset(data, batch, seed * 1000 + i).repeat()) for i in range(workers)
    ]
    points, next_eval = [], eval_every
    for step in range(n_sync, steps + 1, n_sync):
        ends = []
        for model, feed in zip(copies, feeds):
            model.set_weights(center)
            model.train_function(feed)
            ends.append(model.get_weights())
        center = [np.mean(w, axis=0) for w in zip(*ends)]
        if step >= next_eval or step + n_sync > steps:
            points.append((step, held_out(center)[0]))
            next_eval += eval_every
    return points


def _copies(setup, data, workers, n_sync, steps, worker_scale):
    """The `workers` Keras copies of `outer_rounds`, each at the setup's rate times
    `worker_scale` over its `steps` (`workers_optimizer`)."""
    from tf_asgd.rules import worker_rate
    from tf_asgd.runtime import optimizer_options

    if worker_scale == (1.0, 1.0):
        return [_model(setup, data, 1.0, n_sync) for _ in range(workers)]
    opt = setups.SETUPS[setup].optimizer
    # In each copy's steps: the strategy's warm-up counts every worker's.
    cap = worker_rate.untuned_warmup_steps(
        optimizer_options.second_moment_beta(setups.make_optimizer(opt))
    )
    warmup = worker_rate.worker_rate_warmup_steps(
        *worker_scale[:2], steps, None if cap is None else max(1, cap // workers)
    )
    return [
        _model(setup, data, 1.0, n_sync, workers_optimizer(opt, worker_scale, warmup))
        for _ in range(workers)
    ]


def outer_rounds(
    setup,
    data,
    workers,
    n_sync,
    seed,
    steps,
    eval_every,
    outer,
    asynchronous,
    worker_scale=(1.0, 1.0),
):
    """Held-out points of `workers` copies whose windows an outer rule applies.

    Each window is `n_sync` steps of the user's optimizer on one copy; its push (the
    displacement) goes through `outer_optimizers.outer_step`, the rule the PS runs.
    Synchronous: every copy starts a round from the same central weights. Asynchronous:
    windows end in round-robin order and each copy pulls right after its push, so every
    push is `workers - 1` pushes stale, as homogeneous workers make it. Each copy's rate is
    the setup's times `worker_scale` = `(peak, final)`, warmed up to the peak and falling
    toward the final as the strategy does (`workers_optimizer`, `lr_scaling`). `steps`
    counts steps per copy (device times).

    Returns:
        `(points, noise)`: the held-out points, and (synchronous) the gradient noise scale
        in windows over the first and the last quarter of the rounds, as the PS reads it
        (`noise_scale.from_sums`); `(nan, nan)` when asynchronous.
    """
    import keras

    from tf_asgd.rules import noise_scale, outer_optimizers

    batch = setups.SETUPS[setup].batch
    keras.utils.set_random_seed(seed)
    copies = _copies(setup, data, workers, n_sync, steps, worker_scale)
    center = copies[0].get_weights()
    state = [{} for _ in center]
    starts = [center] * workers
    held_out = setups.HeldOut(setups.SETUPS[setup].model, data)
    feeds = [
        iter(setups.train_dataset(data, batch, seed * 1000 + i).repeat()) for i in range(workers)
    ]
    points, next_eval = [], eval_every
    sums, round_sum = [], 0.0  # per round: (pushes' squared norms, their sum's squared norm)
    for ticket in range(steps * workers // n_sync):
        i = ticket % workers  # equal copies end their windows in round-robin order
        copies[i].set_weights(starts[i])
        copies[i].train_function(feeds[i])
        pushed = [s - e for s, e in zip(starts[i], copies[i].get_weights())]
        if not asynchronous:  # the rounds' noise sums (`noise_scale.from_sums`)
            flat = np.concatenate([g.ravel() for g in pushed]).astype(np.float64)
            round_sum = flat if i == 0 else round_sum + flat
            if i == 0:
                sums.append([0.0, 0.0])
            sums[-1][0] += float(flat @ flat)
            if i == workers - 1:
                sums[-1][1] = float(round_sum @ round_sum)
        center = list(center)
        for j, g in enumerate(pushed):
            center[j], state[j] = outer_optimizers.outer_step(
                outer, center[j], g, state[j], ticket, workers
            )
        if asynchronous:
            starts[i] = center
        elif i == workers - 1:
            starts = [center] * workers
        step = (ticket + 1) * n_sync // workers
        if step >= next_eval:
            points.append((step, held_out(center)[0]))
            next_eval += eval_every
    if asynchronous or workers < 2:
        return points, (math.nan, math.nan)
    quarter = max(1, len(sums) // 4)
    noise = tuple(
        noise_scale.from_sums(*np.sum(part, axis=0), workers)
        for part in (sums[:quarter], sums[-quarter:])
    )
    return points, noise


def ceiling(setup, data, seed, args):
    """Rows of the best-rate ceiling: each batch size at each rate of `--rates`.

    Every rate warms up linearly over 5% of batch B's steps (the same for every batch).
    The target is the best batch-B final minus 1 point; a batch size's steps are its
    fastest rate's to it. Batch N x B runs `2 / N` of batch B's steps.
    """
    steps = args.steps or setups.SETUPS[setup].steps
    name, runs = setups.SETUPS[setup].optimizer, []
    for n in [1] + list(args.workers):
        length = steps if n == 1 else int(steps * 2 / n)
        every = max(1, min(length // 20, steps // args.evals))
        for rate in args.rates:
            make = functools.partial(warmed_up_optimizer, name, rate, max(1, steps // 20))
            points = large_batch(setup, data, n, 1.0, seed, length, every, optimizer=make)
            runs.append(dict(setup=setup, seed=seed, workers=n, rate=rate, points=points))
            print(f"{setup} seed {seed} batch x{n} rate {rate:g}: final {points[-1][1]:.3f}")
    target = max(r["points"][-1][1] for r in runs if r["workers"] == 1) - 0.01
    for r in runs:
        points = r.pop("points")
        reached = metrics.first_reaching(points, target, key=0, accuracy=1)
        r.update(final_accuracy=points[-1][1], target=target, steps_to_target=reached)
    base_steps = min(r["steps_to_target"] for r in runs if r["workers"] == 1)
    for r in runs:
        reached = r["steps_to_target"]
        r["speedup"] = base_steps / reached if math.isfinite(reached) else 0.0
    return runs


def ceiling_summary(rows):
    """`summary.md`'s lines for `--rates`: per setup and N, the best rate's speed-up."""
    lines = ["Each batch size at its best rate (linear warm-up over 5% of steps):", ""]
    table = []
    for (setup, n), group in sorted(_groups(rows, ("setup", "workers")).items()):
        best = {}
        for row in group:
            if row["speedup"] >= best.get(row["seed"], {}).get("speedup", -1):
                best[row["seed"]] = row
        cells = [best[s] for s in sorted(best)]
        table.append(
            [
                setup,
                f"{n} x B",
                "/".join(f"{r['rate']:g}" for r in cells),
                "/".join(str(r["steps_to_target"]) for r in cells),
                f"{np.mean([r['speedup'] for r in cells]):.2f}x",
                f"{cells[0]['target']:.3f}",
            ]
        )
    head = ["setup", "batch", "best rate per seed", "steps to target", "ceiling", "target"]
    return lines + harness.markdown_table(head, table)


def _groups(rows, keys):
    out = {}
    for row in rows:
        out.setdefault(tuple(row[k] for k in keys), []).append(row)
    return out


def variants(args):
    """`(method, workers, n_sync, scaling or outer rule)` of every run of a setup and seed,
    plain Keras (batch B) first."""
    out = [("plain", 1, 0, "x1")]
    outers = [m for m in ("sync_outer", "async_outer") if m in args.methods]
    for n in args.workers:
        if "large_batch" in args.methods:
            out += [("large_batch", n, 0, s) for s in args.scalings]
        if "local_sgd" in args.methods:
            out += [("local_sgd", n, h, "x1") for h in args.n_sync]
        if "lr_only" in args.methods:  # the control: batch B at the scaled rate
            out += [("lr_only", n, 0, s) for s in args.scalings if s != "x1"]
        out += [(m, n, h, o) for m in outers for h in args.n_sync for o in args.outers]
    return out


def run_setup(setup, data, seed, args):
    """Rows and curves of one setup and seed: batch B, then every variant."""
    steps = args.steps or setups.SETUPS[setup].steps
    every = max(1, steps // args.evals)
    steps = every * (steps // every)
    rows, curves, target, base_steps = [], [], None, None
    for method, n, h, scaling in variants(args):
        noise = (math.nan, math.nan)
        if method == "local_sgd":
            points = local_sgd(setup, data, n, h, seed, steps, every)
        elif method in ("sync_outer", "async_outer"):
            # In steps per worker: N workers need about 1/N of plain's steps at best.
            per_worker = every * max(1, round(steps * args.outer_steps / n / every))
            asynchronous = method == "async_outer"
            scale = worker_rate(scaling, n, not asynchronous, setups.SETUPS[setup].optimizer)
            opt = outer_rule(scaling, n, not asynchronous, worker_peak=scale[0])
            points, noise = outer_rounds(
                setup,
                data,
                n,
                h,
                seed,
                per_worker,
                every,
                opt,
                asynchronous,
                scale,
            )
        else:
            multiple, length = (1 if method == "lr_only" else n), steps
            if method == "large_batch" and args.large_batch_samples:
                # That share of plain's samples, as --outer-steps sizes the copies' runs.
                length = every * max(1, round(steps * args.large_batch_samples / n / every))
            points = large_batch(setup, data, multiple, SCALINGS[scaling](n), seed, length, every)
        if target is None:
            target = points[-1][1] - 0.01
            base_steps = metrics.first_reaching(points, target, key=0, accuracy=1)
        reached = metrics.first_reaching(points, target, key=0, accuracy=1)
        row = dict(
            setup=setup,
            seed=seed,
            method=method,
            workers=n,
            n_sync=h,
            lr_scaling=scaling,
            steps=steps,
            final_accuracy=points[-1][1],
            best_accuracy=max(a for _, a in points),
            target=target,
            steps_to_target=reached,
            plain_steps_to_target=base_steps,
            speedup=base_steps / reached if math.isfinite(reached) else 0.0,
            noise_scale_first=noise[0],
            noise_scale_last=noise[1],
        )
        rows.append(row)
        curves += [dict(row, step=s, accuracy=a) for s, a in points]
        noise_text = (
            ""
            if math.isnan(noise[0])
            else f"; noise scale {noise[0]:.3g} -> {noise[1]:.3g} windows"
        )
        print(
            f"{setup} seed {seed} {method} N={n} n_sync={h} lr {scaling}: final "
            f"{row['final_accuracy']:.3f}, steps to {target:.3f}: {reached} "
            f"(speed-up {row['speedup']:.2f}x){noise_text}",
            flush=True,
        )
    return rows, curves


def noise_summary(rows):
    """`summary.md`'s lines on the noise scale the synchronous runs read (if any)."""
    table = []
    for (setup, n, h, outer), runs in sorted(
        _groups(
            [r for r in rows if r["method"] == "sync_outer"],
            ("setup", "workers", "n_sync", "lr_scaling"),
        ).items()
    ):
        first = "/".join(f"{r['noise_scale_first']:.3g}" for r in runs)
        last = "/".join(f"{r['noise_scale_last']:.3g}" for r in runs)
        table.append([setup, str(n), str(h), outer, first, last])
    if not table:
        return []
    lines = [
        "",
        "The gradient noise scale the synchronous runs' rounds gave, in windows "
        "(`noise_scale.from_sums`), over their first and last quarter of rounds, per seed:",
        "",
    ]
    head = ["setup", "N", "n_sync", "outer", "first quarter", "last quarter"]
    return lines + harness.markdown_table(head, table)


def variant_label(method, n_sync, scaling):
    """How `summary.md` and the plot name a variant."""
    return {
        "local_sgd": f"local SGD, n_sync {n_sync}",
        "large_batch": f"batch N x B, lr {scaling}",
        "lr_only": f"batch B, lr {scaling} (control)",
        "sync_outer": f"synchronous, n_sync {n_sync}, outer {scaling}",
        "async_outer": f"asynchronous, n_sync {n_sync}, outer {scaling}",
    }[method]


def summary(rows):
    """`summary.md`'s lines: mean speed-up per setup, variant and worker count."""
    cells = {}
    for r in rows:
        if r["method"] == "plain":
            continue
        key = (r["setup"], r["method"], r["n_sync"], r["lr_scaling"])
        cells.setdefault(key, {}).setdefault(r["workers"], []).append(r)
    workers = sorted({r["workers"] for r in rows if r["method"] != "plain"})

    def cell(runs):
        if not runs:
            return ""
        speedups = [r["speedup"] for r in runs]
        reached = sum(s > 0 for s in speedups)
        finals = "/".join(f"{r['final_accuracy']:.3f}" for r in runs)
        return f"{np.mean(speedups):.2f}x ({reached}/{len(runs)}; final {finals})"

    table = []
    for (setup, method, h, scaling), by_n in sorted(cells.items()):
        variant = variant_label(method, h, scaling)
        table.append([setup, variant] + [cell(by_n.get(n, [])) for n in workers])
    plain = {(r["setup"], r["seed"]): r for r in rows if r["method"] == "plain"}
    lines = [
        "Speed-up in steps to plain's final held-out accuracy minus 1 point (mean over seeds, "
        "0 for a seed that never reached it; reached/seeds; finals at the same steps).",
        "",
    ]
    lines += harness.markdown_table(["setup", "variant"] + [f"N={n}" for n in workers], table)
    lines += ["", "Plain Keras (batch B): final / steps to the target, per seed:", ""]
    lines += [
        f"- {s} seed {seed}: {r['final_accuracy']:.3f} / {r['plain_steps_to_target']}"
        for (s, seed), r in sorted(plain.items())
    ]
    return lines + noise_summary(rows)


def plot(path, curves):
    """Held-out accuracy against steps, mean over seeds: a panel per setup and worker count,
    plain Keras beside every variant, and the target as a dashed line."""

    def mean_curve(runs):
        by_step = {}
        for r in runs:
            by_step.setdefault(r["step"], []).append(r["accuracy"])
        steps = sorted(by_step)
        return steps, [float(np.mean(by_step[s])) for s in steps]

    panels = []
    for setup in dict.fromkeys(r["setup"] for r in curves):
        mine = [r for r in curves if r["setup"] == setup]
        plain = [r for r in mine if r["method"] == "plain"]
        target = float(np.mean([r["target"] for r in plain]))
        for n in sorted({r["workers"] for r in mine if r["method"] != "plain"}):
            series = [("plain Keras (batch B)", *mean_curve(plain))]
            by_label = {}
            for r in mine:
                if r["method"] != "plain" and r["workers"] == n:
                    label = variant_label(r["method"], r["n_sync"], r["lr_scaling"])
                    by_label.setdefault(label, []).append(r)
            series += [(name, *mean_curve(runs)) for name, runs in by_label.items()]
            panels.append(
                dict(
                    title=f"{setup}, N = {n}",
                    xlabel="steps (device times)",
                    ylabel="held-out accuracy",
                    series=series,
                    hline=(target, "target"),
                    ylim=(max(0.0, target - 0.25), min(1.0, target + 0.06)),
                )
            )
    harness.plot_panels(path, panels, ncols=3, title="Synchronous ceiling (mean over seeds)")


def main(argv=None):
    p = harness.parser(__doc__, out=OUT, workers=[2, 4, 8], n_sync=[10, 100], seeds=[0])
    p.add_argument("--setups", type=harness.str_list, default=["mnist1d_adam", "mnist1d_sgd"])
    p.add_argument(
        "--scalings", type=harness.str_list, default=list(SCALINGS), help="x1, sqrt, linear"
    )
    p.add_argument(
        "--methods",
        type=harness.str_list,
        default=list(METHODS[:3]),
        help="large_batch, local_sgd, lr_only (batch B at the scaled rate: a control), "
        "sync_outer, async_outer (windows through the PS's outer rule, in one process)",
    )
    p.add_argument(
        "--outers", type=harness.str_list, default=["default", "diloco"], help=OUTER_HELP
    )
    p.add_argument(
        "--outer-steps",
        type=float,
        default=0.5,
        help="sync_outer/async_outer run this share of plain's samples (steps x N / plain's)",
    )
    p.add_argument(
        "--large-batch-samples",
        type=float,
        default=None,
        help="large_batch runs this share of plain's samples (default: plain's steps, N times "
        "its samples: the ceiling in device time)",
    )
    p.add_argument(
        "--rates",
        type=harness.float_list,
        default=None,
        help="the ceiling instead: every batch size at each of these rates, with warm-up",
    )
    p.add_argument("--steps", type=int, default=None, help="steps (default: each setup's)")
    p.add_argument("--evals", type=int, default=60, help="held-out points over a run")
    p.add_argument("--quick", action="store_true", help="a smoke run")
    args = p.parse_args(argv)
    if args.quick:
        harness.apply_quick(args, argv, QUICK)
    for flag, given, known in (
        ("setup", args.setups, setups.SETUPS),
        ("method", args.methods, METHODS),
        ("scaling", args.scalings, SCALINGS),
    ):
        for value in given:
            if value not in known:
                p.error(f"unknown {flag} {value!r}; expected some of {', '.join(known)}")
    os.makedirs(args.out, exist_ok=True)
    rows, curves = [], []
    for setup in args.setups:
        data = setups.load_data(setups.SETUPS[setup].data)
        for seed in args.seeds:
            if args.rates:
                rows += ceiling(setup, data, seed, args)
            else:
                r, c = run_setup(setup, data, seed, args)
                rows, curves = rows + r, curves + c
    if args.rates:
        lines = ceiling_summary(rows)
        harness.write_csv(os.path.join(args.out, "ceiling.csv"), rows)
        harness.write_lines(os.path.join(args.out, "ceiling.md"), lines)
    else:
        lines = summary(rows)
        harness.write_csv(os.path.join(args.out, "runs.csv"), rows)
        harness.write_csv(os.path.join(args.out, "curves.csv"), curves)
        harness.write_lines(os.path.join(args.out, "summary.md"), lines)
        plot(os.path.join(args.out, "accuracy_vs_steps.png"), curves)
    print("\n".join(lines))
    return 0
