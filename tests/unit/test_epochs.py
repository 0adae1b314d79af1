"""`runtime/epochs.py`: which epoch a window belongs to, its steps, and a rollback's
windows regrouped by epoch (what `WindowTrainer.retrain` trains again, epoch by epoch)."""

from tf_asgd.runtime.epochs import Epochs


def _three_epochs():
    epochs = Epochs(n_sync=10)
    epochs.begin(0, 25)  # windows 0, 1, 2: 10, 10 and 5 steps
    epochs.begin(3, 25)  # 3, 4, 5
    epochs.begin(6, 25)  # 6, 7, 8: the running epoch
    return epochs


def test_a_window_belongs_to_the_epoch_that_began_at_or_before_it():
    epochs = _three_epochs()
    assert [epochs.index(w) for w in (0, 2, 3, 5, 6, 40)] == [0, 0, 1, 1, 2, 2]
    assert Epochs(10).index(7) == -1


def test_an_epochs_last_window_has_the_steps_left():
    epochs = _three_epochs()
    assert [epochs.window_steps(w) for w in range(6)] == [10, 10, 5, 10, 10, 5]
    outside_fit = Epochs(10)
    outside_fit.begin(0, None)
    assert outside_fit.window_steps(3) == 10


def test_a_rollback_regroups_by_epoch_in_order_with_known_steps_kept():
    epochs = _three_epochs()
    windows = [(None, 4), (None, 0), (None, 2), (7, 6), (None, 6), (None, 5), (10, 7)]
    running, earlier = epochs.regroup(windows)
    assert earlier == [[(10, 0), (5, 2)], [(10, 4), (5, 5)]]
    assert running == [(7, 6), (10, 7)]  # steps given win over computed ones, each id once
    assert epochs.regroup([]) == ([], [])
