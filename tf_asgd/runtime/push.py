"""The PS side of a window: reading central variables and applying a push.

`CentralVariables` is where every update reaches the central variables (`push` from a
worker's tensors, `apply` once they have arrived): it is staged on every PS first, then
the version ticket is taken and the outer optimizer applies
`staleness.staleness_scale(tau) * update` where each variable (or shard) lives.
"""

import contextlib
import dataclasses
import typing

import numpy as np
import tensorflow as tf
import tensorflow.experimental.numpy as tnp
from keras import Variable

from tf_asgd import internals
from tf_asgd.cluster import fault_points
from tf_asgd.rules import compression as codecs
from tf_asgd.rules import outer, outer_optimizers, staleness
from tf_asgd.runtime.records import PullMeta


def raw(v):
    """The `tf.Variable` behind a Keras variable."""
    return v.value if isinstance(v, Variable) else v


def nbytes(variables, compression=None):
    """Bytes of `variables` (Keras or TF variables), as one pull reads them
    under the pull's `compression` (`"none"` or `"bf16"`; default none)."""
    return int(
        sum(
            np.prod(s.shape) * pull_dtype(s.dtype, compression).size
            for v in variables
            for s in shard_variables(raw(v))
        )
    )


def compressible(dtype):
    """Whether values of `dtype` may be compressed, either way: float32 only
    (other floats are small already; integers must stay exact)."""
    return tf.as_dtype(dtype) == tf.float32


def pull_dtype(dtype, compression=None):
    """The dtype a variable of `dtype` travels in to the worker: bfloat16 for
    float32 under a `"bf16"` pull, else its own."""
    bf16 = compression is not None and compression.codec == "bf16"
    return tf.bfloat16 if bf16 and compressible(dtype) else tf.as_dtype(dtype)


def read(raw_variable):
    """The value of a (possibly sharded) PS variable."""
    if internals.is_sharded(raw_variable):
        return tf.concat([s.read_value() for s in raw_variable.variables], axis=0)
    return raw_variable.read_value()


def shards(raw_variable, value):
    """`(variable, slice of value)` per PS shard of a (possibly sharded) variable."""
    if internals.is_sharded(raw_variable):
        sizes = [s.shape[0] for s in raw_variable.variables]
        return list(zip(raw_variable.variables, tf.split(value, sizes, axis=0)))
    return [(raw_variable, value)]


def shard_variables(raw_variable):
    """The PS variables that hold a (possibly sharded) variable."""
    if internals.is_sharded(raw_variable):
        return list(raw_variable.variables)
    return [raw_variable]


def device_of(raw_variable):
    """The device of a (possibly sharded) variable's first piece."""
    if internals.is_sharded(raw_variable):
        return raw_variable.variables[0].device
    return raw_variable.device


FUSE_MAX_ELEMENTS = 1 << 16  # larger tensors travel alone (fusing them would only copy)


