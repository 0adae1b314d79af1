"""The window records (tf_asgd.runtime.records): pack and unpack agree, field by field."""

import numpy as np
import pytest
import tensorflow as tf

from tf_asgd.runtime import push
from tf_asgd.runtime.records import PullMeta, PushMeta, WindowResultLayout


def test_pull_meta_fields():
    assert PullMeta._fields == ("tau", "replayed", "version")
    assert PullMeta.size() == 3


@pytest.mark.parametrize("replayed", [False, True])
def test_pull_meta_round_trip(replayed):
    packed = PullMeta(tf.constant(-1, tf.int64), tf.constant(replayed), tf.constant(7, tf.int64))
    packed = packed.pack()
    assert packed.dtype == tf.int64 and packed.shape == [PullMeta.size()]
    meta = PullMeta.unpack(packed)
    assert meta.tau.numpy() == -1 and meta.version.numpy() == 7
    assert meta.replayed.dtype == tf.bool and bool(meta.replayed.numpy()) == replayed


def test_pull_meta_tau_bytes():
    """`field_bytes("tau")` is where `push.Pull.to_worker` writes the staleness."""
    packed = PullMeta(-1, True, 12).pack()
    start, stop = PullMeta.field_bytes("tau")
    assert stop - start == 8
    raw = tf.bitcast(packed, tf.uint8).numpy().reshape(-1)
    tau = tf.bitcast(tf.constant(raw[start:stop]), tf.int64).numpy()
    assert tau == -1
    at = PullMeta.field_bytes("version")[0]
    assert tf.bitcast(tf.constant(raw[at : at + 8]), tf.int64).numpy() == 12


def test_pull_meta_in_a_pull():
    """A pull's meta read on its PS, the staleness filled in on the way, then unpacked."""
    version = tf.Variable(tf.constant(5, tf.int64))
    counters = type("Counters", (), {"version": version})()
    variable = tf.Variable([1.0, 2.0])
    pull = push.Pull([variable], [], counters, lambda window_id: window_id > 2)
    tau, flats = pull.to_worker(pull.read(tf.constant(3, tf.int64)), tf.constant(4, tf.int64))
    meta, shared, weights = pull.unpack(flats)
    assert tau.numpy() == 4 and meta.tau.numpy() == 4
    assert bool(meta.replayed.numpy()) and meta.version.numpy() == 5
    assert shared == [] and np.array_equal(weights[0].numpy(), [1.0, 2.0])


def test_push_meta_fields():
    assert PushMeta._fields == (
        "window_id",
        "version",
        "ok",
        "bad",
        "next_id",
        "has_next",
        "steps",
        "advances",
    )
    assert PushMeta.SCALARS == PushMeta._fields[:-1]
    assert set(PushMeta.BOOLS) <= set(PushMeta.SCALARS)


@pytest.mark.parametrize("num_counters", [1, 3])
def test_push_meta_round_trip(num_counters):
    advances = [tf.constant(10 + i, tf.int64) for i in range(num_counters)]
    meta = PushMeta(
        window_id=tf.constant(41, tf.int64),
        version=tf.constant(9, tf.int64),
        ok=tf.constant(True),
        bad=tf.constant(False),
        next_id=tf.constant(42, tf.int64),
        has_next=tf.constant(True),
        steps=tf.constant(7, tf.int64),
        advances=advances,
    )
    packed = meta.pack()
    assert packed.dtype == tf.int64 and packed.shape == [PushMeta.size(num_counters)]
    back = PushMeta.unpack(packed)
    assert back.window_id.numpy() == 41 and back.version.numpy() == 9
    assert back.next_id.numpy() == 42 and back.steps.numpy() == 7
    for name in PushMeta.BOOLS:
        assert getattr(back, name).dtype == tf.bool
    assert bool(back.ok.numpy()) and not bool(back.bad.numpy()) and bool(back.has_next.numpy())
    assert back.advances.numpy().tolist() == [10 + i for i in range(num_counters)]
    assert np.array_equal(back.pack().numpy(), packed.numpy())


def test_push_meta_every_flag():
    """Each bool travels on its own: every combination comes back as it was sent."""
    for bits in range(8):
        ok, bad, has_next = (bool(bits & 1), bool(bits & 2), bool(bits & 4))
        packed = PushMeta(0, 0, ok, bad, 1, has_next, 10, [0]).pack()
        back = PushMeta.unpack(packed)
        assert (bool(back.ok), bool(back.bad), bool(back.has_next)) == (ok, bad, has_next)


def test_window_result_layout_round_trip():
    layout = WindowResultLayout(
        [np.zeros([2], np.float32), np.zeros([], np.int64)], has_pi=True, num_trainable=2
    )
    header = {name: float(i) for i, name in enumerate(WindowResultLayout.HEADER)}
    deltas = [tf.constant([1.5, -2.0]), tf.constant(3, tf.int64)]
    pi = tf.reshape(tf.range(6, dtype=tf.float32), [2, 3])
    packed = layout.pack(header, deltas, pi)
    assert packed.shape == [layout.size] and layout.size == len(layout.HEADER) + 3 + 6
    back, values, pi_back = layout.unpack(packed.numpy())
    assert back == header
    assert values[0].dtype == np.float32 and values[0].tolist() == [1.5, -2.0]
    assert values[1].dtype == np.int64 and values[1] == 3
    assert np.array_equal(pi_back, pi.numpy())
    with pytest.raises(ValueError, match="header must name exactly"):
        layout.pack({"worker": 0.0}, deltas, pi)
