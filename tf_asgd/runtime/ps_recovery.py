"""A parameter server lost during `fit` (or between two), recovered inside `fit`.

A snapshot is the whole cluster where no push is half applied: the chief reads every PS
variable (model, optimizer, outer slots, push counters, the ring of applied windows) and
each worker copies its own variables (its optimizer state, which Adam's bias correction
reads with the PS's step count) beside them. One is taken at each `fit`'s start and end,
then as often as costs at most `SNAPSHOT_BUDGET` of the time, at least every
`snapshot_every` seconds. When a PS is lost, the chief waits (at most `connect_timeout`)
for it to answer, reconnects, gives every PS variable a new resource holding the
snapshot (no shard newer than another), drops the traces that captured the old ones, has
each worker copy its own variables back, and `fit` goes on. The pushes since the
snapshot are rolled back; they and the windows in flight train again under their own
ids, which the restored ring of applied ids does not hold, so none is applied twice.
How: docs/ps_recovery.md.
"""

import dataclasses
import logging
import time
import weakref

import numpy as np
import tensorflow as tf

from tf_asgd import internals
from tf_asgd.cluster import connect, lost_tasks

log = logging.getLogger("tf_asgd")

# The longest time between snapshots, in seconds.
DEFAULT_SNAPSHOT_EVERY = 60.0
# Within it, a snapshot is due once the time since the last one is the last one's cost
# (the chief's wait for the windows in flight, then the read) over this share: a fresh
# snapshot, and so a short rollback, for as little as the budget allows. A small model
# is read in about 0.05 s, so every 5 s (results/ps_recovery).
SNAPSHOT_BUDGET = 0.01
PROBE_RETRY_S = 0.5  # between probes of the workers' own channels to the PS
PROBE_GRACE_S = 2.0  # the least a probe is waited for, once queued
COPY_WAIT_S = 60.0  # the longest wait for the workers' half of a snapshot
RECOVERY_ATTEMPTS = 20  # at most, going back again where another PS is lost meanwhile
_LOST_PS = ("Lost parameter server", "parameter server")  # how the log names a lost PS
_EARLIER_FIT = (
    ", the last fit's end (what was written to the PS between the fits, such as "
    "set_weights, is not in it)"
)


@dataclasses.dataclass
class Recovery:
    """One lost parameter server's recovery inside `fit` (`strategy.recoveries`).

    Attributes:
        lost: the PS tasks found lost, e.g. `["ps:0 (localhost:1234, restarted)"]`.
        waited_s: seconds from the error until every PS answered again.
        restore_s: seconds to reconnect, restore the snapshot and reach the workers.
        snapshot_age_s: how old the snapshot was when the PS was lost.
        rolled_back: pushes applied since the snapshot, undone: their records stay in
            the window log, marked `rolled_back`, and their windows train again.
        in_flight: windows queued or scheduled and unfinished when the PS was lost:
            they train again (none of them stays applied).
        version: the version counter after the recovery (the snapshot's).
    """

    lost: list
    waited_s: float
    restore_s: float
    snapshot_age_s: float
    rolled_back: int
    in_flight: int
    version: int


@dataclasses.dataclass
class Snapshot:
    """The central state at one moment training passed through."""

    variables: list  # weakrefs to the PS `ResourceVariable`s
    values: list  # their NumPy values, in that order
    taken_at: float  # time.monotonic()
    marks: weakref.WeakKeyDictionary  # trainer -> length of its window log then