class Transfer:
    """How a list of tensors travels between the worker and the PS tasks.

    Each cross-task tensor is an RPC whose fixed cost outweighs its bytes for
    a small model, so the small tensors of one device travel together, as
    one byte vector (`tf.bitcast`, exact for every dtype); each large one
    travels alone. `gather` makes the flat tensors where the tensors are,
    `scatter` restores the tensors where the flat ones arrived.

    Args:
        specs: `(device, shape, dtype)` per tensor: the PS device it comes
            from or goes to (the other end is the worker).
    """

    def __init__(self, specs):
        self.specs = [(d, tf.TensorShape(s), tf.as_dtype(t)) for d, s, t in specs]
        self.groups = []  # (device, indices, packed)
        small = {}
        for i, (device, shape, _) in enumerate(self.specs):
            if shape.num_elements() > FUSE_MAX_ELEMENTS:
                self.groups.append((device, [i], False))
            else:
                if device not in small:
                    small[device] = []
                    self.groups.append((device, small[device], True))
                small[device].append(i)
        order = list(dict.fromkeys(d for d, _, _ in self.groups))  # each device's groups together
        self.groups.sort(key=lambda g: order.index(g[0]))

    def devices(self):
        """The PS devices, in order of their first group."""
        return list(dict.fromkeys(d for d, _, _ in self.groups))

    def gather(self, tensors, device=None):
        """The flat tensors of the groups of `device` (all groups: None), in
        group order, made from `tensors` (one per spec, None where unused)."""
        out = []
        for d, idx, packed in self.groups:
            if device is None or d == device:
                parts = [tensors[i] for i in idx]
                out.append(
                    tf.concat([_to_bytes(t) for t in parts], 0)
                    if packed
                    else tf.reshape(parts[0], [-1])
                )
        return out

    def empty(self, device):
        """Flat tensors of no elements, like `gather(..., device)` makes."""
        return [
            tf.zeros([0], tf.uint8 if packed else self.specs[idx[0]][2])
            for d, idx, packed in self.groups
            if d == device
        ]

    def scatter(self, flats, on_devices=False):
        """The tensors from the flat tensors of every group, in spec order;
        with `on_devices`, each group is unpacked on its PS (else on the
        caller's device, the worker)."""
        out = [None] * len(self.specs)
        for (device, idx, packed), flat in zip(self.groups, flats):
            with tf.device(device) if on_devices else contextlib.nullcontext():
                if not packed:
                    out[idx[0]] = tf.reshape(flat, self.specs[idx[0]][1])
                    continue
                specs = [self.specs[i] for i in idx]
                sizes = [s.num_elements() * (1 if t == tf.bool else t.size) for _, s, t in specs]
                for i, part, (_, shape, dtype) in zip(idx, tf.split(flat, sizes), specs):
                    out[i] = _from_bytes(part, shape, dtype)
        return out

    def send(self, tensors):
        """Worker to PS: `tensors` (on the worker) arrive on their PS.
        Returns `(tensors there, the flat tensors as they landed)`."""
        landed = []
        for (device, _, _), flat in zip(self.groups, self.gather(tensors)):
            with tf.device(device):
                landed.append(tf.identity(flat))
        return self.scatter(landed, on_devices=True), landed


class Pull:
    """What a window's pull reads on the PS and how it travels to the worker.

    Per PS tensor, in order: on the counters' PS a `records.PullMeta` (the
    previous push's staleness, filled in by `to_worker`, whether the window
    already pushed, `replayed(window_id)`, and the version counter), then
    the local optimizer's shared variables (step counter, learning rate),
    then the variables' shards. Small ones travel as one byte vector
    per PS (`Transfer`). Under a `"bf16"` compression each float32 shard is
    read as a bfloat16 copy and widened back on the worker: the PS keeps
    float32, and the push (the worker's weights minus what it pulled) stays
    exact.

    Args:
        variables: the central variables (Keras or TF, possibly sharded).
        shared: the local optimizer's variables read from the PS.
        counters: the strategy's `counters.PushCounters`.
        replayed: `fn(window_id) -> bool scalar` on the counters' PS,
            `window_id` the window's id there.
        compression: the pull's `compression.Compression` (`"none"` or
            `"bf16"`); default none.
        start: a `rounds.RoundStart` to read instead of the live variables
            and version counter (synchronous rounds); None reads them live.
    """

    def __init__(self, variables, shared, counters, replayed, compression=None, start=None):
        self.cdev = raw(counters.version).device
        self.num_variables, self.num_shared = len(variables), len(shared)
        self.owners = [i for i, v in enumerate(variables) for _ in shard_variables(raw(v))]
        pieces = [s for v in variables for s in shard_variables(raw(v))]
        tensors = [raw(v) for v in shared] + pieces
        # The dtype each piece travels in (bf16 for float32 under a bf16 pull).
        self._dtypes = [pull_dtype(p.dtype, compression) for p in pieces]

        version = counters.version if start is None else start.version
        sources = tensors if start is None else start.shared + start.pieces  # beside each

        def meta(window_id):
            tau = tf.constant(-1, tf.int64)  # filled in by `to_worker`
            return PullMeta(tau, replayed(window_id), version.read_value()).pack()

        dtypes = [v.dtype for v in shared] + self._dtypes
        self._reads = [meta] + [
            lambda _, v=v, t=t: tf.cast(v.read_value(), t) for v, t in zip(sources, dtypes)
        ]
        self.transfer = Transfer(
            [(self.cdev, [PullMeta.size()], tf.int64)]
            + [(v.device, v.shape, t) for v, t in zip(tensors, dtypes)]
        )
        self._widen = [p.dtype for p in pieces]

    def read(self, window_id, device=None):
        """On each PS (or `device` only): the pull's flat tensors for the
        window `window_id` (an int64 scalar on the counters' PS)."""
        out = []
        for d in self.transfer.devices():
            if device is None or d == device:
                with tf.device(d):
                    values = [
                        read(window_id) if spec[0] == d else None
                        for spec, read in zip(self.transfer.specs, self._reads)
                    ]
                    out += self.transfer.gather(values, d)
        return out

    def to_worker(self, flats, tau=None):
        """The flat tensors to the worker (the caller's device); the first
        (the counters' PS's, packed, the `PullMeta` first) carries the push's
        staleness `tau`. Returns `(tau, flats)` on the worker."""
        start, stop = PullMeta.field_bytes("tau")
        if tau is not None:
            with tf.device(self.cdev):
                head, tau = flats[0], _to_bytes(tf.reshape(tau, [1]))
                head = tf.concat([head[:start], tau, head[stop:]], 0)
            flats = [head] + list(flats[1:])
        flats = [tf.identity(f) for f in flats]  # the transfers
        return _from_bytes(flats[0][start:stop], [], tf.int64), flats

    def unpack(self, flats):
        """On the worker: `(meta, shared values, variable values)`, `meta` a
        `records.PullMeta`."""
        values = self.transfer.scatter(flats)
        meta, shared, pieces = (
            values[0],
            values[1 : 1 + self.num_shared],
            values[1 + self.num_shared :],
        )
        pieces = [tf.cast(p, t) for p, t in zip(pieces, self._widen)]
        weights = []
        for i in range(self.num_variables):
            parts = [p for owner, p in zip(self.owners, pieces) if owner == i]
            weights.append(parts[0] if len(parts) == 1 else tf.concat(parts, axis=0))
        return PullMeta.unpack(meta), shared, weights


