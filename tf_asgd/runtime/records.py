"""What a window reports, and the metadata its pull and push carry, each with names.

A window's result is one float64 row, and a closure of `K` windows returns their rows as
one `[windows run, size]` tensor, so that the chief fetches a closure's results in one
copy. `WindowResultLayout` defines a row once, for both sides: the worker packs it (`pack`,
TF ops) and the chief unpacks it (`unpack`, NumPy) into a `WindowRecord`. Layout: the
header fields `HEADER`, then each metric variable's delta, then GEM's pi statistics.

`PullMeta` (PS to worker, with the pull) and `PushMeta` (worker to PS, with the update)
travel as one int64 vector each: only their `pack` and `unpack` know the positions.
"""

import typing

import numpy as np
import tensorflow as tf


class WindowRecord(typing.NamedTuple):
    """What the chief learns of each finished window (`strategy.window_log`).

    A `typing.NamedTuple`; `strategy.window_results(model, record)` turns its
    metric state into metric results.

    Attributes:
        worker: index of the worker that ran it.
        pushed: False where its update held NaN/Inf and was not pushed.
        staleness: tau of its push (pushes committed between its pull and its
            push); -1 if not pushed.
        loss: mean training loss over the window's steps.
        seen_at: `time.perf_counter()` on the chief when it saw the window done.
        finished_at: `time.time()` on the worker once its push was applied.
        state: the window's own metric states (their changes over the window).
        pi: with GEM, a `[n_trainable, 3]` array of pi's mean, fraction
            clipped at 0 and fraction clipped at `pi_max`; else None.
        replayed: True for a re-run (after a worker died) of a window whose
            earlier attempt had already pushed: this attempt ran no steps and
            pushed nothing.
        started_at: `time.time()` on the worker when the window started (NaN
            where unknown).
        window_id: the chief's id of the window, unique; a re-run keeps it
            (-1 where unknown).
        samples: the samples its local steps trained on (the batches' sizes
            summed; 0 for a replay).
        rolled_back: True where a parameter server's recovery undid its push
            (it was applied after the snapshot the cluster went back to).

    Example:

    ```python
    log = strategy.window_log(model)
    pushed = [r for r in log if r.pushed and not r.replayed]
    print(max(r.staleness for r in pushed), strategy.window_results(model, log[-1]))
    ```
    """

    worker: int  # index of the worker that ran it
    pushed: bool  # False: its update held NaN/Inf and was not pushed
    staleness: int  # tau of its push (pushes committed since its pull); -1 if not pushed
    loss: float  # mean training loss over the window's steps
    seen_at: float  # time.perf_counter() on the chief when it saw the window done
    finished_at: float  # time.time() on the worker once its push was applied
    state: tuple  # the window's own metric states (deltas), see WindowLog.window_results
    pi: typing.Optional[np.ndarray]  # GEM: [n_trainable, 3] pi mean, frac at 0, frac at pi_max
    # True: a re-run (after a worker died) of a window whose earlier attempt
    # had already pushed; this attempt ran no steps and pushed nothing.
    replayed: bool = False
    started_at: float = float("nan")  # time.time() on the worker when the window started
    window_id: int = -1  # the chief's id of the window (unique; a re-run keeps it)
    samples: int = 0  # samples its local steps trained on (0 for a replay)
    rolled_back: bool = False  # its push was undone by a PS's recovery (ps_recovery.py)


class WindowResultLayout:
    """The layout of the tensor a window returns, shared by packer and unpacker.

    Args:
        metric_values: the model's metric variable values (NumPy arrays);
            only their shapes and dtypes are used.
        has_pi: whether the pi statistics are kept (a push rule is in use).
    """

    # worker: its index; pushed: the update is in the central variables, once
    # (true also for a replay); replayed: see WindowRecord; finished_at: the
    # worker's time.time() after the push; staleness: tau, -1 if not pushed;
    # started_at: the worker's time.time() when the window started; samples:
    # the batches' sizes summed over its local steps.
    HEADER = ("worker", "pushed", "replayed", "finished_at", "staleness", "started_at", "samples")

    def __init__(self, metric_values, has_pi, num_trainable=0):
        self.metric_specs = [(np.shape(m), np.asarray(m).dtype) for m in metric_values]
        self.has_pi = has_pi
        self._slices, at = [], len(self.HEADER)  # each metric's part of a row
        for shape, _ in self.metric_specs:
            self._slices.append((at, at + int(np.prod(shape))))
            at = self._slices[-1][1]
        # Elements of one window's row (a closure returns `[windows, size]`).
        self.size = (
            len(self.HEADER)
            + sum(int(np.prod(s)) for s, _ in self.metric_specs)
            + (3 * num_trainable if has_pi else 0)
        )

    def pack(self, header, metric_deltas, pi_stats):
        """The window's result as one float64 tensor (TF ops, on the worker).

        Args:
            header: a dict with one scalar tensor per name in `HEADER`.
            metric_deltas: one tensor per metric variable, its change over
                the window.
            pi_stats: a `[n_trainable, 3]` tensor (`[0, 3]` without a push rule).

        Returns:
            A 1-D float64 tensor.
        """
        if set(header) != set(self.HEADER):
            raise ValueError(f"header must name exactly {self.HEADER}, got {sorted(header)}.")
        parts = [tf.reshape(tf.cast(header[name], tf.float64), [1]) for name in self.HEADER]
        parts += [tf.reshape(tf.cast(d, tf.float64), [-1]) for d in metric_deltas]
        parts.append(tf.reshape(tf.cast(pi_stats, tf.float64), [-1]))
        return tf.concat(parts, axis=0)

    def unpack(self, packed):
        """Splits a fetched result (on the chief).

        Args:
            packed: the 1-D array a window returned.

        Returns:
            `(header, metric_deltas, pi)`: a dict of the header's floats by
            name, the metric deltas in their shapes and dtypes, and the pi
            statistics as `[n_trainable, 3]` (None without a push rule).
        """
        packed = np.asarray(packed)
        header = dict(zip(self.HEADER, packed[: len(self.HEADER)].tolist()))
        deltas = [
            packed[a:b].reshape(shape).astype(dtype)
            for (a, b), (shape, dtype) in zip(self._slices, self.metric_specs)
        ]
        pi = (
            packed[self._slices[-1][1] if self._slices else len(self.HEADER) :].reshape(-1, 3)
            if self.has_pi
            else None
        )
        return header, deltas, pi


