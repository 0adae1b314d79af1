"""The chief's synchronous rounds (`runtime.rounds.Rounds`): what a round takes, and the
rounds a PS's recovery rolls back and runs again."""

from tf_asgd.runtime.rounds import Rounds


def _round(rounds, first_id, steps):
    rounds.add(steps)
    return rounds.take(None, [], first_id)


def test_a_round_takes_at_most_one_rounds_steps():
    """Steps gathered past a full round (a barrier a PS's loss failed) wait for the next."""
    rounds = Rounds(num_workers=2, n_sync=10)
    rounds.add(20)
    rounds.add(10)
    assert rounds.take(None, [], 0) == [(10, 0), (10, 1)]
    assert rounds.steps == 10
    assert rounds.take(None, [], 2) == [(5, 2), (5, 3)]
    assert rounds.steps == 0 and rounds.take(None, [], 4) is None


def test_the_rounds_since_the_snapshot_run_again_in_order_then_new_ones():
    closed = []
    rounds = Rounds(num_workers=2, n_sync=10, close=lambda: closed.append(1))
    first = _round(rounds, 0, 20)
    rounds.close()
    second = _round(rounds, 2, 20)
    rounds.mark()  # a snapshot at this barrier, before `second` runs
    rounds.close()
    third = _round(rounds, 4, 20)
    assert len(closed) == 2
    assert rounds.count == 3
    # The PS is lost while `third` runs: `second` and `third` are undone.
    rounds.roll_back()
    assert rounds.count == 1  # rounds applied, each once: the replays count again
    rounds.close()  # the barrier after the recovery: no outer step for the undone round
    assert len(closed) == 2
    assert rounds.next_replay() == second
    assert rounds.window_ids == [2, 3]
    # Lost again during the replay: it is rolled back with what it had, still in order.
    rounds.roll_back()
    assert rounds.replays == [second, third]
    assert rounds.next_replay() == second
    rounds.close()
    assert rounds.next_replay() == third
    rounds.close()
    assert rounds.next_replay() is None and len(closed) == 4
    assert rounds.count == 3
    assert first not in rounds.taken and rounds.taken == [second, third]
