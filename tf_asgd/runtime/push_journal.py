"""What each push carried, written to files while a test records it, and its NumPy replay.

Off in production: with nothing recorded, no op is added to the trace. A test records
(`recording`) around the `fit` it checks, and the window is traced inside the block:
- each worker writes the update of each window it pushes (its floating variables,
  flattened, as float64), keyed by the window's id and the version it pulled, before it
  sends it;
- the counters' PS writes, under each push's ticket, which window and pulled version
  that ticket applied (a ticket used again after a rollback is written again).

`replay` applies tickets 0 to `version - 1` in ticket order with the pure rule
(`staleness.ps_push`) from the weights before the `fit`: where the outer optimizer's
writes commute (asynchronous pushes, no momentum on the PS), the central weights must
equal it (`replay_violations`).
"""

import contextlib
import glob
import os

import numpy as np
import tensorflow as tf

from tf_asgd.rules import staleness
from tf_asgd.runtime import push

_directory = []  # the directory being recorded to, if any


@contextlib.contextmanager
def recording(directory):
    """Records every push traced inside the block to files in `directory`.

    Example:

    ```python
    with push_journal.recording(tmp_path):
        model.fit(...)
    ```
    """
    os.makedirs(directory, exist_ok=True)
    _directory.append(os.fspath(directory))
    try:
        yield
    finally:
        _directory.pop()


def _name(kind, *numbers):
    """`<directory>/<kind>-<number>-...`, a string tensor."""
    parts = [tf.strings.as_string(n) for n in numbers]
    return tf.strings.join([os.path.join(_directory[-1], kind)] + parts, "-")


def _write_if(condition, path, contents):
    """An op that writes `contents` to `path` where `condition` holds (None: always)."""

    def write():
        with tf.control_dependencies([tf.io.write_file(path, contents)]):
            return tf.constant(True)

    if condition is None:
        return write()
    return tf.cond(condition, write, lambda: tf.constant(False))


def worker_record(meta, updates):
    """On the worker: ops that write the window's update where it is pushed (`meta.ok`),
    named by its id, its pulled version and the time; none when nothing is recorded.

    Args:
        meta: the window's `records.PushMeta`.
        updates: one update per central variable (the push's, uncompressed).
    """
    if not _directory:
        return []
    flat = [tf.reshape(tf.cast(u, tf.float64), [-1]) for u in updates if u.dtype.is_floating]
    when = tf.strings.as_string(tf.timestamp(), precision=6)
    path = tf.strings.join([_name("u", meta.window_id, meta.version), when], "-")
    return [_write_if(meta.ok, path, tf.io.serialize_tensor(tf.concat(flat, 0)))]


def ticket_record(meta, tau, push):
    """On the counters' PS, under the push's ticket: ops that write which window and
    pulled version the ticket applied (`push`: None, or whether it was pushed); none
    when nothing is recorded."""
    if not _directory:
        return []
    ticket = meta.version + tau
    contents = tf.strings.format("{} {}", (meta.window_id, meta.version))
    return [_write_if(push, _name("t", ticket), contents)]


def _updates(directory):
    """`{(window id, pulled version): path}` of the workers' records, the latest of each."""
    latest = {}
    for path in glob.glob(os.path.join(directory, "u-*")):
        _, window, version, when = os.path.basename(path).split("-")
        key = (int(window), int(version))
        if key not in latest or float(when) > latest[key][0]:
            latest[key] = (float(when), path)
    return {k: p for k, (_, p) in latest.items()}