class PSRecovery:
    """The snapshots of a strategy's central state, and the recovery from them.

    Args:
        strategy: the `AsyncParameterServerStrategy`, just connected: every variable
            its scope creates from now on is registered here.
        snapshot_every: the longest time between snapshots, in seconds (None: none, so
            a lost PS stops `fit` with `ClusterTaskLostError`).

    Attributes:
        recoveries: a `Recovery` per recovered PS loss.
        snapshots: `(read seconds, seconds waited for the windows in flight, bytes,
            time.time() at its end)` of each snapshot taken.
    """

    def __init__(self, strategy, snapshot_every):
        self._strategy = weakref.ref(strategy)
        self.snapshot_every = snapshot_every
        self._created = []  # weakrefs to every variable the scope created
        internals.on_variable_created(strategy, lambda v: self._created.append(weakref.ref(v)))
        self._server_def = internals.server_def()
        self.snapshot = None
        self._at_fit_end = False  # `snapshot` was taken as the last `fit` ended
        self._earlier_fit = False  # `snapshot` is an earlier `fit`'s end: a fresh one is due
        self.recoveries = []
        self.snapshots = []
        self._worker_half = WorkerShadows(strategy)
        self._replays_seen = weakref.WeakKeyDictionary()  # trainer -> window_log length looked at

    def _live(self):
        live = [v for v in (r() for r in self._created) if v is not None]
        self._created = [weakref.ref(v) for v in live]
        return live

    def _ps_variables(self):
        """Every live variable of the scope as `(top-level variable, its resource
        variables on a PS)`."""
        return [
            (v, [r for r in internals.resource_variables(v) if _on_ps(r)])
            for v in self._live()
            if not internals.is_per_worker(v)
        ]

    def _copy_worker_state(self, back, deadline=None):
        """The workers' half of a snapshot (`WorkerShadows.copy`)."""
        self._worker_half.copy(self._live(), back, deadline)

    def start_fit(self):
        """Makes a snapshot due: the next quiet moment of the `fit` starting takes one.
        Until then a lost PS goes back to the last `fit`'s end (`end_fit`), if one was
        taken there; else it cannot be recovered."""
        if not self._at_fit_end:
            self.snapshot = None
        self._earlier_fit = self.snapshot is not None

    def end_fit(self, trainer):
        """Takes a snapshot as a `fit` ends cleanly (nothing in flight), for a PS lost
        before the next `fit`'s first one. A PS lost at the last epoch's end, met here, is
        recovered: the windows rolled back train again (`trainer.finish_fit`), then the
        snapshot is taken. Where that fails, there is none, and the `fit`, done, returns
        (the next use of the lost PS names it)."""
        self._at_fit_end = False
        if self.snapshot_every is None:
            return
        try:
            try:
                if self.repair_if_cut(trainer, check=True):
                    trainer.finish_fit()
                self.take(trainer)
            except tf.errors.OpError as e:
                self.recover(e, trainer)
                trainer.finish_fit()
                self.take(trainer)
        except Exception as e:  # noqa: BLE001 - a safety net: the fit itself is done
            self.snapshot = None
            log.warning(
                "No snapshot at the fit's end, so none for a PS lost before the "
                "next fit's first: %s",
                e,
            )
            return
        self._at_fit_end = True

    def due(self):
        """Whether a snapshot should be taken at the next quiet moment."""
        if self.snapshot_every is None:
            return False
        if self.snapshot is None or self._earlier_fit:
            return True
        read, waited = self.snapshots[-1][:2]  # the last one's cost
        interval = min(self.snapshot_every, (read + waited) / SNAPSHOT_BUDGET)
        return time.monotonic() - self.snapshot.taken_at >= interval

    def take(self, trainer, waited=0.0):
        """Reads every PS variable (no push may be in flight: `trainer.quiesce()`, which
        took `waited` seconds)."""
        start = time.perf_counter()
        variables = [r for _, rs in self._ps_variables() for r in rs]
        # The PS first: one lost during the read leaves the last snapshot whole, its
        # workers' half included.
        values = [np.asarray(r.read_value()) for r in variables]
        self._copy_worker_state(back=False)
        marks = weakref.WeakKeyDictionary({trainer: len(trainer.window_log)})
        nbytes = int(sum(v.nbytes for v in values))
        self.snapshot = Snapshot(
            [weakref.ref(r) for r in variables], values, time.monotonic(), marks
        )
        self._at_fit_end = self._earlier_fit = False
        seconds = time.perf_counter() - start
        self.snapshots.append((seconds, waited, nbytes, time.time()))

    def recover(self, error, trainer):
        """Recovers from `error` where it is a PS's loss and a snapshot exists; else
        raises `error` (`fit` names a lost PS in a `ClusterTaskLostError`).

        Returns:
            The `Recovery`.
        """
        if self.snapshot is None or not self._covers(trainer):
            raise error
        lost = self._lost(error)
        if lost is None and _cancelled_by_coordinator(error):
            lost = []  # a closure queued behind a failed one: nothing of the cluster lost
        if lost is None:
            raise error
        if not lost:
            return self._go_on(error, trainer)
        try:
            return self._go_back_again(trainer, lost, _LOST_PS)
        except _NotRecovered as e:
            raise error from e.__cause__

    def _go_back_again(self, trainer, lost, words, reconnect=True):
        """`_go_back`, and again where another task is lost meanwhile (a PS, a worker
        whose runs TF then aborts, or a channel a reconnect reset), while
        `connect_timeout` lasts. Raises the last `_NotRecovered`."""
        deadline = time.monotonic() + self._strategy().connect_timeout
        attempts = 1
        while True:
            try:
                return self._go_back(trainer, lost, words, reconnect)
            except _NotRecovered as e:
                cause = e.__cause__
                spent = attempts >= RECOVERY_ATTEMPTS or time.monotonic() > deadline
                if not isinstance(cause, tf.errors.OpError) or spent:
                    log.warning("Not going back again: %s", _why_not_again(cause))
                    raise
                attempts += 1
                if lost_now := self._lost(cause):  # a PS lost meanwhile: as for one from here
                    lost, words, reconnect = lost_now, _LOST_PS, True
                elif _restarted(cause):  # a worker restarted since the chief's context
                    reconnect = True

    def repair_if_cut(self, trainer, check=False):
        """Where a push was cut after it began (its worker lost after the ticket, or
        between two PS tasks' writes: `commits.PushCommits`), goes back to the snapshot
        as for a lost PS: the cut push and those since are undone and train again. Looks
        where a window ran again since the last look (a replay: its worker was lost after
        its push began), before each snapshot (which must not hold a cut push), and with
        `check`. Call where nothing is in flight.

        Returns:
            Whether it went back.

        Raises:
            RuntimeError: a cut push with no snapshot to go back to (`snapshot_every=None`).
        """
        records, seen = trainer.window_log, self._replays_seen.get(trainer, 0)
        self._replays_seen[trainer] = len(records)
        replayed = any(r.replayed for r in records[seen:])
        if not (replayed or check or self.due()):
            return False
        counts, behind = trainer.commits.cut()
        if not behind:
            return False
        what = (
            f"a push cut before every parameter server wrote it (its worker was lost): "
            f"{', '.join(behind)} behind ({', '.join(f'{t}: {n}' for t, n in counts.items())})"
        )
        if self.snapshot is None or not self._covers(trainer):
            raise RuntimeError(
                f"Training stopped: {what}. No snapshot holds the cluster from before it "
                "(snapshot_every=None turns them off): restore the model from a checkpoint."
            )
        try:
            self._go_back_again(trainer, [what], ("Found", "from"), reconnect=False)
        except _NotRecovered as e:
            raise RuntimeError(f"Training stopped: {what}; {e}") from e.__cause__
        return True

    def _go_back(self, trainer, lost, words, reconnect=True):
        """Puts the cluster back to the snapshot: waits for the windows in flight and for
        every PS, restores every PS variable and the workers' state, and trains the
        rolled-back windows and those in flight again. `words`: how the log lines name
        `lost` (`("Lost parameter server", "parameter server")`). Returns the
        `Recovery`."""
        strategy = self._strategy()
        start = time.monotonic()
        age = start - self.snapshot.taken_at
        log.warning(
            "%s %s; waiting up to %g s for every parameter server to answer, then going "
            "back to the snapshot of %.1f s ago%s.",
            words[0],
            ", ".join(lost),
            strategy.connect_timeout,
            age,
            _EARLIER_FIT if self._earlier_fit else "",
        )
        in_flight = []
        try:
            in_flight = trainer.abandon()
            deadline = start + strategy.connect_timeout
            _wait_for_closures(strategy, deadline)
            ps = [("ps", i, a) for i, a in enumerate(strategy.cluster_spec["ps"])]
            connect.wait_for_tasks(ps, max(0.1, deadline - time.monotonic()))
            answered = time.monotonic()
            self._restore(reconnect)
            _reach_workers(strategy, deadline)
            self._copy_worker_state(back=True, deadline=deadline)
            if reconnect:
                trainer.rebuild_input()
        except Exception as e:
            why = f"{type(e).__name__}: {e}"
            log.warning(
                "Could not go back to the snapshot (%s) after %.1f s: %s",
                ", ".join(lost),
                time.monotonic() - start,
                why,
            )
            if in_flight:  # the next attempt finds them to train again
                trainer.scheduler.keep(in_flight)
            raise _NotRecovered(str(e)) from e
        mark = self.snapshot.marks.get(trainer, len(trainer.window_log))
        rolled = _train_again(trainer, mark, in_flight)
        # The cluster is the snapshot again, with nothing in flight: a later loss goes
        # back to it and rolls back only what came after this recovery.
        self.snapshot.taken_at = time.monotonic()
        self.snapshot.marks = weakref.WeakKeyDictionary({trainer: len(trainer.window_log)})
        self._replays_seen[trainer] = len(trainer.window_log)
        version = self._snapshot_value(strategy.counters.version)
        done = Recovery(
            lost,
            answered - start,
            time.monotonic() - answered,
            age,
            len(rolled),
            len(in_flight),
            version,
        )
        self.recoveries.append(done)
        log.warning(
            "Recovered %s %s in %.1f s (it answered after %.1f s): the cluster went back to "
            "the snapshot of %.1f s before: %d push(es) rolled back; they and the %d "
            "window(s) in flight train again; version %d.",
            words[1],
            ", ".join(lost),
            done.waited_s + done.restore_s,
            done.waited_s,
            age,
            done.rolled_back,
            done.in_flight,
            version,
        )
        return done

    def _snapshot_value(self, variable):
        """`variable`'s value in the snapshot, an int (-1 where it holds none)."""
        for ref, value in zip(self.snapshot.variables, self.snapshot.values):
            if any(ref() is r for r in internals.resource_variables(variable)):
                return int(value)
        return -1

    def replayed_since_look(self, trainer):
        """Whether a window of `trainer.window_log` that `repair_if_cut` has not looked
        at is a replay. The records before the first such one are looked at (once each,
        however long the fit)."""
        records, seen = trainer.window_log, self._replays_seen.get(trainer, 0)
        first = next((i for i in range(seen, len(records)) if records[i].replayed), None)
        self._replays_seen[trainer] = len(records) if first is None else first
        return first is not None

    def _lost(self, error):
        """The PS tasks `error` lost: those that refuse connections, else those that no
        longer hold their variables where `error` may be a PS's loss. `[]` where `error`
        named a PS that still holds its variables (a worker that restarted mid-window says
        the same); None where `error` is no PS's loss."""
        named = lost_tasks.lost_ps(error, self._strategy().cluster_spec)
        if any(lost_tasks.REFUSES in task for task in named):
            return named
        if not named and not _may_be_ps_loss(error):
            return None
        lost = self._probe()
        return lost if lost or named else None

    def _go_on(self, error, trainer):
        """Where `error` named a PS that still holds its variables (a worker lost or
        restarted mid-window says so too): nothing is rolled back. The windows in flight
        train again; one whose push was applied is a replay and pushes nothing (its id
        is in the ring of applied ids). Synchronous rounds raise `error`: a round's
        windows cannot train again outside their round."""
        strategy = self._strategy()
        cancelled = _cancelled_by_coordinator(error)
        if trainer.scheduler.rolls_back_rounds():  # the rounds since the snapshot run again
            if not cancelled:
                raise error
            try:
                return self._go_back_again(trainer, [_CANCELLED], ("Found", "from"), False)
            except _NotRecovered as e:
                raise error from e.__cause__
        log.warning(
            "%s: nothing is rolled back, and the windows in flight train again. "
            "(TensorFlow said: %s)",
            _CANCELLED[0].upper() + _CANCELLED[1:]
            if cancelled
            else "A window failed with an error that names a parameter server, but every "
            "parameter server still holds its variables",
            _status(error),
        )
        in_flight = trainer.abandon()
        try:
            _wait_for_closures(strategy, time.monotonic() + strategy.connect_timeout)
        except TimeoutError as e:
            raise error from e
        trainer.rebuild_input()
        trainer.retrain(in_flight)
        return None

    def _covers(self, trainer):
        """Whether going back to the snapshot undoes only what can train again: always
        within the `fit` that took it. One of an earlier `fit`'s end must hold every PS
        variable there is now (a model built since is not in it) and have no window
        logged after it (an ended `fit`'s windows cannot train again)."""
        if not self._earlier_fit:
            return True
        held = {id(ref()) for ref in self.snapshot.variables}
        if any(id(r) not in held for _, rs in self._ps_variables() for r in rs):
            return False
        mark = self.snapshot.marks.get(trainer, len(trainer.window_log))
        return mark == len(trainer.window_log)

    def _probe(self):
        """The PS tasks that fail a read of one of their variables: those that lost them
        (`Socket closed`: a PS came back before anyone asked)."""
        one_per_task = {}
        for ref in self.snapshot.variables:
            variable = ref()
            if variable is not None:
                one_per_task.setdefault(_ps_task(variable.device), variable)
        lost = []
        for task, variable in sorted(one_per_task.items()):
            try:
                variable.read_value()
            except tf.errors.OpError:
                address = self._strategy().cluster_spec["ps"][task]
                lost.append(f"ps:{task} ({address}, which lost its variables)")
        return lost

    def _restore(self, reconnect=True):
        """Reconnects (a PS came back), then gives every snapshot variable a new resource
        with its value."""
        if reconnect:
            internals.reconnect(self._server_def)
        for ref, value in zip(self.snapshot.variables, self.snapshot.values):
            variable = ref()
            if variable is not None:
                internals.new_resource(variable, value)
        for top, _ in self._ps_variables():
            for layer in internals.variable_layers(top):
                internals.forget_cached_read(layer)
        internals.retrace_every_function()


