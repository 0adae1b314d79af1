"""The floor of one push on TF's distributed runtime: no model, no window logic.

A worker and a PS on loopback; one `tf.function` on the worker runs a `tf.while_loop`
whose iterations run one body: `local`, `round_trip` (`--elements` floats to the PS and
back), `push_pull` (what a push and a pull do there), `push_pull_x2` / `push_pull_x4`
(that body 2 or 4 times per iteration). Reports per round trip the wall time and the CPU
time of the task processes and of the chief, medians over alternating rounds. No tf_asgd
window can be cheaper than `push_pull`. Method: docs/benchmarks.md (How each suite measures).

Writes `push_floor.csv` and `push_floor.md` to `--out`.

    python -m benchmarks.run push_floor --iterations 200 --rounds 1
"""

import os
import statistics
import time

from benchmarks import harness

OUT = "results/push_floor"  # the default --out

BODIES = ("local", "round_trip", "push_pull", "push_pull_x2", "push_pull_x4")


def loop_function(body, ps_device, variable, counter, elements):
    """The loop of `body`: returns `(run, repeats)`, `run` a `tf.function(n)`
    that runs `n` round trips (a multiple of `repeats`, the round trips one
    iteration writes) on the caller's device, the worker, with the PS part
    on `ps_device`, and returns a scalar."""
    import tensorflow as tf

    repeats = int(body.rsplit("_x", 1)[1]) if "_x" in body else 1

    def push_pull(x):
        with tf.device(ps_device):
            ticket = counter.assign_add(1)
            with tf.control_dependencies([variable.assign_add(tf.identity(x), read_value=False)]):
                pulled = variable.read_value() + tf.cast(ticket, tf.float32) * 0.0
        return tf.identity(pulled) * 0.5

    def step(x):
        if body == "local":
            return x * 0.5
        if body == "round_trip":
            with tf.device(ps_device):
                y = tf.identity(x) + 1.0
            return tf.identity(y) * 0.5
        for _ in range(repeats):
            x = push_pull(x)
        return x

    @tf.function
    def run(n):
        _, x = tf.while_loop(
            lambda i, x: i < n,
            lambda i, x: (i + repeats, step(x)),
            (tf.constant(0), tf.zeros([elements])),
            parallel_iterations=1,
        )
        return x[0]

    return run, repeats


def measure(args):
    """Rows of the table: one per body, medians over the rounds."""
    import tensorflow as tf

    samples = {b: [] for b in args.bodies}
    with harness.local_cluster(1, 1, processes=args.processes) as cluster:
        hosts = set(cluster.pids().values())
        strategy = tf.distribute.experimental.ParameterServerStrategy(cluster.resolver)
        coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            variable = tf.Variable(tf.zeros([args.elements]))
            counter = tf.Variable(tf.constant(0, tf.int64))
        functions = {
            b: loop_function(b, variable.device, variable, counter, args.elements)
            for b in args.bodies
        }

        pushes = [0]  # what the counter must read: the push bodies' round trips

        def timed(body, iterations):
            fn, repeats = functions[body]
            n = max(repeats, iterations - iterations % repeats)
            pushes[0] += n if body.startswith("push_pull") else 0
            h0, c0 = sum(map(harness.cpu_seconds, hosts)), time.process_time()
            t0 = time.perf_counter()
            coordinator.schedule(fn, args=(tf.constant(n),)).fetch()
            dt = time.perf_counter() - t0
            host, chief = sum(map(harness.cpu_seconds, hosts)) - h0, time.process_time() - c0
            return dict(us=1e6 * dt / n, host_cpu_us=1e6 * host / n, chief_cpu_us=1e6 * chief / n)

        for body in args.bodies:  # traces and warms up each function once
            timed(body, 8)
        for _ in range(args.rounds):
            for body in args.bodies:
                samples[body].append(timed(body, args.iterations))
        if int(counter.numpy()) != pushes[0]:  # every round trip really pushed
            raise RuntimeError(
                f"the PS counted {int(counter.numpy())} pushes, expected {pushes[0]}"
            )
    rows = []
    for body in args.bodies:
        med = {k: statistics.median(s[k] for s in samples[body]) for k in samples[body][0]}
        rows.append(
            dict(
                body=body,
                processes=args.processes,
                elements=args.elements,
                iterations=args.iterations,
                rounds=args.rounds,
                us_per_round_trip=med["us"],
                host_cpu_us_per_round_trip=med["host_cpu_us"],
                chief_cpu_us_per_round_trip=med["chief_cpu_us"],
                round_trips_per_s=1e6 / med["us"],
            )
        )
        print(rows[-1], flush=True)
    return rows


def markdown(rows, args):
    lines = [
        f"One worker and one PS on loopback ({args.processes} process mode), tensors of "
        f"{args.elements} floats, loops of {args.iterations} iterations, medians of "
        f"{args.rounds} round(s); {os.cpu_count()} CPU cores. Per round trip (per "
        "iteration for `local`); host CPU is the worker's and the PS's processes.",
        "",
    ]
    lines += harness.markdown_table(
        ["body", "us", "round trips/s", "host CPU us", "chief CPU us"],
        [
            [
                r["body"],
                f"{r['us_per_round_trip']:.0f}",
                f"{r['round_trips_per_s']:.0f}",
                f"{r['host_cpu_us_per_round_trip']:.0f}",
                f"{r['chief_cpu_us_per_round_trip']:.0f}",
            ]
            for r in rows
        ],
    )
    return lines


def main(argv=None):
    p = harness.parser(__doc__, out=OUT)
    p.add_argument("--processes", default="shared", choices=("shared", "separate"))
    p.add_argument("--elements", type=int, default=1000, help="floats each way per round trip")
    p.add_argument("--iterations", type=int, default=2000, help="loop iterations per measurement")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bodies", type=harness.str_list, default=list(BODIES))
    args = p.parse_args(argv)
    bad = [b for b in args.bodies if b not in BODIES]
    if bad:
        p.error(f"unknown --bodies {bad}; choose from {list(BODIES)}")
    if args.iterations < 4 or args.rounds < 1 or args.elements < 1:
        p.error("--iterations must be >= 4, --rounds and --elements >= 1")
    rows = measure(args)
    os.makedirs(args.out, exist_ok=True)
    harness.write_csv(os.path.join(args.out, "push_floor.csv"), rows)
    harness.write_lines(os.path.join(args.out, "push_floor.md"), markdown(rows, args))
    print("\n".join(markdown(rows, args)))
    return 0
