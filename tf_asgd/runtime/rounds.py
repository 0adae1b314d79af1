"""Synchronous rounds (`synchronous=True`): N windows from one start, one outer step.

`Rounds` forms the chief's rounds (the epoch's steps in rounds of N windows); `RoundStart`
is the copy of the central variables on the PS that every window of a round pulls;
`validate_synchronous` refuses what rounds cannot honour exactly; `NoiseSums` reads the
gradient noise scale from the rounds' pushes. How the barrier, the pulls and the staleness
work: docs/architecture.md.
"""

import contextlib

import tensorflow as tf

from tf_asgd.rules import noise_scale, outer, outer_optimizers
from tf_asgd.runtime import python_inputs
from tf_asgd.runtime.push import raw, shard_variables


def validate_synchronous(synchronous, staleness, max_staleness, windows_per_closure, outer_opt, n):
    """Refuses, before connecting, what synchronous rounds cannot honour exactly.

    Args:
        synchronous: the strategy's `synchronous` argument.
        staleness: its `staleness` rule.
        max_staleness: its `max_staleness`.
        windows_per_closure: its `windows_per_closure`.
        outer_opt: its `outer_optimizer` (None: the default).
        n: the number of workers (pushes per round).

    Raises:
        ValueError: `synchronous` not a bool; with `synchronous=True`, a
            staleness rule other than "none", a `max_staleness`, a
            `windows_per_closure` other than None or 1, an `OuterSGD` with
            momentum or a schedule, or a `DelayedNesterov` whose `delay` is
            not the number of workers.
    """
    if not isinstance(synchronous, bool):
        raise ValueError(f"synchronous must be True or False, got {synchronous!r}.")
    if not synchronous:
        return
    refused = []
    if staleness != "none":
        refused.append(f"staleness={staleness!r} (every push of a round has staleness 0)")
    if max_staleness is not None:
        refused.append(f"max_staleness={max_staleness!r} (no push of a round is stale)")
    if windows_per_closure not in (None, 1):
        refused.append(
            f"windows_per_closure={windows_per_closure!r} (each window of a round is a "
            "closure of its own, pulled after the previous round)"
        )
    if isinstance(outer_opt, outer_optimizers.OuterSGD) and (
        outer_opt.momentum or outer_opt.schedule
    ):
        refused.append(
            f"{outer_opt!r} (momentum or a schedule would weigh a round's pushes unequally: "
            "use OuterSGD(lr) without either, or DelayedNesterov(lr, momentum) for one "
            "Nesterov step per round)"
        )
    if isinstance(outer_opt, outer_optimizers.DelayedNesterov) and outer_opt.delay not in (None, n):
        refused.append(
            f"{outer_opt!r} (its momentum steps must close a round: delay None or {n}, the "
            "number of workers)"
        )
    if refused:
        raise ValueError("synchronous=True cannot be combined with " + "; ".join(refused) + ".")


def refuse_push_rule(push_rule):
    """Raises `ValueError` for a worker-side push rule (GEM) in synchronous mode:
    GEM rescales each push against the asynchronous system's energy, which a
    round of pushes from one start does not have."""
    if push_rule is not None:
        raise ValueError(
            "synchronous=True cannot be combined with a GEM optimizer: GEM matches each "
            "push's energy to the asynchronous system's, and a round's windows all start "
            "from the same weights. Compile the model with its plain optimizer."
        )


