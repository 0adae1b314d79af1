"""A parameter server recovered inside `fit`: what snapshots cost, and what faults cost.

`--mode`, comma-separated: `cost` (samples/s and the workers' idle time, snapshots off, at
the default 60 s and every 2 s); `faults` (ps:0 SIGKILLed halfway through `fit`, against
the fault-free `fit`); `ps_any_time` (ps:0 killed at each of `--kill-at` s of a `fit`);
`worker_restarts` (each of 4 workers in turn killed every `--periods` s); `chaos_seeds`
(`--runs` fits of 20 seeded faults each). Writes `<mode>.csv` and `tables.md` under
`--out`; docs/benchmarks.md has the details.

    python -m benchmarks.run faults --mode faults,cost --noise-floor
"""

import faulthandler
import itertools
import operator
import shutil
import statistics
import tempfile
import threading
import time
import traceback

from benchmarks import harness, metrics, setups

OUT = "results/ps_recovery"  # the default --out
EVERIES = (None, 60.0, 2.0)  # cost: snapshots off, at the default (60 s), every 2 s


def _sharded_strategy(cluster, device_ms=None, **options):
    """A strategy on `cluster` with variables over 4 KiB split over the PS tasks; each
    worker's batches cost `device_ms` of emulated device time where given."""
    import tensorflow as tf

    import tf_asgd

    if device_ms is not None:
        options["per_worker_dataset_fn"] = tf_asgd.data.emulated_device_time(device_ms)
    partitioner = tf.distribute.experimental.partitioners.MaxSizePartitioner(max_shard_bytes=4096)
    return tf_asgd.AsyncParameterServerStrategy(
        cluster.resolver, variable_partitioner=partitioner, **options
    )


def _applied_twice(log):
    """The windows of window log `log` whose push was applied more than once."""
    ids = [r.window_id for r in log if r.pushed and not r.replayed and not r.rolled_back]
    return len(ids) - len(set(ids))


def _restart_later(cluster, task, after=2.0):
    time.sleep(after)
    cluster.restart_task(task)


def _append(rows, row):
    """Appends `row` to `rows` and prints it: the run's log as it goes."""
    rows.append(row)
    print(", ".join(f"{k} {_fmt(v)}" for k, v in row.items()), flush=True)


def _fmt(v):
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _table(rows):
    """A Markdown table of `rows` (dicts with the same keys), one line each."""
    keys = list(rows[0])
    return harness.markdown_table(keys, [[_fmt(r[k]) for k in keys] for r in rows])


def cost_cell(cluster, model_name, every, steps, n_sync=10, batch=64, synchronous=False):
    """One `fit` of `steps` steps with `snapshot_every=every`: samples/s and snapshots."""
    import keras

    import tf_asgd

    strategy = tf_asgd.AsyncParameterServerStrategy(
        cluster.resolver, n_sync=n_sync, snapshot_every=every, synchronous=synchronous
    )
    with strategy.scope():
        model = harness.throughput_model(model_name)
        harness.compile_classifier(model, keras.optimizers.SGD(0.01))
    data = harness.synthetic_images(batch)
    model.fit(data, epochs=1, steps_per_epoch=n_sync * 2, verbose=0)  # warm-up
    before = len(strategy.ps_recovery.snapshots)
    t0 = time.perf_counter()
    model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
    seconds = time.perf_counter() - t0
    snaps = strategy.ps_recovery.snapshots[before:]  # each (read s, wait s, bytes, end)
    idle = _idle_at(strategy.window_log(model), [s[3] for s in snaps])
    return {
        "model": model_name, "synchronous": synchronous,
        "snapshot_every": "off" if every is None else every,
        "seconds": seconds, "samples_per_s": steps * batch / seconds, "snapshots": len(snaps),
        "read_s": statistics.mean(s[0] for s in snaps) if snaps else 0.0,
        "wait_s": statistics.mean(s[1] for s in snaps) if snaps else 0.0,
        "mbytes": snaps[0][2] / 1e6 if snaps else 0.0, "idle_s": idle,
    }  # fmt: skip