class WorkerShadows:
    """The workers' half of a snapshot: a shadow of every per-worker variable (the
    workers' own optimizer state, residuals, flags) on the same worker, which never
    crosses the network.

    Args:
        strategy: the `AsyncParameterServerStrategy` (held weakly).
    """

    def __init__(self, strategy):
        self._strategy = weakref.ref(strategy)
        self._shadows = {}  # id of a per-worker variable -> (it, its copy on each worker)
        self._copies = {}  # (back, ids of the variables) -> the tf.function that copies

    def copy(self, live, back, deadline=None):
        """Copies every per-worker variable of `live` (the scope's live variables) to its
        shadow on the same worker, or with `back` the shadows back. A variable created
        since the snapshot gets a shadow at its initial value: it goes back to that.

        A worker lost while its state is copied to its shadow keeps its last shadow (its
        moments and its own step count from one moment, which agree). Copied back, the
        copy is retried until every worker has it, or raises `RuntimeError` after
        `deadline` (time.monotonic()): a worker left with state newer than the restored
        PS would train on moments that the PS never saw."""
        strategy = self._strategy()
        self._shadows = {k: (r, s) for k, (r, s) in self._shadows.items() if r() is not None}
        shadows = {id(s) for _, s in self._shadows.values()}
        pairs = []
        for v in live:
            if not internals.is_per_worker(v) or id(v) in shadows:
                continue
            if id(v) not in self._shadows or self._shadows[id(v)][0]() is not v:
                with strategy.scope():
                    shadow = internals.per_worker_variable(_initial_value(v))
                self._shadows[id(v)] = (weakref.ref(v), shadow)
            pairs.append((v, self._shadows[id(v)][1]))
        if not pairs:
            return
        key = (back, tuple(id(v) for v, _ in pairs))
        if key not in self._copies:  # one trace per direction, until the variables change

            def copy():
                for v, shadow in pairs:
                    (shadow.assign(v) if not back else v.assign(shadow))
                return tf.constant(0)

            self._copies = {k: f for k, f in self._copies.items() if k[1] == key[1]}
            self._copies[key] = tf.function(copy, autograph=False)
        while True:
            runs = internals.on_every_worker(strategy.coordinator, self._copies[key])
            failed = _failed_runs(runs, deadline if back else time.monotonic() + COPY_WAIT_S)
            if not failed or not back:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    "Could not give worker(s) "
                    f"{', '.join(f'worker:{i}' for i, _ in failed)} their optimizer state "
                    f"back within connect_timeout: {_status(failed[0][1])}"
                )
            connect.pause(PROBE_RETRY_S)  # idempotent: every worker copies again