def replay(directory, initial, dtypes, version, outer, rule, max_staleness, num_workers):
    """The central variables after tickets 0 to `version - 1`, replayed in ticket order.

    Args:
        directory: what `recording` wrote.
        initial: the floating central variables' values before the first push (arrays, in
            the order of the push's updates).
        dtypes: their dtypes.
        version: the PS's version counter after the `fit`.
        outer, rule, max_staleness, num_workers: the push's outer optimizer, staleness
            rule, staleness bound and worker count (`staleness.ps_push`).

    Returns:
        `(values, missing)`: the replayed values, and the tickets without a record (the
        replay skips them).
    """
    updates = _updates(directory)
    values = [np.array(v, dtype=d) for v, d in zip(initial, dtypes)]
    states = [{} for _ in values]
    sizes = [v.size for v in values]
    missing = []
    for ticket in range(version):
        path = os.path.join(directory, f"t-{ticket}")
        if not os.path.exists(path):
            missing.append(ticket)
            continue
        with open(path) as f:
            window, pulled = (int(s) for s in f.read().split())
        if (window, pulled) not in updates:
            missing.append(ticket)
            continue
        raw = tf.io.read_file(updates[(window, pulled)])
        flat = tf.io.parse_tensor(raw, tf.float64).numpy()
        pieces = np.split(flat, np.cumsum(sizes)[:-1])
        for i, piece in enumerate(pieces):
            update = piece.reshape(values[i].shape).astype(values[i].dtype)
            values[i], states[i] = staleness.ps_push(
                values[i],
                update,
                ticket - pulled,
                ticket,
                states[i],
                rule,
                max_staleness,
                outer,
                num_workers,
            )
    return values, missing


def _why_missing(directory, tickets):
    """`{ticket: what is missing}`: the PS's record of the ticket, or the worker's record of
    the window it names (by its id and pulled version)."""
    why = {}
    for ticket in tickets:
        path = os.path.join(directory, f"t-{ticket}")
        if not os.path.exists(path):
            why[ticket] = "no ticket record"
            continue
        with open(path) as f:
            window, pulled = f.read().split()
        recorded = sorted(
            int(os.path.basename(u).split("-")[2])
            for u in glob.glob(os.path.join(directory, f"u-{window}-*"))
        )
        why[ticket] = f"no update of window {window} pulled at {pulled} (recorded: {recorded})"
    return why


def initial_values(model):
    """The central variables' values before `model`'s first push, in the order the push
    carries them (trainable, then non-trainable): `replay_violations`'s `initial`."""
    return [np.asarray(push.read(push.raw(v))) for v in model.trainable_variables] + [
        np.asarray(push.read(push.raw(v))) for v in model.non_trainable_variables
    ]


def replay_violations(strategy, model, directory, initial, atol=1e-5):
    """Whether `model`'s central weights equal a NumPy replay, in ticket order, of the
    pushes a `recording(directory)` recorded during its asynchronous `fit`
    (from `initial`, `initial_values` before it), where the PS's writes commute: an
    outer optimizer without momentum.

    Returns:
        A list of sentences, empty where they are equal to `atol` and every ticket
        applied has its record.
    """
    trainer = strategy.model_states.get(model).trainer
    outer = trainer.outer
    if getattr(strategy, "synchronous", False) or outer.slots:
        raise ValueError("A replay in ticket order needs asynchronous pushes that commute.")
    floats = [i for i, v in enumerate(trainer.variables) if np.dtype(v.dtype).kind == "f"]
    version = int(strategy.counters.version.numpy())
    values, missing = replay(
        directory,
        [initial[i] for i in floats],
        [np.dtype(trainer.variables[i].dtype) for i in floats],
        version,
        outer,
        strategy.staleness,
        strategy.max_staleness,
        strategy.num_workers,
    )
    found = [f"tickets without a record: {_why_missing(directory, missing)}"] if missing else []
    momenta = trainer.moving_average_momenta
    for i, expected in zip(floats, values):
        if momenta[i] is not None:  # a moving average's push has its own rule
            continue
        v = trainer.variables[i]
        actual = np.asarray(push.read(push.raw(v)))
        error = float(np.max(np.abs(actual - expected))) if actual.size else 0.0
        if not error <= atol:
            found.append(
                f"{v.path}: {error:.3g} from the replay of {version} pushes (tolerance {atol:g})"
            )
    return found