def split_round(steps, num_windows, cycle=1):
    """A round's `steps` over `num_windows` windows, as evenly as whole
    `cycle`s (gradient accumulation) allow, the longer windows first; a
    window is empty (0 steps) where fewer cycles than windows remain.

    Examples:
        >>> split_round(20, 2), split_round(5, 2), split_round(1, 3)
        ([10, 10], [3, 2], [1, 0, 0])
    """
    units, extra = divmod(steps // cycle, num_windows)
    return [(units + (i < extra)) * cycle for i in range(num_windows)]


class Rounds:
    """The chief's rounds: steps Keras asks for, gathered into rounds of
    `num_workers` windows of `n_sync` steps. A round is due once it holds
    `num_workers * n_sync` steps, or at an epoch's end (its last round then
    splits the steps left over its windows: `split_round`); rounds never
    cross an epoch's end.

    Args:
        num_workers: windows per round, N.
        n_sync: local steps per window.
        close: what takes a round's outer step once its pushes are applied (a
            `RoundClose`), or None where the pushes take it.
    """

    def __init__(self, num_workers, n_sync, close=None):
        self.num_workers, self.n_sync = num_workers, n_sync
        self.steps = 0  # steps gathered for the next round
        self.window_ids = []  # the ids of the last round scheduled
        self.count = 0  # rounds taken, less those a PS's recovery rolled back
        self._close, self._open = close, False
        self.taken = []  # the rounds taken since the last PS snapshot, `[(steps, id)]` each
        self.replays = []  # rounds a PS's recovery rolled back, to run again in order

    def close(self):
        """After the barrier: the last round's outer step (`RoundClose`), once."""
        if self._open and self._close is not None:
            self._close()
        self._open = False

    def reset(self):
        """Forgets the steps gathered (an epoch starts)."""
        self.steps = 0

    def add(self, steps):
        """Gathers `steps` for the next round; returns whether it is full."""
        self.steps += steps
        return self.steps >= self.num_workers * self.n_sync

    def take(self, iterator, records, first_id, cycle=1):
        """After the barrier: checks the last round (`check`), then returns the
        next round's windows, `[(steps, window id)]` with ids from `first_id`
        on (None when no step is gathered).

        Args:
            iterator: the training data's iterator (Python-side data, which
                the chief reads per Keras step, is refused: `ValueError`).
            records: the `WindowRecord`s seen, newest last.
            first_id: the first window's id.
            cycle: the gradient-accumulation steps a window holds whole.
        """
        if python_inputs.is_feed(iterator):
            raise ValueError(
                "synchronous=True cannot train on Python-side data (a PyDataset, a generator, "
                "a pipeline that calls Python); pass arrays or a tf.data.Dataset."
            )
        self.check(records)
        if not self.steps:
            return None
        # At most one round's steps (more were gathered where a PS's loss failed a barrier).
        steps = min(self.steps, self.num_workers * self.n_sync)
        self.steps -= steps
        sizes = split_round(steps, self.num_workers, cycle)
        return self._open_round(list(zip(sizes, range(first_id, first_id + len(sizes)))))

    def _open_round(self, windows):
        self.count += 1
        self._open = True
        self.window_ids = [w for _, w in windows]
        self.taken.append(windows)
        return windows

    def next_replay(self):
        """After the barrier: the next round rolled back (`roll_back`), opened as `take`
        opens one, or None."""
        return self._open_round(self.replays.pop(0)) if self.replays else None

    def roll_back(self):
        """A PS's recovery restored the snapshot taken at a barrier (`mark`): every round
        taken since runs again, in order, before those still waiting; the open round
        closes with no outer step (its pushes were undone). `count` drops by the rounds
        undone: it counts rounds applied, each once."""
        self.count -= len(self.taken)
        self.replays = self.taken + self.replays
        self.taken, self.window_ids, self._open = [], [], False

    def mark(self):
        """A PS snapshot was taken at this barrier, before the round just taken runs: no
        earlier round can be rolled back."""
        self.taken = self.taken[-1:]

    def check(self, records):
        """After the barrier: raises `FloatingPointError` if a window of the
        last round was not applied (its update held NaN/Inf): the round would
        be a mean over fewer windows, and the outer optimizer's rounds would
        slip. `records`: the `WindowRecord`s seen, newest last."""
        ids = set(self.window_ids)
        recent = records[-4 * self.num_workers :]
        skipped = [r.window_id for r in recent if r.window_id in ids and not r.pushed]
        if skipped:
            raise FloatingPointError(
                f"Synchronous training: window(s) {skipped} of a round computed updates with "
                "NaN or Inf, so the round cannot apply the mean of its windows. Lower the "
                "learning rate or check the data for NaN/Inf."
            )
        self.window_ids = []


class RoundStart:
    """The central variables as a round starts, on the PS: what every window of the round pulls.

    A copy beside each central variable (or shard), each shared optimizer
    variable (step counter, learning rate) and the version counter. The
    chief `capture`s them between rounds, once every push of the previous
    round is applied; a window pulls them instead of the live variables, so
    a window that runs late, or again on another worker after its worker was
    lost, starts from the same weights as the others of its round. Costs one
    copy of the model on the PS.

    Create under the strategy's scope.

    Args:
        variables: the central variables (Keras or TF, possibly sharded).
        shared: the local optimizer's variables read from the PS at each pull.
        counters: the strategy's `counters.PushCounters`.
    """

    def __init__(self, variables, shared, counters):
        strategy = tf.distribute.get_strategy()
        sources = [raw(v) for v in shared] + [s for v in variables for s in shard_variables(raw(v))]
        self._pairs = []
        for source in sources + [counters.version]:
            with _beside(strategy, source):
                copy = tf.Variable(
                    tf.zeros(source.shape, source.dtype),
                    trainable=False,
                    name=f"{source.name.split(':')[0]}/round_start",
                )
            self._pairs.append((source, copy))
        self.version = self._pairs[-1][1]
        self.shared = [c for _, c in self._pairs[: len(shared)]]
        self.pieces = [c for _, c in self._pairs[len(shared) : -1]]
        self._capture = tf.function(self._copy, autograph=False)

    def _copy(self):
        ops = []
        for source, copy in self._pairs:
            with tf.device(copy.device):
                ops.append(copy.assign(source.read_value(), read_value=False))
        with tf.control_dependencies(ops):
            return self.version.read_value()

    def capture(self):
        """Copies the central variables, shared optimizer variables and
        version counter (on the PS; call between rounds). Returns the
        version captured, once every copy is written."""
        return int(self._capture().numpy())


class RoundClose:
    """A synchronous round's momentum step, taken by the chief at the barrier
    (`outer.close_round` on every shard that has a round buffer).

    Args:
        shards: `(shard, its outer slots)` pairs, the slots from
            `outer.create_slots(..., noise_sums=True)`.
        opt: the `outer_optimizers.DelayedNesterov`.
        num_workers: N.
    """

    def __init__(self, shards, opt, num_workers):
        self._shards = [(s, slots) for s, slots in shards if outer.NOISE_SUMS[0] in slots]
        self._opt, self._num_workers = opt, num_workers
        self._run = tf.function(self._ops, autograph=False)

    def __bool__(self):
        return bool(self._shards)

    def _ops(self):
        for shard, slots in self._shards:
            with tf.device(shard.device):
                outer.close_round(self._opt, shard, slots, self._num_workers)

    def __call__(self):
        self._run()


class NoiseSums:
    """The gradient noise scale of an epoch's rounds, read from the PS's sums.

    Under a `DelayedNesterov` whose delay is the round, each trainable shard's outer
    slots hold two float64 sums (`outer.NOISE_SUMS`): the pushes' squared norms and
    the rounds' (the buffer's total as a round closes). The chief reads them, summed
    on each PS, once before the first epoch and at each epoch's end; their growth over
    the epoch gives its noise scale (`noise_scale.from_sums`). Costs one scalar read per
    PS per epoch.

    Args:
        slots: the model's outer slots, per variable, per shard (`outer.create_slots`).
        num_workers: N, the pushes a round.

    Attributes:
        value: the last finished epoch's noise scale, in windows (`nan` before one).
        rounds: the rounds it was read from.
    """

    def __init__(self, slots, num_workers):
        self.num_workers = num_workers
        self._by_device = {}
        for per_variable in slots:
            for shard_slots in per_variable:
                if outer.NOISE_SUMS[0] in shard_slots:
                    pair = [shard_slots[name] for name in outer.NOISE_SUMS]
                    self._by_device.setdefault(pair[0].device, []).append(pair)
        self._read = tf.function(self._sums, autograph=False)
        self._start = None  # (sums, rounds) as the epoch started
        self.value, self.rounds = float("nan"), 0

    def __bool__(self):
        return bool(self._by_device)

    def _sums(self):
        parts = []
        for device, pairs in self._by_device.items():
            with tf.device(device):  # one tensor back from each PS
                parts.append(
                    tf.stack([tf.add_n([p[i].read_value() for p in pairs]) for i in (0, 1)])
                )
        return tf.add_n(parts)

    def start_epoch(self, rounds):
        """Reads the sums before the first epoch (`rounds`: `Rounds.count` then); later
        epochs start from the last one's end."""
        if self and self._start is None:
            self._start = (self._read().numpy(), rounds)

    def rebase(self, rounds):
        """After a PS's recovery restored the sums to a snapshot's: the epoch's growth is
        counted from the restored sums and `rounds` (`Rounds.count` after the rollback),
        not from a start that the rollback undid."""
        if self and self._start is not None:
            self._start = (self._read().numpy(), rounds)

    def end_epoch(self, rounds):
        """Reads the sums as an epoch ends, after its last round (`rounds`: `Rounds.count`
        then); sets `value` from the rounds since the last end, if there were any."""
        if not self or self._start is None:
            return
        sums, first = self._start
        self._start = (self._read().numpy(), rounds)
        push_sq, round_sq = self._start[0] - sums
        if rounds > first and push_sq > 0:
            self.value = noise_scale.from_sums(push_sq, round_sq, self.num_workers)
            self.rounds = rounds - first


def _beside(strategy, source):
    """Places a variable on `source`'s task. An optimizer made before the strategy's scope
    (`opt = Adam(); with strategy.scope(): model.compile(opt)`) holds its step counter and
    rate outside the strategy, which `colocate_vars_with` refuses: their copies go where
    the strategy puts a new variable."""
    try:
        return strategy.extended.colocate_vars_with(source)
    except ValueError:
        return contextlib.nullcontext()