def _idle_at(log, ends):
    """The seconds of one worker lost to snapshots ending at `ends` (`time.time()`): per
    snapshot and worker, the gap between its windows across the end less its median gap,
    averaged over the workers."""
    lost = 0.0
    by_worker = {}
    for r in log:
        if not r.replayed:
            by_worker.setdefault(r.worker, []).append((r.started_at, r.finished_at))
    for windows in by_worker.values():
        windows.sort()
        gaps = [b[0] - a[1] for a, b in zip(windows, windows[1:])]
        usual = statistics.median(gaps) if gaps else 0.0
        for end in ends:
            before = [f for s, f in windows if f <= end]
            after = [s for s, f in windows if s >= end]
            if before and after:
                lost += max(0.0, min(after) - max(before) - usual) / len(by_worker)
    return lost


def run_cost(args):
    rows = []
    with harness.local_cluster(2) as cluster:
        for model_name in args.models:
            # Steps for about --seconds with snapshots off, measured once.
            probe = cost_cell(cluster, model_name, None, 200, synchronous=args.synchronous)
            steps = max(20, int(200 * args.seconds / probe["seconds"]) // 20 * 20)
            for every in EVERIES * args.rounds:
                row = cost_cell(cluster, model_name, every, steps, synchronous=args.synchronous)
                _append(rows, row)
    return rows, _cost_summary(rows)


def _cost_summary(rows):
    """The cost table. The chief's share: its time in snapshots (its wait for the windows in
    flight, then the read) over the fit's; the workers' idle share (`_idle_at`): the
    overhead, which the noise of samples/s on a shared machine cannot resolve."""
    header = ["model", "snapshot_every", "samples/s (median)", "vs off", "snapshots per fit",
              "read s", "wait s", "MB", "chief's share", "workers' idle share"]  # fmt: skip
    table = []
    for model, every in dict.fromkeys((r["model"], r["snapshot_every"]) for r in rows):
        mine = [r for r in rows if (r["model"], r["snapshot_every"]) == (model, every)]
        off = metrics.median_of(rows, "samples_per_s", model=model, snapshot_every="off")
        rate = statistics.median(r["samples_per_s"] for r in mine)
        share = statistics.mean(
            r["snapshots"] * (r["read_s"] + r["wait_s"]) / r["seconds"] for r in mine
        )
        idle = statistics.mean(r["idle_s"] / r["seconds"] for r in mine)
        table.append([
            model, every, f"{rate:.0f}", f"{rate / off:.3f}",
            f"{statistics.mean(r['snapshots'] for r in mine):.1f}",
            f"{statistics.mean(r['read_s'] for r in mine):.3f}",
            f"{statistics.mean(r['wait_s'] for r in mine):.3f}",
            f"{max(r['mbytes'] for r in mine):.1f}", f"{100 * share:.1f}%", f"{100 * idle:.1f}%",
        ])  # fmt: skip
    return harness.markdown_table(header, table)


def _kill_halfway(cluster, at):
    """A callback: SIGKILLs ps:0 after `at` windows, restarts it 2 s later (in `thread`)."""
    import keras

    class Kill(keras.callbacks.Callback):
        windows, thread = 0, None

        def on_train_batch_end(self, batch, logs=None):
            self.windows += 1
            if self.thread is None and self.windows >= at:
                cluster.kill_task("ps:0")
                self.thread = threading.Thread(target=_restart_later, args=(cluster, "ps:0"))
                self.thread.start()

    return Kill()


def fault_cell(cluster, setup, workers, seed, fault, data, synchronous=False, n_sync=10):
    """One `fit` of `setup` with ps:0 killed halfway if `fault` (None: the fault-free `fit`
    again, how far two fits of one seed differ anyway); its row."""
    import keras

    recipe = setups.FAULT_SETUPS[setup]
    (x, y), (xt, yt) = data
    strategy = _sharded_strategy(cluster, n_sync=n_sync, synchronous=synchronous)
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        model = setups.build_model(recipe.model, data)
        optimizer = setups.make_optimizer(recipe.optimizer)
        harness.compile_classifier(model, optimizer, metrics=["accuracy"])
    steps = len(x) // recipe.batch
    windows = recipe.epochs * -(-steps // n_sync)
    callbacks = [_kill_halfway(cluster, windows // 2)] if fault else []
    t0 = time.perf_counter()
    model.fit(x, y, batch_size=recipe.batch, epochs=recipe.epochs, callbacks=callbacks, verbose=0)
    seconds = time.perf_counter() - t0
    for c in callbacks:
        c.thread.join()
    accuracy = float(model.evaluate(xt, yt, verbose=0)[1])
    stats = strategy.model_stats(model)
    rec = strategy.recoveries
    return {
        "setup": setup, "workers": workers, "seed": seed, "synchronous": synchronous,
        "fault": fault, "seconds": seconds, "test_accuracy": accuracy,
        "recoveries": len(rec), "rolled_back": sum(r.rolled_back for r in rec),
        "in_flight": sum(r.in_flight for r in rec),
        "recovery_s": sum(r.waited_s + r.restore_s for r in rec),
        # The counters are the strategy's: one strategy per fit here.
        "version_is_applied": int(strategy.counters.version.numpy()) == stats.applied
        or not fault,
        "applied_twice": _applied_twice(strategy.window_log(model)),
    }  # fmt: skip


def run_faults(args):
    rows, faults = [], (False, True) + ((None,) if args.noise_floor else ())
    for setup in args.setups:
        data = setups.load_data(setups.FAULT_SETUPS[setup].data)
        for workers in args.workers:
            with harness.local_cluster(workers, 2, "separate") as cluster:
                for seed, fault in itertools.product(args.seeds, faults):
                    row = fault_cell(cluster, setup, workers, seed, fault, data, args.synchronous)
                    _append(rows, row)
    return rows, _faults_summary(rows)


def _faults_summary(rows):
    header = ["setup", "workers", "seed", "accuracy, fault-free", "accuracy, PS killed",
              "difference", "fault-free again: difference", "pushes rolled back", "in flight",
              "recovery s", "version = applied", "applied twice"]  # fmt: skip
    cell = operator.itemgetter("setup", "workers", "seed")
    free = {cell(r): r for r in rows if r["fault"] is False}
    again = {cell(r): r for r in rows if r["fault"] is None}
    table = []
    for r in rows:
        f, a = free.get(cell(r)), again.get(cell(r))
        if r["fault"] is not True or f is None:
            continue
        table.append([
            r["setup"], r["workers"], r["seed"], f"{f['test_accuracy']:.3f}",
            f"{r['test_accuracy']:.3f}", f"{r['test_accuracy'] - f['test_accuracy']:+.3f}",
            f"{a['test_accuracy'] - f['test_accuracy']:+.3f}" if a else "-",
            r["rolled_back"], r["in_flight"], f"{r['recovery_s']:.1f}",
            r["version_is_applied"], r["applied_twice"],
        ])  # fmt: skip
    return harness.markdown_table(header, table)


def _user_fit(strategy, data, epochs, steps, callbacks, seed=0):
    """The digits convnet trained as a user's script trains it: `SGD(0.05, momentum=0.9)`
    on a seeded, shuffled, repeated `tf.data` pipeline of batch 32. Returns `(model, fit
    seconds, held-out accuracy)`."""
    import keras
    import tensorflow as tf

    (x, y), (xt, yt) = data
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        model = setups.build_model("digits_convnet", data)
        optimizer = setups.make_optimizer("sgd_0.05_m0.9")
        harness.compile_classifier(model, optimizer, metrics=["accuracy"])
    pipeline = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=seed)
    t0 = time.perf_counter()
    model.fit(pipeline.repeat().batch(32), epochs=epochs, steps_per_epoch=steps,
              callbacks=callbacks, verbose=0)  # fmt: skip
    seconds = time.perf_counter() - t0
    return model, seconds, float(model.evaluate(xt, yt, verbose=0)[1])


def _fit_or_error(strategy, data, epochs, steps, callbacks):
    """`_user_fit`'s `(model, seconds, accuracy)` and "", or `(None, nan, nan)` and its error."""
    try:
        return (*_user_fit(strategy, data, epochs, steps, callbacks), "")
    except Exception as e:  # noqa: BLE001 - the row reports it
        return None, float("nan"), float("nan"), repr(e)[:200]


def _kill_at(cluster, at):
    """A callback that SIGKILLs ps:0 `at` seconds after `on_train_begin` ("end": at the last
    epoch's end) and restarts it 2 s later (in its `thread`)."""
    import keras

    class Kill(keras.callbacks.Callback):
        thread = None

        def _kill(self):
            cluster.kill_task("ps:0")
            _restart_later(cluster, "ps:0")

        def on_train_begin(self, logs=None):
            if at != "end":
                self.thread = threading.Timer(float(at), self._kill)
                self.thread.start()

        def on_epoch_end(self, epoch, logs=None):
            if at == "end" and epoch == self.params["epochs"] - 1:
                self.thread = threading.Thread(target=self._kill)
                self.thread.start()
                time.sleep(0.5)  # the end's own reads meet the lost PS

    return Kill()


def run_ps_any_time(args):
    """ps:0 SIGKILLed at each of `--kill-at` seconds of a `fit` (2 workers, 2 PS with
    variables split), restarted 2 s later, against the fault-free `fit`."""
    data, rows = setups.load_data("digits"), []
    for at in ["none"] + args.kill_at:
        with harness.local_cluster(2, 2, "separate") as cluster:
            strategy = _sharded_strategy(cluster, args.device_ms, n_sync=10)
            callbacks = [] if at == "none" else [_kill_at(cluster, at)]
            model, seconds, accuracy, error = _fit_or_error(strategy, data, 6, 400, callbacks)
            for c in callbacks:
                if c.thread is not None:
                    c.thread.join()
            rec = strategy.recoveries
            stats = strategy.model_stats(model) if model is not None else None
            row = {
                "killed_at_s": at, "completed": model is not None, "seconds": seconds,
                "test_accuracy": accuracy, "recoveries": len(rec),
                "rolled_back": sum(r.rolled_back for r in rec),
                "version_is_applied": stats is not None
                and int(strategy.counters.version.numpy()) == stats.applied == stats.windows,
                "applied_twice": _applied_twice(strategy.window_log(model)) if model else "",
                "error": error,
            }  # fmt: skip
        _append(rows, row)
    return rows, _table(rows)


def _restart_workers(cluster, stop, period, kills):
    """Until `stop`: every `period` s the next worker in turn is SIGKILLed, and restarted
    on its port 1 s later (in its own thread, so that kills keep their pace)."""
    i = 0
    while not stop.wait(period):
        task = f"worker:{i % cluster.num_workers}"
        cluster.kill_task(task)
        kills.append(task)
        threading.Thread(target=_restart_later, args=(cluster, task, 1.0), daemon=True).start()
        i += 1


def run_worker_restarts(args):
    """4 workers, 2 PS with variables split: each worker in turn SIGKILLed every `--periods`
    s and restarted 1 s later in a `fit` of about 75 s, against the fault-free `fit`."""
    data, rows = setups.load_data("digits"), []
    with harness.local_cluster(4, 2, "separate") as cluster:
        for period in [None] + args.periods:
            strategy = _sharded_strategy(cluster, args.device_ms, n_sync=10)
            stop, kills = threading.Event(), []
            chaos = threading.Thread(target=_restart_workers, args=(cluster, stop, period, kills))
            if period is not None:
                chaos.start()
            try:
                model, seconds, accuracy, error = _fit_or_error(strategy, data, 15, 1000, [])
            finally:
                stop.set()
                if period is not None:
                    chaos.join()
            time.sleep(3.0)  # the last restart
            _append(rows, {
                "period_s": period or "fault-free", "kills": len(kills),
                "completed": model is not None, "seconds": seconds,
                "samples_per_s": 15 * 1000 * 32 / seconds, "test_accuracy": accuracy,
                "recoveries": len(strategy.recoveries),
                "rolled_back": sum(r.rolled_back for r in strategy.recoveries),
                "applied_twice": _applied_twice(strategy.window_log(model)) if model else "",
                "error": error,
            })  # fmt: skip
    return rows, _table(rows)


# (PS tasks, workers, synchronous) of the chaos runs, in turn.
CHAOS_CONFIGS = (
    (2, 2, False), (3, 2, False), (2, 4, False), (2, 2, True), (3, 3, True), (3, 4, False),
)  # fmt: skip


def run_chaos_seeds(args):
    """`--runs` fits of 20 faults (`chaos.Chaos`, seeded with the run's index) on each of
    `CHAOS_CONFIGS` in turn, as tests/cluster/test_chaos_on_cluster.py runs one: per run the
    faults by kind and point, the recoveries, the invariant's violations, a NumPy replay."""
    from tf_asgd.cluster import chaos, fault_points
    from tf_asgd.runtime import push_journal

    data, rows = setups.load_data("digits"), []
    for seed in range(args.first_run, args.first_run + args.runs):
        faulthandler.dump_traceback_later(args.hang_s, exit=True)  # a hung run shows its stacks
        ps, workers, synchronous = CHAOS_CONFIGS[seed % len(CHAOS_CONFIGS)]
        with harness.local_cluster(workers, ps, "separate") as cluster:
            pids = set(cluster.pids().values())
            strategy = _sharded_strategy(
                cluster, args.device_ms, n_sync=5, snapshot_every=2.0, connect_timeout=60,
                synchronous=synchronous,
            )  # fmt: skip
            faults, error, t0 = None, "", time.perf_counter()
            broken, replay = ["no fit"], "n/a (synchronous)" if synchronous else ""
            initial = _initial_values_callback()
            journal = tempfile.mkdtemp(prefix="push_journal_")
            try:
                faults = chaos.Chaos(cluster, strategy, 20, seed)
                with push_journal.recording(journal):
                    model, _, accuracy = _user_fit(
                        strategy, data, 100_000, 40, [initial, faults], seed
                    )
                windows = chaos.windows_run(strategy, model)
                broken = chaos.violations(strategy, model, windows)
                asked = len(model.history.history["loss"]) * 40 // 5  # (asynchronous)
                if not synchronous and windows != asked:
                    broken.append(f"Keras asked for {asked} windows, the chief ran {windows}")
                if not synchronous:  # the central weights against a NumPy replay
                    found = push_journal.replay_violations(strategy, model, journal, initial.values)
                    replay = "; ".join(found)
                    broken += found
            except Exception as e:  # noqa: BLE001 - the row reports it
                accuracy, error = float("nan"), repr(e)[:1000]
                traceback.print_exc()  # where it came from, in the run's log
            finally:
                shutil.rmtree(journal, ignore_errors=True)
                pids |= set(cluster.pids().values())  # the tasks restarted too
        left = _left(pids)  # its wait counts in the row's seconds
        done = faults.done if faults else []
        _append(rows, {
            "seed": seed, "ps": ps, "workers": workers, "synchronous": synchronous,
            "seconds": time.perf_counter() - t0, "faults": len(done),
            **{k: sum(kind == k for kind, _ in done) for k in chaos.KINDS},
            **{p: faults.points.count(p) if faults else 0 for p in fault_points.POINTS},
            "ps_faults": sum(t.startswith("ps:") for _, ts in done for t in ts),
            "worker_faults": sum(t.startswith("worker:") for _, ts in done for t in ts),
            "recoveries": len(strategy.recoveries), "completed": not error,
            "violations": "; ".join(broken) if not error else "",
            "replay": replay if not error else "",
            "stalled": bool(faults and faults.stalled), "test_accuracy": accuracy,
            "processes_left": len(left),
            "error": error or repr((faults and faults.error) or "")[:200],
        })  # fmt: skip
    faulthandler.cancel_dump_traceback_later()
    by_kind = ", ".join(f"{k} {sum(r[k] for r in rows)}" for k in chaos.KINDS)
    by_kind += " (" + ", ".join(f"{p} {sum(r[p] for r in rows)}" for p in fault_points.POINTS) + ")"
    return rows, _table(rows) + [
        "",
        f"{sum(r['faults'] for r in rows)} faults ({by_kind}) over {len(rows)} runs: "
        f"{sum(bool(r['violations']) for r in rows)} run(s) broke the invariant, "
        f"{sum(not r['completed'] for r in rows)} stopped with an error, "
        f"{sum(r['stalled'] for r in rows)} stalled, "
        f"{sum(r['processes_left'] for r in rows)} process(es) left. Asynchronous runs "
        f"whose central weights equal the NumPy replay of their pushes: "
        f"{sum(r['replay'] == '' and r['completed'] and not r['synchronous'] for r in rows)}"
        f" of {sum(not r['synchronous'] for r in rows)}.",
    ]


def _initial_values_callback():
    """A callback that keeps the central variables' values as `fit` begins: the replay's start."""
    import keras

    from tf_asgd.runtime import push_journal

    class Initial(keras.callbacks.Callback):
        values = None

        def on_train_begin(self, logs=None):
            self.values = push_journal.initial_values(self.model)

    return Initial()


def _left(pids, wait_s=10.0):
    """The processes of `pids` still running `wait_s` after a cluster's close (a task
    stopped by SIGTERM takes a moment to exit); a zombie (exited, not reaped) is not."""

    def alive(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:  # Linux: the state follows the name
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + wait_s
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


RUNNERS = {
    "cost": run_cost,
    "faults": run_faults,
    "ps_any_time": run_ps_any_time,
    "worker_restarts": run_worker_restarts,
    "chaos_seeds": run_chaos_seeds,
}


def main(argv=None):
    p = harness.parser(__doc__, out=OUT, workers=[2, 4], seeds=[0, 1, 2], device_ms=[20.0])
    p.add_argument("--mode", type=harness.str_list, default=list(RUNNERS),
                   help="comma-separated, of: " + ",".join(RUNNERS))  # fmt: skip
    p.add_argument("--models", type=harness.str_list, default=["gem_convnet", "mlp"])
    p.add_argument("--setups", type=harness.str_list, default=list(setups.FAULT_SETUPS))
    p.add_argument("--rounds", type=int, default=3, help="cost: rounds of each setting")
    p.add_argument("--seconds", type=float, default=20.0, help="cost: seconds per fit")
    p.add_argument("--noise-floor", action="store_true", help="faults: each fault-free fit again")
    p.add_argument("--kill-at", type=harness.str_list,
                   default=["0", "0.5", "1", "2", "4", "8", "12", "16", "20", "end"],
                   help="ps_any_time: seconds after on_train_begin, or end")  # fmt: skip
    p.add_argument("--runs", type=int, default=25, help="chaos_seeds: fits of 20 faults")
    p.add_argument("--first-run", type=int, default=0, help="chaos_seeds: the first run's seed")
    p.add_argument("--hang-s", type=float, default=900.0,
                   help="chaos_seeds: a run this long is hung: stacks printed, exit 1")  # fmt: skip
    p.add_argument("--periods", type=harness.float_list, default=[12.0, 4.0],
                   help="worker_restarts: seconds between worker kills")  # fmt: skip
    p.add_argument("--synchronous", action="store_true", help="cost, faults: synchronous rounds")
    args = p.parse_args(argv)
    args.device_ms = harness.single(p, args, "device_ms")  # emulated device ms a batch
    if bad := set(args.mode) - set(RUNNERS):
        p.error(f"unknown --mode {sorted(bad)}; choose from {tuple(RUNNERS)}")
    report = ["# PS recovery: snapshot cost, faults and chaos", ""]
    for mode in args.mode:
        rows, lines = RUNNERS[mode](args)
        harness.write_csv(f"{args.out}/{mode}.csv", rows)
        report += [f"## {mode}", "", *lines, ""]
    harness.write_lines(f"{args.out}/tables.md", report)
    print("\n".join(report))