def _to_bytes(t):
    """A tensor's bytes, flat (`tf.bitcast`, exact for every numeric dtype)."""
    if t.dtype == tf.bool:
        t = tf.cast(t, tf.uint8)
    return tf.reshape(tf.bitcast(t, tf.uint8) if t.dtype != tf.uint8 else t, [-1])


def _from_bytes(b, shape, dtype):
    """Inverse of `_to_bytes` for a tensor of `shape` and `dtype`."""
    if dtype == tf.bool:
        return tf.reshape(tf.cast(b, tf.bool), shape)
    if dtype != tf.uint8:
        b = tf.bitcast(tf.reshape(b, [-1, dtype.size]), dtype)
    return tf.reshape(b, shape)


def update_specs(variables, updates):
    """`(shard, its piece of the update)` per PS shard, in order."""
    return [
        (shard, piece) for v, u in zip(variables, updates) for shard, piece in shards(raw(v), u)
    ]


class PushCodec:
    """How a push's update crosses to the PS under a `compression.Compression`.

    On the worker, each float32 variable's update is error-feedback compressed
    (`compression.compress_with_feedback`, per PS shard, so that each PS decodes
    its own piece): `corrected = update + residual`, the payload is
    `encode(corrected)` and the new residual `corrected - decode(payload)`.
    Other variables (integer RNG seeds, other float dtypes) travel as they are.
    On the PS, `decode` turns the payloads that arrived back into the update's
    pieces, before the staleness scale and the outer optimizer.

    Args:
        compression: a `compression.Compression`.
    """

    def __init__(self, compression):
        self.compression = compression

    def compresses(self, dtype):
        """Whether a variable of `dtype` is compressed (float32 under a lossy codec)."""
        return self.compression.lossy and compressible(dtype)

    def encode(self, variables, updates, residuals):
        """On the worker: the payloads of one push, and the residuals to keep.

        Args:
            variables: the central variables (Keras or TF, possibly sharded).
            updates: one update per variable (after the push rule).
            residuals: per variable, its per-worker residual variable, or None
                where it is not compressed.

        Returns:
            `(payloads, new_residuals)`: `(shard, payload tuple)` per PS shard
            (`update_specs` order; an uncompressed piece's payload is
            `(piece,)`), and `(residual variable, new value)` per compressed
            variable, to write once the push is committed.
        """
        payloads, new_residuals = [], []
        for v, u, r in zip(variables, updates, residuals):
            if r is None:
                payloads += [(shard, (piece,)) for shard, piece in shards(raw(v), u)]
                continue
            corrected = u + r.read_value()
            sent = []
            for shard, piece in shards(raw(v), corrected):
                payload = tuple(codecs.encode(piece, self.compression, xp=tf))
                payloads.append((shard, payload))
                sent.append(codecs.decode(payload, piece.shape, self.compression, xp=tf))
            sent = sent[0] if len(sent) == 1 else tf.concat(sent, axis=0)
            new_residuals.append((r, corrected - sent))
        return payloads, new_residuals

    def decode(self, payloads, arrived):
        """On each PS: the update's pieces (`update_specs` order) from the
        payload tensors that arrived there (flattened in `payloads` order)."""
        pieces, i = [], 0
        for shard, payload in payloads:
            parts, i = arrived[i : i + len(payload)], i + len(payload)
            if not self.compresses(shard.dtype):
                pieces.append(parts[0])
                continue
            with tf.device(shard.device):
                pieces.append(codecs.decode(parts, shard.shape, self.compression, xp=tf))
        return pieces

    def nbytes(self, variables):
        """Bytes of one push's payload for `variables` (Keras or TF, possibly
        sharded): `compression.payload_bytes` per compressed shard, the
        shard's own size otherwise."""
        total = 0
        for v in variables:
            for shard in shard_variables(raw(v)):
                n = int(np.prod(shard.shape))
                if self.compresses(shard.dtype):
                    total += codecs.payload_bytes(n, self.compression)
                else:
                    total += n * shard.dtype.size
        return total