def _reach_workers(strategy, deadline):
    """Waits until every worker reads the PS again: right after a reconnection the
    workers' own channels to a restarted PS back off for seconds."""
    version = strategy.counters.version
    probe = tf.function(lambda: version.read_value() + 0, autograph=False)
    while True:
        revived = internals.revive_orphaned_workers(strategy.coordinator)
        if revived:
            log.warning(
                "Worker(s) %s, which TF's coordinator still marked failed after a "
                "reconnection that failed on a lost PS, run closures again.",
                revived,
            )
        if time.monotonic() > deadline:  # spent waiting for the closures in flight
            raise tf.errors.UnavailableError(
                None, None, "connect_timeout passed before every worker read the PS again"
            )
        try:
            runs = internals.on_every_worker(strategy.coordinator, probe)
            # A probe just queued is given a moment even at the deadline's edge.
            by = max(deadline, time.monotonic() + PROBE_GRACE_S)
            for i, run in enumerate(runs):
                _fetch_by(run, by, strategy.coordinator, worker=i)
            return
        except (
            tf.errors.UnavailableError,
            tf.errors.AbortedError,
            tf.errors.CancelledError,
        ) as e:
            # A channel backing off. A task restarted since the chief's context (a PS lost
            # again in this go-back) is reached only by a reconnection: that, or another
            # error, fails the attempt, which goes back again.
            if _restarted(e):
                raise
            internals.wait_for_closures(strategy.coordinator, 5.0)
            if time.monotonic() > deadline:
                raise
            connect.pause(PROBE_RETRY_S)


