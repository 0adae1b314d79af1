"""Compressed pushes: exact against a NumPy reference of error feedback window by window
(alone, per PS shard, with GEM, with an outer optimizer with momentum), the bytes pushed,
training to accuracy, exactly once under a worker killed mid-closure, and bad values."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_asgd
from tf_asgd.rules import compression, gem_rule, outer_optimizers, staleness
from tf_asgd.runtime.push import raw, shard_variables

from gem_reference import (
    KAPPA,
    LR,
    MU,
    N_SYNC,
    _mse_grads,
    _tiny_model,
    _tiny_problem,
    assert_matches_reference,
    fit_recording_weights,
    gem_optimizer,
)
from helpers import compile_digits, worker_killed_mid_closure

INT8_SMALL_BLOCKS = compression.Compression("int8", block=4)  # the kernel's 6 values: 2 blocks
TOPK_THIRD = compression.Compression("topk", fraction=0.3)  # 2 of the kernel's 6, 1 of 2
BF16 = compression.Compression("bf16")


class ReferenceCompressed:
    """One worker's windows in NumPy: `N_SYNC` plain-SGD steps, the push rule (GEM or
    none), error-feedback compression per PS shard, the PS's outer optimizer (tau 0)."""

    def __init__(self, central, shard_rows, codec, gem=False, outer=None, pulls=None):
        self.central = [c.astype("float64") for c in central]
        self.pulls = pulls  # a bf16 pull: the worker starts from a rounded copy
        self.shard_rows = shard_rows  # per variable: rows per PS shard
        self.codec, self.gem, self.outer = codec, gem, outer
        self.residual = [np.zeros(c.shape, np.float32) for c in central]
        self.m = [np.zeros_like(c) for c in self.central]
        self.prev, self.states, self.ticket = None, [{} for _ in central], 0
        self.sent_total = [np.zeros_like(c) for c in self.central]
        self.update_total = [np.zeros_like(c) for c in self.central]

    def window(self, x, t):
        pulled = [c.astype(np.float32) for c in self.central]
        if self.pulls is not None:
            pulled = [compression.round_trip(c, self.pulls) for c in pulled]
        pulled = [c.astype("float64") for c in pulled]
        w, b = pulled
        for _ in range(N_SYNC):
            gw, gb = _mse_grads(w, b, x, t)
            w, b = w - LR * gw, b - LR * gb
        updates = [w - pulled[0], b - pulled[1]]
        for i, c in enumerate(pulled):
            u = updates[i]
            if self.gem:
                dc = c - self.prev[i] if self.prev is not None else np.zeros_like(c)
                u, self.m[i], _ = gem_rule.gem_step(u, self.m[i], dc, MU, KAPPA)
            u = u.astype(np.float32)
            cuts = np.cumsum(self.shard_rows[i])[:-1]
            pieces = [
                compression.compress_with_feedback(p, r, self.codec)
                for p, r in zip(np.split(u, cuts), np.split(self.residual[i], cuts))
            ]
            sent = np.concatenate([s for s, _ in pieces])
            self.residual[i] = np.concatenate([r for _, r in pieces])
            self.sent_total[i] += sent
            self.update_total[i] += u
            self.central[i], self.states[i] = staleness.ps_push(
                self.central[i],
                sent.astype("float64"),
                0,
                self.ticket,
                self.states[i],
                "none",
                outer=self.outer,
            )
        self.prev = pulled
        self.ticket += 1


def _shard_rows(variables):
    return [[s.shape[0] if s.shape.rank else 1 for s in shard_variables(raw(v))] for v in variables]


CASES = {
    "none": (compression.Compression(), False, None, 1),
    "bf16": (compression.Compression("bf16"), False, None, 1),
    "int8": (INT8_SMALL_BLOCKS, False, None, 1),
    "topk": (TOPK_THIRD, False, None, 1),
    "int8_two_ps_shards": (INT8_SMALL_BLOCKS, False, None, 2),
    "int8_gem": (INT8_SMALL_BLOCKS, True, None, 1),
    "topk_outer_momentum": (TOPK_THIRD, False, outer_optimizers.OuterSGD(0.5, momentum=0.9), 1),
    "bf16_pulls": (compression.Compression(), False, None, 1, BF16),
    "int8_bf16_pulls_two_ps_shards": (INT8_SMALL_BLOCKS, False, None, 2, BF16),
    "int8_bf16_pulls_gem": (INT8_SMALL_BLOCKS, True, None, 1, BF16),
}


