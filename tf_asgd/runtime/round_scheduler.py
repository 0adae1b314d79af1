"""Synchronous rounds (`synchronous=True`): N windows from one start, one outer step.

Local SGD with periodic averaging, as DiLoCo runs it (Douillard et al. 2023): each round's
N windows pull the same start, and the PS takes one outer step on the mean of their pushes
at the round's barrier. The rounds themselves are `rounds.Rounds`; a PS's recovery runs
the rounds since its snapshot again, whole and in order.
"""

from tf_asgd.rules import outer_optimizers
from tf_asgd.runtime import optimizer_options
from tf_asgd.runtime.push import raw, shard_variables
from tf_asgd.runtime.rounds import RoundClose, Rounds, refuse_push_rule
from tf_asgd.runtime.scheduler import WindowScheduler


class RoundScheduler(WindowScheduler):
    """The synchronous `WindowScheduler`: rounds of N one-window closures, each after the
    last.

    Args:
        trainer: the `WindowTrainer` whose windows it schedules; its `outer_slots` hold
            the round buffers (`round_buffers`).
    """

    round_buffers = True

    def __init__(self, trainer):
        super().__init__(trainer)
        n = trainer.strategy.num_workers
        self.concurrent_pushes = n  # a round's pushes are not stale to one another
        shards = [
            pair
            for v, slots in zip(trainer.variables, trainer.outer_slots)
            for pair in zip(shard_variables(raw(v)), slots)
        ]
        # The chief takes the outer step at each barrier where the shards keep a buffer.
        close = RoundClose(shards, trainer.outer, n)
        self.rounds = Rounds(n, trainer.strategy.n_sync, close or None)

    @staticmethod
    def check_push_rule(push_rule):
        refuse_push_rule(push_rule)

    @staticmethod
    def default_outer_optimizer(num_workers, rate_peak):
        del rate_peak  # the round's gain is the outer step's (`lr_scaling="none"`)
        return outer_optimizers.default_synchronous_outer_optimizer(num_workers)

    def next_id(self):
        return self.trainer.next_window_id  # given by round (`_start_round`)

    def add(self, num_steps, window_id, steps, left):
        if self.rounds.add(num_steps) or not steps or left <= 0:
            self._start_round()

    def flush(self):
        self._start_round()

    def end_epoch(self):
        """What is gathered of a round (a stop mid-epoch; after a recovery, 2 rounds)."""
        self._start_round()
        while self.rounds.steps:
            self._start_round()

    def close_epoch(self):
        rounds, noise = self.rounds, self.trainer.noise
        rounds.close()
        rounds.check(self.trainer.log.records)
        noise.end_epoch(rounds.count)

    def start_epoch(self):
        self.rounds.reset()  # steps left by a failed fit's round
        self.trainer.noise.start_epoch(self.rounds.count)

    def retrain(self, windows):
        """The snapshot was taken at a round's barrier, so the rounds taken since (which
        hold `windows`) run again, round by round (`Rounds.roll_back`)."""
        del windows
        self.rounds.roll_back()
        self.trainer.noise.rebase(self.rounds.count)

    def keep(self, windows):
        """Nothing: the rounds since the snapshot hold `windows`, and the attempt that
        restores it runs them again (`retrain`)."""
        del windows

    def rolls_back_rounds(self):
        return True

    def _start_round(self):
        """The barrier (every window of the last round finished, so each push of it is
        applied, and its outer step taken); the rounds a PS's recovery rolled back,
        again, each to its barrier; a PS snapshot when due (nothing is in flight here);
        then the next round: its start captured on the PS (`rounds.RoundStart`, which
        every window of the round pulls), its N windows scheduled, one closure each."""
        trainer, rounds = self.trainer, self.rounds
        recovery = trainer.strategy.ps_recovery
        trainer.drain(block=True)
        recovery.repair_if_cut(trainer)  # after a replay: a push cut between PS tasks undone
        rounds.close()
        while (again := rounds.next_replay()) is not None:
            self._run_round(again)
            trainer.drain(block=True)
            rounds.close()
        cycle = optimizer_options.accumulation_steps(trainer.model.optimizer)
        windows = rounds.take(trainer.iterator, trainer.log.records, trainer.next_window_id, cycle)
        if not windows:
            return
        trainer.next_window_id += len(windows)
        trainer.window.prepare(trainer.iterator)  # errors before anything is traced
        trainer.window.state.start_rounds()  # made before a snapshot, which then holds it
        if recovery.due():
            recovery.take(trainer)
            rounds.mark()
        self._run_round(windows)

    def _run_round(self, windows):
        self.trainer.window.state.start_rounds().capture()
        for window in windows:
            self.trainer.schedule([window])