def _why_not_again(cause):
    """Why a failed recovery is not tried again (`PSRecovery.recover`)."""
    if isinstance(cause, tf.errors.OpError):
        return "connect_timeout has passed"
    return f"{type(cause).__name__} is no task's loss"


def _train_again(trainer, mark, in_flight):
    """After the snapshot is restored: rolls `trainer`'s log back to `mark` (the snapshot's
    place in it) and has the windows it undid train again, with `in_flight`; returns the
    records rolled back."""
    # A window that ran again as a replay since the snapshot had pushed (its record
    # lost with its worker) after it, or before: it trains again too, and is a replay
    # again where the restored ring holds its id.
    replayed = [r.window_id for r in trainer.window_log[mark:] if r.replayed]
    rolled = trainer.log.roll_back(mark)
    again = [r.window_id for r in rolled]
    taken = {w for _, w in in_flight} | set(again)
    again += [w for w in dict.fromkeys(replayed) if w not in taken]
    # They train again under their own ids: none is in the restored ring of applied
    # ids; the rolled-back epochs epoch by epoch, as they first ran.
    trainer.retrain([(None, w) for w in again] + in_flight)
    return rolled


class _NotRecovered(Exception):
    """Going back to the snapshot failed (its cause is the error that stopped it)."""


_CANCELLED = "windows that TF's coordinator cancelled, queued behind one that failed"