def _int64_scalars(record, names):
    """`record`'s fields `names`, each an int64 scalar tensor (bools as 0 or 1)."""
    return [tf.cast(getattr(record, name), tf.int64) for name in names]


class PullMeta(typing.NamedTuple):
    """The metadata of a window's pull, read on the counters' PS (`push.Pull`).

    Travels to the worker as one int64 vector (`pack`), the pull's first
    tensor; `unpack` reads it there (TF ops, on the caller's device).

    Attributes:
        tau: int64, the previous push's staleness. Packed as -1 on the PS and
            filled in on the way to the worker (`push.Pull.to_worker`, at
            `field_bytes("tau")`), once the push it belongs to is done.
        replayed: bool, whether the window already pushed (a replay: it runs
            nothing and pushes nothing).
        version: int64, the PS version counter at pull time.
    """

    tau: typing.Any
    replayed: typing.Any
    version: typing.Any

    @classmethod
    def size(cls):
        """Elements of the packed vector."""
        return len(cls._fields)

    @classmethod
    def field_bytes(cls, name):
        """`(start, stop)`: the bytes of field `name` in the packed vector."""
        at = cls._fields.index(name) * tf.int64.size
        return at, at + tf.int64.size

    def pack(self):
        """The fields as one int64 vector of `size()` elements."""
        return tf.stack(_int64_scalars(self, self._fields))

    @classmethod
    def unpack(cls, packed):
        """The record of a packed vector; `replayed` as a bool."""
        fields = dict(zip(cls._fields, (packed[i] for i in range(cls.size()))))
        return cls(**dict(fields, replayed=fields["replayed"] > 0))


class PushMeta(typing.NamedTuple):
    """The metadata of a window's push, sent with its update to the counters' PS.

    Travels as one int64 vector (`pack`, on the worker); `unpack` reads it on
    the PS (call it under `tf.device` of that PS: a slice made elsewhere
    would travel). `advances` ends the vector, one element per step counter.

    Attributes:
        window_id: int64, the window's id (its slot in the applied ring).
        version: int64, the PS version counter the window pulled.
        ok: bool, push (the update is finite and the window not a replay).
        bad: bool, the update holds NaN/Inf (not a replay): counted as skipped.
        next_id: int64, the next window's id (its pull's replay check).
        has_next: bool, whether a next window follows (its pull is read).
        steps: int64, the window's local steps (0 for a replay).
        advances: int64 `[counters]`, how far the window advances each step
            counter the push writes (the local optimizer's first).
    """

    window_id: typing.Any
    version: typing.Any
    ok: typing.Any
    bad: typing.Any
    next_id: typing.Any
    has_next: typing.Any
    steps: typing.Any
    advances: typing.Any

    SCALARS = ("window_id", "version", "ok", "bad", "next_id", "has_next", "steps")
    BOOLS = ("ok", "bad", "has_next")

    @classmethod
    def size(cls, num_counters):
        """Elements of the packed vector, for `num_counters` step counters."""
        return len(cls.SCALARS) + num_counters

    def pack(self):
        """The fields as one int64 vector of `size(len(advances))` elements."""
        advances = tf.reshape(tf.cast(self.advances, tf.int64), [-1])
        return tf.concat([tf.stack(_int64_scalars(self, self.SCALARS)), advances], 0)

    @classmethod
    def unpack(cls, packed):
        """The record of a packed vector: bools as bools, `advances` a vector."""
        fields = {name: packed[i] for i, name in enumerate(cls.SCALARS)}
        fields.update({name: fields[name] > 0 for name in cls.BOOLS})
        return cls(**fields, advances=packed[len(cls.SCALARS) :])