@dataclasses.dataclass(frozen=True)
class PushGate:
    """What makes a push conditional, and what goes with it (see `CentralVariables.apply`).

    Attributes:
        ok: bool scalar on the counters' PS: push only if true. Without outer-optimizer
            state the push is then branch-free (`branch_free`): the caller sent a zero
            update where `ok` is false; the version advances by 0 and exactly 0 is added.
            Else every write is in a `tf.cond` on its PS.
        skipped: `fn() -> int64 scalar`, called on the counters' PS; it may count why a
            push was not made (and must count nothing for a push that is made: it may run
            in either case); its value is the push's `tau` when not pushed.
        writes: optional `fn(tau, push) -> [ops]`: more writes that belong to the push
            (e.g. the step count), made under its ticket. `push` is None when they run
            only for a push, else `ok`: they must then change nothing where it is false.
        steps: int64 scalar on the counters' PS, the window's local steps (a moving
            average's push needs them: `outer_optimizers.moving_average_push`); None: none.
    """

    ok: tf.Tensor
    skipped: typing.Callable[[], tf.Tensor]
    writes: typing.Optional[typing.Callable] = None
    steps: typing.Optional[tf.Tensor] = None


@dataclasses.dataclass(frozen=True)
class CentralVariables:
    """Where pushes land and how they are applied: the central variables (on the PS) with
    their outer state, the push counters, the staleness rule and the outer optimizer.

    `push` sends an update from the worker and applies it; `apply` applies one that has
    already arrived on the PS (the window sends its update with its metadata in one
    transfer). Both run inside a closure running on a worker. Nothing is written before
    the whole update is on the PS, so a worker that dies while its update is in transit
    leaves the PS untouched, not half-updated.

    Attributes:
        variables: the central variables (Keras or TF, possibly sharded).
        counters: the strategy's `counters.PushCounters`.
        rule: the staleness rule (`staleness.STALENESS_RULES`).
        max_staleness: drop pushes staler than this; None keeps all.
        outer_optimizer: `outer_optimizers.OuterSGD` or `DelayedNesterov`; None: `OuterSGD()`.
        slots: per variable, per shard, the outer state (`outer.create_slots`), `{}` for
            none; None: none anywhere.
        num_workers: the cluster's worker count (`DelayedNesterov`'s default delay).
        round_size: pushes per synchronous round (the staleness counts whole
            rounds: `counters.PushCounters.take_ticket`); 1 when asynchronous.
        commits: a `commits.PushCommits`: each PS adds the push to its count after its
            own writes. None: none.
        moving_average_momenta: per variable, the momentum of the moving average it is
            (applied by `outer.apply_moving_average`, from the window's steps: the gate's
            `steps`), or None; None: the outer optimizer for every variable.

    Example:

    ```python
    central = CentralVariables([var], strategy.counters, "dynsgd")

    @tf.function
    def push(update, pulled_version):
        ops, tau = central.push([update], pulled_version)
        with tf.control_dependencies(ops):
            return tf.identity(tau)

    strategy.coordinator.schedule(push, args=(update, version))
    ```
    """

    variables: list
    counters: typing.Any
    rule: str = "dynsgd"
    max_staleness: typing.Optional[int] = None
    outer_optimizer: typing.Any = None
    slots: typing.Any = None
    num_workers: int = 1
    round_size: int = 1
    commits: typing.Any = None
    moving_average_momenta: typing.Any = None

    def push(self, updates, pulled_version):
        """Sends `updates` to the PS and applies them (`apply`).

        Every piece of the update is first copied to the PS that holds its variable (or
        shard), small pieces as one flat tensor per PS (`Transfer`).

        Args:
            updates: one tensor per variable, on the worker.
            pulled_version: int64 scalar on the counters' PS, the version counter read at
                pull time.

        Returns:
            `(ops, tau)`: the write ops (one per PS), whose control dependencies order the
            push, and the push's staleness (int64 scalar on the counters' PS, available once
            every write of the push is done).
        """
        pieces = update_specs(self.variables, updates)
        transfer = Transfer([(s.device, p.shape, p.dtype) for s, p in pieces])
        arrived, landed = transfer.send([p for _, p in pieces])
        done, tau = self.apply(arrived, landed, pulled_version)
        return list(done.values()), tau

    def apply(self, arrived, landed, pulled_version, gate=None):
        """Applies an update that has arrived on the PS: the ticket, the outer optimizer,
        the counters.

        The version ticket is taken under control dependencies on `landed`, so staleness
        is measured at push time and nothing is written before the whole update is there.
        Then `scale(tau)` is computed on the PS that holds the counter and each PS applies
        the outer optimizer to the pseudo-gradient `-scale * update` of its variables
        (`outer.apply`, piece by piece; by default it adds `scale * update`). Pushes with
        `tau > max_staleness` are counted as dropped (their scale is 0).

        Args:
            arrived: the update's pieces on their PS, one per shard (`update_specs` order).
            landed: tensors that exist once the whole update is on the PS.
            pulled_version: int64 scalar on the counters' PS, the version counter read at
                pull time.
            gate: a `PushGate` for a conditional push; None pushes unconditionally.

        Returns:
            `(done, tau)`: per PS device, an op that runs once that PS's writes are done,
            and the push's staleness (int64 scalar on the counters' PS, available only once
            every write of the push is done; `gate.skipped()` when not pushed).
        """
        plan = _PushPlan(self, arrived, gate.steps if gate else None)
        cdev = plan.cdev
        ok = gate.ok if gate else None
        free = gate is not None and branch_free(self.slots)
        if free:  # every write runs; only a push made is counted
            with tf.device(cdev):
                plan.counted = tf.cast(ok, tf.int64)
        writes = gate.writes if gate else None

        def ticketed(push=None):
            return plan.ticketed(landed, pulled_version, push, writes)

        def not_pushed():
            with tf.device(cdev):
                skipped = tf.cast(gate.skipped(), tf.int64)
                return skipped, tf.zeros([], tf.float64), tf.zeros([], tf.int64)

        with tf.device(cdev):
            if gate is None:
                tau, scale, ticket = ticketed()
            elif free:
                tau, scale, ticket = ticketed(ok)
                tau = tf.where(ok, tau, tf.cast(gate.skipped(), tf.int64))
            else:
                tau, scale, ticket = tf.cond(ok, ticketed, not_pushed)
        done = {
            device: plan.apply_elsewhere(device, scale, ticket, tau, None if free else ok)
            for device in plan.by_device
            if device != cdev
        }
        with tf.device(cdev):  # a test may hold the push here (off in production)
            held = fault_points.hold("after_last_write", ticket, list(done.values()))
            with tf.control_dependencies(list(done.values()) + held):
                tau = tf.identity(tau)
        done[cdev] = tau.op
        return done, tau