def _cancelled_by_coordinator(error):
    """Whether `error` is TF's coordinator cancelling a closure it had not run, or had to
    put back, because another closure failed (`Closure.mark_cancelled`, and a resource
    of a worker marked failed): nothing of the cluster is lost, and TF asks for it to be
    scheduled again."""
    return isinstance(error, tf.errors.CancelledError) and "Please reschedule" in str(error)


def _may_be_ps_loss(error):
    """Whether `error` can be a PS's loss that names no PS (`Socket closed`)."""
    kinds = (tf.errors.UnavailableError, tf.errors.AbortedError)
    return isinstance(error, kinds) or _restarted(error)


def _restarted(error):
    """Whether `error` says a task restarted since the chief's context was made."""
    return any(sign in str(error) for sign in lost_tasks.RESTARTED_SIGNS)


def _wait_for_closures(strategy, deadline):
    """Waits until no closure runs (their errors swallowed); raises `TimeoutError` at
    `deadline`: a closure still running then could push into the restored PS."""
    if not internals.wait_for_closures(strategy.coordinator, max(0.0, deadline - time.monotonic())):
        raise TimeoutError(
            "windows were still running on the workers after connect_timeout "
            f"({strategy.connect_timeout:g} s)"
        )


def _failed_runs(runs, deadline):
    """`[(worker index, error)]` of the runs (`RemoteValue`s, one per worker) that a lost
    or restarted worker failed, or that had not finished by `deadline`."""
    failed = []
    for i, run in enumerate(runs):
        try:
            _fetch_by(run, deadline)
        except (tf.errors.CancelledError, tf.errors.UnavailableError, tf.errors.AbortedError) as e:
            failed.append((i, e))
    return failed