@pytest.mark.parametrize("case", list(CASES))
def test_compressed_pushes_match_numpy_error_feedback(local_cluster, case):
    """One worker, windows of 3 steps, one window per epoch (a fixed push order): after
    every window the central variables are the NumPy reference's, which applies
    `compress_with_feedback` (per PS shard) and the outer rule window by window; the
    bytes pushed are the payloads' sizes."""
    codec, gem, outer, num_ps, pulls = (CASES[case] + (None,))[:5]
    cluster = local_cluster(1, num_ps)
    partitioner = (
        tf.distribute.experimental.partitioners.MaxSizePartitioner(max_shard_bytes=16)
        if num_ps == 2
        else None
    )
    strategy = tf_asgd.AsyncParameterServerStrategy(
        cluster.resolver,
        n_sync=N_SYNC,
        staleness="none",
        outer_optimizer=outer,
        variable_partitioner=partitioner,
        compression=codec,
        pull_compression=pulls,
    )
    x, t = _tiny_problem()
    with strategy.scope():
        model = _tiny_model()
        optimizer = keras.optimizers.SGD(LR)
        if gem:
            optimizer = gem_optimizer()
        model.compile(optimizer, "mse")
    rows = _shard_rows(model.trainable_variables)
    if num_ps == 2:
        assert rows[0] == [2, 1], rows  # the kernel is split over both PS
    ref = ReferenceCompressed(
        [v.numpy() for v in model.trainable_variables], rows, codec, gem, outer, pulls
    )
    epochs = 10
    per_epoch = fit_recording_weights(model, x, t, epochs, steps_per_epoch=N_SYNC)
    log = strategy.window_log(model)
    assert len(log) == epochs and all(r.pushed for r in log)
    for weights in per_epoch:
        ref.window(x, t)
        assert_matches_reference(weights, ref.central)
    if codec.lossy:  # nothing dropped is lost: sent = updates - what is still held back
        for sent, total, residual in zip(ref.sent_total, ref.update_total, ref.residual):
            np.testing.assert_allclose(sent, total - residual, rtol=1e-5, atol=1e-6)
        assert any(np.any(r != 0) for r in ref.residual)  # the codec did drop something
    per_window = sum(
        compression.payload_bytes(int(np.prod(s.shape)), codec)
        for v in model.trainable_variables
        for s in shard_variables(raw(v))
    )
    stats = strategy.model_stats(model)
    assert stats.windows == epochs and stats.applied == epochs
    assert stats.bytes_pushed_per_window == per_window
    assert stats.bytes_pushed == epochs * per_window
    assert stats.bytes_pulled_per_window == (2 if pulls else 4) * sum(
        int(np.prod(v.shape)) for v in model.trainable_variables
    )
    # Per sample: each window trains N_SYNC batches of all 8 rows.
    assert all(r.samples == N_SYNC * 8 for r in log)
    assert stats.bytes_pushed_per_sample == pytest.approx(per_window / (N_SYNC * 8))
    assert stats.bytes_pulled_per_sample == pytest.approx(
        stats.bytes_pulled_per_window / (N_SYNC * 8)
    )


@pytest.mark.parametrize("codec", ["none", "bf16", "int8", "topk"])
def test_bytes_pushed_per_window_of_the_gem_convnet(cluster, codec):
    """The GEM paper's MNIST convnet (163,790 parameters) on 2 workers: each window's
    push is the payloads' sizes, `sum(payload_bytes(n))`, counted per window pushed."""
    strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=2, compression=codec)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 28, 28, 1)).astype("float32")
    y = rng.integers(0, 10, size=64)
    with strategy.scope():
        model = compile_digits(tf_asgd.models.gem_mnist_convnet())
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    c = compression.as_compression(codec)
    sizes = [
        int(np.prod(v.shape)) for v in model.trainable_variables + model.non_trainable_variables
    ]
    want = sum(compression.payload_bytes(n, c) for n in sizes)
    stats = strategy.model_stats(model)
    print(
        f"{codec}: {stats.bytes_pushed_per_window} bytes pushed per window, {stats.windows} windows"
    )
    assert stats.bytes_pushed_per_window == want
    assert stats.bytes_pushed == stats.windows * want and stats.windows == 2
    assert stats.bytes_pulled_per_window == 4 * sum(sizes)


