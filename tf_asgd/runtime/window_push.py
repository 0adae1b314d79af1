"""A window's round on the PS: push, skip or replay its update, then pull for the next one.

`PushRound.run` is the phase of `window.WindowFunction` after the outgoing update, in
three steps: `_send` (the update and its `records.PushMeta`, one transfer), `_apply` (the
PS's writes, gated by `PushMeta.ok`: `push.CentralVariables.apply`) and `_next_pull` (each
PS reads the next window's pull after its writes of this push).
"""

import tensorflow as tf

from tf_asgd.runtime import push_journal
from tf_asgd.runtime.push import CentralVariables, PushGate, Transfer, branch_free, update_specs
from tf_asgd.runtime.records import PushMeta


class PushRound:
    """One window's round on the PS, traced once per window of a closure.

    The update travels with its `records.PushMeta`; `ok` (finite, not a
    replay) decides on the PS (`push.CentralVariables.apply`):

    - push: the ticket is taken only once the whole update is on the PS;
      under it, the update, the step counts and the window's id in the
      applied ring are written;
    - skip (`bad`: the update holds NaN/Inf): count it in
      `dropped_nonfinite`;
    - replay: nothing.

    Then, if `has_next`, each PS reads the next window's pull after its
    writes of this push.

    Args:
        trainer: the `scheduling.WindowTrainer`. Read from it: `strategy`,
            `variables`, `outer` and `outer_slots`.
        state: the `window_state.WindowState` (codec, step counters, EMA
            averages, applied ring).
        pull: the closure's `push.Pull`.
    """

    def __init__(self, trainer, state, pull):
        strategy = trainer.strategy
        self._state, self._pull, self._cdev = state, pull, pull.cdev
        self._variables, self._counters = trainer.variables, strategy.counters
        self._free = branch_free(trainer.outer_slots)
        self._central = CentralVariables(
            trainer.variables,
            strategy.counters,
            strategy.staleness,
            strategy.max_staleness,
            trainer.outer,
            trainer.outer_slots,
            strategy.num_workers,
            trainer.scheduler.concurrent_pushes,
            commits=trainer.commits,
            moving_average_momenta=trainer.moving_average_momenta,
        )

    def run(self, outgoing, meta):
        """Pushes, skips or replays the window, then pulls for the next one.

        Args:
            outgoing: the window's `window_state.Outgoing`.
            meta: its `records.PushMeta`, on the worker.

        Returns:
            `(tau, flats)` on the worker: the push's staleness (-1 when not
            pushed) and the next pull's flat tensors (`push.Pull`).
        """
        payloads = outgoing.payloads
        if payloads is None:  # uncompressed: each piece as it is
            payloads = update_specs(self._variables, outgoing.update)
            payloads = [(s, (p,)) for s, p in payloads]
        # A test may record the update before it leaves (off in production).
        with tf.control_dependencies(push_journal.worker_record(meta, outgoing.update)):
            arrived, landed, meta, flags = self._send(payloads, meta)
        tau, done = self._apply(payloads, arrived, landed, meta)
        return self._next_pull(meta, flags, tau, done)

    def _send(self, payloads, meta):
        """The payloads, the packed `meta` and, for every other PS of the
        pull, `has_next`, to the PS in one transfer. Returns `(arrived,
        landed, meta, flags)`: the payloads' tensors on their PS, the flat
        tensors as they landed, `meta` unpacked on the counters' PS, and per
        other PS its `has_next` there (uint8)."""
        pieces = [(s, t) for s, payload in payloads for t in payload]  # what crosses to the PS
        others = [d for d in self._pull.transfer.devices() if d != self._cdev]
        tensors = [p for _, p in pieces]
        if self._free:  # what is not pushed must add exactly 0 (NaN-safe); zeros only then
            tensors = tf.cond(meta.ok, lambda: tensors, lambda: [tf.zeros_like(p) for p in tensors])
        packed = meta.pack()
        tensors = list(tensors) + [packed] + [tf.cast(meta.has_next, tf.uint8) for _ in others]
        transfer = Transfer(
            [(s.device, p.shape, p.dtype) for s, p in pieces]
            + [(self._cdev, packed.shape, tf.int64)]
            + [(d, [], tf.uint8) for d in others]
        )
        arrived, landed = transfer.send(tensors)
        with tf.device(self._cdev):  # (a slice made elsewhere would travel)
            meta = PushMeta.unpack(arrived[len(pieces)])
        flags = dict(zip(others, arrived[len(pieces) + 1 :]))
        return arrived[: len(pieces)], landed, meta, flags

    def _apply(self, payloads, arrived, landed, meta):
        """The PS's writes of the push (or of its skip), then the central
        variables' EMA (`use_ema`). Returns `(tau, done)` on the counters'
        PS: the push's staleness, once every write is done, and a tensor
        that exists once the EMA's writes are done too."""
        counters = self._counters

        def skipped():
            counted = counters.dropped_nonfinite.assign_add(
                tf.cast(meta.bad, tf.int64), read_value=False
            )
            with tf.control_dependencies([counted]):
                return tf.constant(-1, tf.int64)

        gate = PushGate(
            ok=meta.ok,
            skipped=skipped,
            writes=lambda tau, push: self._writes(meta, tau, push),
            steps=meta.steps,
        )
        updates = self._state.codec.decode(payloads, arrived)  # each on its PS
        _, tau = self._central.apply(updates, landed, meta.version, gate)
        done = tau
        averages = self._state.averages
        if averages:  # the EMA of the central variables after this push
            with tf.device(self._cdev):
                advances = meta.advances * tf.cast(meta.ok, tf.int64)
                ticket = meta.version + tau
            ema = [op for a in averages for op in a.update(advances[a.index], ticket, tau)]
            with tf.device(self._cdev), tf.control_dependencies(ema):
                done = tf.identity(tau)
        return tau, done

    def _writes(self, meta, tau, push):
        """The push's writes beside the variables (`PushGate.writes`): the
        step counters' advances and the window's id in the applied ring.
        `push`: None when they run only for a push, else `meta.ok`
        (branch-free: no change unless pushed)."""
        # Like the variables, the step count and the window's id are
        # written only once the whole update has reached the PS.
        counters = self._state.counted_steps()
        with tf.device(self._cdev):
            advances = meta.advances
            if push is not None:
                advances = advances * tf.cast(push, tf.int64)
            ops = [self._state.mark_applied(meta.window_id, push)]
            ops += push_journal.ticket_record(meta, tau, push)  # (tests only)
        for i, counter in enumerate(counters):
            with tf.device(counter.device):
                ops.append(
                    counter.assign_add(tf.cast(advances[i], counter.dtype), read_value=False)
                )
        return ops

    def _next_pull(self, meta, flags, tau, done):
        """Each PS reads the next window's pull if `has_next`, after every
        write of the push (`tau` waits for them all; the step counter read
        here may live on another PS than it is written from). Returns `(tau,
        flats)` on the worker, `tau` once `done`."""
        pull, flats = self._pull, []
        for d in pull.transfer.devices():
            with tf.device(d), tf.control_dependencies([tau.op]):
                go = meta.has_next if d == self._cdev else flags[d] > 0
                flats += tf.cond(
                    go,
                    lambda d=d: pull.read(meta.next_id, d),
                    lambda d=d: pull.transfer.empty(d),
                )
        return pull.to_worker(flats, done)