def _fetch_by(run, deadline, coordinator=None, worker=None):
    """`run.fetch()` (a `RemoteValue`) once it is ready; `UnavailableError` where it is
    not by `deadline` (time.monotonic()): a worker whose thread in TF's coordinator no
    longer runs closures would leave it waiting for good. With `coordinator` and `worker`
    (its index), what that thread was doing then is logged."""
    while not internals.remote_value_ready(run):
        if time.monotonic() > deadline:
            name = "a worker" if worker is None else f"worker:{worker}"
            if coordinator is not None and worker is not None:
                log.warning(
                    "%s did not run the recovery's probe in time; its thread in TF's "
                    "coordinator was at:\n%s",
                    name,
                    internals.worker_thread_stack(coordinator, worker) or "(no such thread)",
                )
            raise tf.errors.UnavailableError(
                None, None, f"{name} did not run a closure of the recovery in time"
            )
        internals.wait_briefly(run, 0.05)
    return run.fetch()


def _status(error):
    """A TF error's first line, at most 300 characters."""
    return lost_tasks.first_line(error)


def _initial_value(variable):
    """A per-worker variable's initial value (zeros where it cannot be read: its instance
    on the chief may live on a PS that was lost)."""
    try:
        return internals.per_worker_initial_value(variable)
    except tf.errors.OpError:
        return tf.zeros(variable.shape, variable.dtype)


def _ps_task(device):
    """The index of the PS task of `device` ("/job:ps/replica:0/task:1/device:CPU:0": 1)."""
    return int(device.split("/task:")[1].split("/")[0])


def _on_ps(variable):
    try:
        return "/job:ps" in variable.device
    except (AttributeError, ValueError, RuntimeError):  # a per-worker variable has no one device
        return False


def train_function(trainer, recovery, attempts=10):
    """`trainer.train_function` for Keras, with snapshots taken when due and a lost PS
    recovered (the windows then queued or in flight train again; the epoch goes on).
    A loss met before the call's window was queued (by the snapshot's wait, or by the
    rolled-back windows trained first) queues it after the recovery: Keras counts its
    steps as taken."""

    def run(iterator):
        taken = trainer.windows_taken
        for attempt in range(attempts):
            try:
                if trainer.windows_taken != taken:
                    return trainer.logs_so_far()
                trainer.scheduler.snapshot_if_due(recovery)
                return trainer.train_function(iterator)
            except tf.errors.OpError as e:
                if attempt == attempts - 1:
                    raise
                recovery.recover(e, trainer)

    return run


def snapshot_at_start(trainer, recovery):
    """The `fit`'s first snapshot where windows are asynchronous (rounds take theirs at a
    round's barrier), taken before Keras calls the callbacks' `on_train_begin`, so that
    a PS lost from the `fit`'s first callback on is recovered. A PS lost during it goes
    back to the last `fit`'s end where there is one; else it raises (nothing else holds
    the central variables as they were)."""
    try:
        trainer.scheduler.snapshot_if_due(recovery)
    except tf.errors.OpError as e:
        recovery.recover(e, trainer)


def finish(trainer, recovery, attempts=10):
    """`trainer.finish()` (the epoch's end) and a snapshot when due (free where the epoch's
    end waited for its windows); a PS lost in either is recovered and the end retried."""
    for attempt in range(attempts):
        try:
            logs = trainer.finish()
            trainer.scheduler.snapshot_if_due(recovery)
            return logs
        except tf.errors.OpError as e:
            if attempt == attempts - 1:
                raise
            recovery.recover(e, trainer)


def validate_snapshot_every(value):
    """Raises `ValueError` unless `value` is None or a positive finite number of seconds."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < np.inf:
        raise ValueError(
            f"snapshot_every must be None (no snapshots) or a positive number of seconds, "
            f"got {value!r}."
        )