def test_compressed_pushes_train_digits_like_uncompressed(cluster, digits):
    """The digits convnet on 2 workers, a short fit: int8 and top-k 10% (with error
    feedback), and int8 with bf16 pulls, reach the accuracy of uncompressed pushes within
    3 points. The rate decays to 0 over the fit: at a constant rate the last epoch's
    accuracy alone varies by about 4 points from run to run, compressed or not."""
    (x, y), (xt, yt) = digits
    epochs, steps = 6, math.ceil(len(x) / 32)
    accuracy = {}
    runs = [
        ("none", "none", None),
        ("int8", "int8", None),
        ("topk", compression.Compression("topk", fraction=0.1), None),
        ("int8, bf16 pulls", "int8", "bf16"),
    ]
    for name, codec, pulls in runs:
        keras.utils.set_random_seed(0)
        strategy = tf_asgd.AsyncParameterServerStrategy(
            cluster.resolver, n_sync=10, compression=codec, pull_compression=pulls
        )
        with strategy.scope():
            decay = keras.optimizers.schedules.CosineDecay(0.05, epochs * steps)
            optimizer = keras.optimizers.SGD(decay, momentum=0.9)
            model = compile_digits(tf_asgd.models.digits_convnet(), optimizer)
        model.fit(x, y, batch_size=32, epochs=epochs, verbose=0)
        accuracy[name] = model.evaluate(xt, yt, verbose=0)[1]
        stats = strategy.model_stats(model)
        print(name, accuracy[name], stats.bytes_pushed_per_window, "bytes pushed per window")
    assert accuracy["none"] >= 0.9, accuracy
    assert accuracy["int8"] >= accuracy["none"] - 0.03, accuracy
    assert accuracy["topk"] >= accuracy["none"] - 0.03, accuracy
    assert accuracy["int8, bf16 pulls"] >= accuracy["none"] - 0.03, accuracy


def test_worker_killed_mid_closure_compressed_windows_applied_exactly_once(local_cluster, digits):
    """int8 pushes, a closure of 8 windows on the only worker (60 ms of emulated device
    time a step): once some of its windows have pushed and before it returns, the worker
    is SIGKILLed, then restarted. The re-run closure replays the windows that pushed (no
    steps, no push, no residual written) and runs the others: every window once (checked
    by `helpers.worker_killed_mid_closure`), each push the int8 payload's size."""
    with worker_killed_mid_closure(local_cluster, digits, compression="int8") as run:
        strategy, model, steps = run
        stats = strategy.model_stats(model)
        assert stats.bytes_pushed == steps * stats.bytes_pushed_per_window
        assert all(np.all(np.isfinite(v.numpy())) for v in model.trainable_variables)


@pytest.mark.parametrize(
    "kw,error,match",
    [
        (dict(compression="int9"), ValueError, "Unknown compression codec 'int9'"),
        (dict(compression=""), ValueError, "Unknown compression codec ''"),
        (dict(compression=8), TypeError, "compression must be None, a codec name"),
        (dict(compression=0.01), TypeError, "got 0.01"),
        (dict(pull_compression="int8"), ValueError, "pull_compression 'int8' is not supported"),
        (dict(pull_compression="topk"), ValueError, "only 'none' and 'bf16'"),
        (dict(pull_compression="fp8"), ValueError, "Unknown compression codec 'fp8'"),
        (dict(pull_compression=16), TypeError, "pull_compression must be None"),
    ],
)
def test_bad_compression_is_refused_before_connecting(kw, error, match):
    """Refused at construction, before the cluster is contacted (none exists here)."""

    class Unreachable(tf.distribute.cluster_resolver.SimpleClusterResolver):
        def __init__(self):
            super().__init__(
                tf.train.ClusterSpec({"ps": ["localhost:1"], "worker": ["localhost:2"]})
            )

    with pytest.raises(error, match=match):
        tf_asgd.AsyncParameterServerStrategy(Unreachable(), **kw)
