"""The launcher's evaluator role (`launch.roles`): which checkpoints it evaluates, and
when it stops. Real checkpoints in a temporary directory; no cluster."""

import os

import tensorflow as tf

from tf_asgd.launch import roles


def _save(directory, checkpoint, step):
    checkpoint.step.assign(step)
    return checkpoint.save(os.path.join(directory, "ckpt"))


def test_the_checkpoint_written_before_done_is_evaluated(tmp_path, monkeypatch):
    """While the first checkpoint is evaluated the chief writes its last one and `DONE`:
    the last one is evaluated too, then the evaluator stops. (TF's `checkpoints_iterator`
    asks its `timeout_fn` after every checkpoint, so it stopped before the last.)"""
    monkeypatch.setattr(roles, "EVALUATOR_POLL_S", 0.01)
    checkpoint = tf.train.Checkpoint(step=tf.Variable(0, dtype=tf.int64))
    first = _save(str(tmp_path), checkpoint, 1)
    done_file = tmp_path / "DONE"
    seen = []
    for path in roles._new_checkpoints(str(tmp_path), done_file.exists):
        seen.append(path)
        if len(seen) == 1:  # the chief's last epoch ends during this evaluation
            last = _save(str(tmp_path), checkpoint, 2)
            done_file.write_text("")
        assert len(seen) <= 2
    assert seen == [first, last]


def test_without_done_it_stops_after_timeout_secs_with_no_new_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(roles, "EVALUATOR_POLL_S", 0.01)
    checkpoint = tf.train.Checkpoint(step=tf.Variable(0, dtype=tf.int64))
    only = _save(str(tmp_path), checkpoint, 1)
    assert list(roles._new_checkpoints(str(tmp_path), lambda: False, timeout_secs=0.2)) == [only]