class _PushPlan:
    """One push's shards grouped by PS device, and the writes made on each."""

    def __init__(self, central, arrived, steps=None):
        self.central, self.arrived, self.steps = central, arrived, steps
        self.outer = central.outer_optimizer or outer_optimizers.OuterSGD()
        slots, momenta = central.slots, central.moving_average_momenta
        self.shards = [
            (s, slots[i][j] if slots else {})
            for i, v in enumerate(central.variables)
            for j, s in enumerate(shard_variables(raw(v)))
        ]
        self.momenta = [
            momenta[i] if momenta else None
            for i, v in enumerate(central.variables)
            for _ in shard_variables(raw(v))
        ]
        if self.steps is None and any(m is not None for m in self.momenta):
            raise ValueError("A push of a moving average needs its window's steps.")
        self.cdev = raw(central.counters.version).device
        self.counted = tf.constant(1, tf.int64)  # what each PS adds to its commit count
        self.by_device = {self.cdev: []}
        for i, (shard, _) in enumerate(self.shards):
            self.by_device.setdefault(shard.device, []).append(i)

    def writes(self, device, scale, ticket, tau, held=(), before_commit=()):
        """The outer optimizer's writes to the shards on `device` (after `held`); this
        PS's commit count advances after them and after `before_commit`."""
        ops, held = [], list(held)
        if device != self.cdev:  # a test may hold the push here (off in production)
            with tf.device(device):
                held += fault_points.hold("between_ps_writes", ticket, [tau])
        for i in self.by_device[device]:
            shard, shard_slots = self.shards[i]
            update = self.arrived[i]
            # Under the ticket even where the scale is a constant ("none").
            with tf.device(device), tf.control_dependencies([tau, *held]):
                if update.dtype.is_floating and self.momenta[i] is not None:
                    ops.append(
                        outer.apply_moving_average(
                            shard, update, scale, self.momenta[i], self.steps
                        )
                    )
                elif update.dtype.is_floating:
                    ops += outer.apply(
                        self.outer,
                        shard,
                        update,
                        shard_slots,
                        scale,
                        ticket,
                        self.central.num_workers,
                    )
                else:  # integer state (RNG seeds) advances unscaled
                    ops.append(shard.assign_add(update, read_value=False))
        commits = self.central.commits
        if commits is not None:  # after this PS's own writes (`commits`)
            with tf.device(device), tf.control_dependencies([tau, *ops, *before_commit]):
                ops.append(commits.by_device[device].assign_add(self.counted, read_value=False))
        return ops

    def ticketed(self, landed, pulled_version, push, extra_writes):
        """On the counters' PS: the ticket, the scale, the counters, this PS's writes."""
        c = self.central
        with tf.device(self.cdev):
            begun = []
            if c.commits is not None:  # first: a push cut after this is found (`commits`)
                with tf.control_dependencies(landed):
                    count = tf.constant(1, tf.int64) if push is None else tf.cast(push, tf.int64)
                    begun = [c.commits.begin(count)]
            with tf.control_dependencies(list(landed) + begun):
                tau, ticket = c.counters.take_ticket(pulled_version, push, c.round_size)
            scale = tf.cast(
                staleness.staleness_scale(tau, c.rule, c.max_staleness, xp=tnp), tf.float64
            )
            dropped = tf.cast(staleness.is_dropped(tau, c.max_staleness), tf.int64)
            if push is not None:
                scale = tf.where(push, scale, tf.zeros_like(scale))
                dropped = dropped * tf.cast(push, tf.int64)
            ops = [c.counters.dropped_stale.assign_add(dropped, read_value=False)]
            with tf.control_dependencies([tau]):
                ops += list(extra_writes(tau, push)) if extra_writes else []
            held = fault_points.hold("after_ticket", ticket, [tau, *ops])  # (tests only)
            # The commit count waits for the ring, the step counts and the rest too: a push
            # cut between them is found cut, not taken for whole with its id unmarked.
            ops += self.writes(self.cdev, scale, ticket, tau, held, before_commit=list(ops))
            with tf.control_dependencies(ops):
                return tf.identity(tau), tf.identity(scale), tf.identity(ticket)

    def apply_elsewhere(self, device, scale, ticket, tau, ok):
        """The writes on another PS: unconditional (`ok` None), or in a `tf.cond` on `ok`."""
        if ok is None:
            with tf.device(device):
                return tf.group(*self.writes(device, scale, ticket, tau))

        def on_device():
            with (
                tf.device(device),
                tf.control_dependencies(self.writes(device, scale, ticket, tau)),
            ):
                return tf.constant(True)

        with tf.device(device):
            return tf.cond(ok, on_device, lambda: tf.constant(False)).op


def branch_free(slots):
    """Whether a conditional push can be branch-free: no outer-optimizer
    state anywhere (`slots` as for `CentralVariables`)."""
    return not any(s for per_var in (slots or []) for s in per_var)
