"""The codecs (tf_asgd.rules.compression): NumPy and TF agree, each codec's bounds, feedback."""

import doctest
import functools

import numpy as np
import pytest
import tensorflow as tf
import tensorflow.experimental.numpy as tnp

from tf_asgd.rules import compression
from tf_asgd.rules.compression import Compression

CODECS = [
    Compression("none"),
    Compression("bf16"),
    Compression("int8"),
    Compression("int8", block=7),
    Compression("int8", block=1),
    Compression("topk", fraction=0.01),
    Compression("topk", fraction=0.3),
    Compression("topk", fraction=1.0),
]
SHAPES = [(1,), (7,), (256,), (257,), (3, 5, 7), (513, 3), (2, 1, 300)]


def _tensor(shape, kind, seed=0):
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    if kind == "normal":
        x = rng.normal(size=n)
    elif kind == "zeros":
        x = np.zeros(n)
    elif kind == "large":  # magnitudes from 1e-30 to 1e38, both signs
        x = rng.choice([-1, 1], n) * 10.0 ** rng.uniform(-30, 38, n)
    else:  # "blocks": zero runs between values of very different scales
        x = rng.normal(size=n) * rng.choice([0.0, 1e-6, 1.0, 1e6], n)
    return x.astype(np.float32).reshape(shape)


def _bits(a):
    a = np.asarray(a)
    if a.dtype == np.float32:
        return a.view(np.uint32)
    return a


def _tf_payload_as_numpy(payload):
    out = []
    for p in payload:
        if p.dtype == tf.bfloat16:
            p = tf.bitcast(p, tf.uint16)  # the bits, comparable with NumPy's uint16
        out.append(p.numpy())
    return out


@functools.cache
def _tf_codec(codec):
    """`codec`'s TF ops on every shape of SHAPES, traced once (the kinds share the trace)."""

    @tf.function(jit_compile=False)
    def run(xs):
        payloads = [codec.encode(x, xp=tnp) for x in xs]
        return payloads, [codec.decode(p, x.shape, xp=tnp) for p, x in zip(payloads, xs)]

    return run


@pytest.mark.parametrize("codec", CODECS, ids=repr)
@pytest.mark.parametrize("kind", ["normal", "zeros", "large", "blocks"])
def test_numpy_and_tf_agree_bit_for_bit(codec, kind):
    xs = [_tensor(shape, kind, seed=i) for i, shape in enumerate(SHAPES)]
    with tf.device("/CPU:0"):
        tf_payloads, tf_decodeds = _tf_codec(codec)([tf.constant(x) for x in xs])
    for x, shape, tf_payload, tf_decoded in zip(xs, SHAPES, tf_payloads, tf_decodeds):
        np_payload = codec.encode(x)
        np_decoded = codec.decode(np_payload, shape)
        got = _tf_payload_as_numpy(tf_payload)
        assert [p.dtype for p in got] == [p.dtype for p in np_payload], (codec, shape)
        for a, b in zip(np_payload, got):
            np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f"{codec} {shape}")
        assert np_decoded.dtype == np.float32 and np_decoded.shape == shape
        assert tf_decoded.dtype == tf.float32 and tuple(tf_decoded.shape) == shape
        np.testing.assert_array_equal(_bits(np_decoded), _bits(tf_decoded.numpy()))


def test_bf16_is_tfs_cast_to_bfloat16_and_back():
    rng = np.random.default_rng(1)
    special = np.array(
        [
            0.0,
            -0.0,
            1.0 + 2.0**-8,  # a tie: rounds to even (1.0)
            1.0 + 3 * 2.0**-8,  # a tie: rounds to even (1.0 + 2**-6)
            1.0 + 2.0**-8 + 2.0**-20,  # just above a tie: up
            np.finfo(np.float32).max,  # overflows to inf
            -np.finfo(np.float32).max,
            np.inf,
            -np.inf,
            np.finfo(np.float32).tiny,
            3.0e38,
            -1.0e-30,
        ],
        np.float32,
    )
    x = np.concatenate([special, rng.normal(size=5000).astype(np.float32) * 1e3])
    want = tf.cast(tf.cast(tf.constant(x), tf.bfloat16), tf.float32).numpy()
    got = compression.round_trip(x, Compression("bf16"))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert got[2] == 1.0 and got[3] == 1.0 + 2.0**-6 and got[4] == 1.0 + 2.0**-7
    assert np.isinf(got[5]) and got[5] > 0
    # NaN stays NaN.
    assert np.isnan(compression.round_trip(np.float32([np.nan]), Compression("bf16")))[0]


@pytest.mark.parametrize("block", [1, 5, 256])
@pytest.mark.parametrize("kind", ["normal", "large", "blocks"])
def test_int8_error_is_at_most_half_a_scale_per_block(block, kind):
    codec = Compression("int8", block=block)
    x = _tensor((1001,), kind, seed=block)
    q, scale = codec.encode(x)
    assert q.dtype == np.int8 and q.shape == (1001,) and np.abs(q).max() <= 127
    assert scale.dtype == np.float32 and scale.shape == (-(-1001 // block),)
    x_hat = codec.decode((q, scale), x.shape)
    padded = np.pad(x, (0, (-1001) % block)).reshape(-1, block)
    np.testing.assert_array_equal(scale, np.abs(padded).max(axis=1) * np.float32(1 / 127))
    error = np.abs(np.pad(x - x_hat, (0, (-1001) % block)).reshape(-1, block))
    # Half a scale, plus the float rounding of x / scale and q * scale.
    assert np.all(error <= scale[:, None] * (0.5 + 1e-5))
    # Each block's largest entry is sent as +-127 and comes back (up to its scale's rounding).
    hat = np.abs(np.pad(x_hat, (0, (-1001) % block)).reshape(-1, block))
    np.testing.assert_allclose(hat.max(axis=1), np.abs(padded).max(axis=1), rtol=1e-6)


def test_int8_zero_blocks_decode_to_exact_zeros():
    codec = Compression("int8", block=4)
    x = np.float32([0, 0, 0, 0, 1, -2, 3, 4, 0, 0])  # a zero block, a partial zero block
    q, scale = codec.encode(x)
    assert scale.tolist() == [0.0, np.float32(4) * np.float32(1 / 127), 0.0]
    assert np.all(np.isfinite(scale))
    x_hat = codec.decode((q, scale), x.shape)
    assert x_hat[:4].tolist() == [0, 0, 0, 0] and x_hat[8:].tolist() == [0, 0]
    zeros = codec.decode(codec.encode(np.zeros((3, 3), np.float32)), (3, 3))
    assert zeros.tolist() == np.zeros((3, 3)).tolist()


@pytest.mark.parametrize("fraction", [0.001, 0.01, 0.07, 0.5, 1.0])
def test_topk_keeps_exactly_k_entries_the_largest(fraction):
    x = _tensor((40, 25), "normal", seed=3)
    x.reshape(-1)[:10] = 5.0  # ties: the lower indices win, as in tf.math.top_k
    codec = Compression("topk", fraction=fraction)
    k = compression.topk_count(x.size, fraction)
    assert k == int(np.ceil(round(fraction * 1000, 6)))
    values, indices = codec.encode(x)
    assert values.shape == indices.shape == (k,) and indices.dtype == np.int32
    assert len(set(indices.tolist())) == k
    np.testing.assert_array_equal(values, x.reshape(-1)[indices])
    kept = np.abs(x.reshape(-1)[indices])
    dropped = np.delete(np.abs(x.reshape(-1)), indices)
    assert dropped.size == 0 or kept.min() >= dropped.max()
    if k < 10:
        assert sorted(indices.tolist()) == list(range(k))
    x_hat = codec.decode((values, indices), x.shape)
    assert np.count_nonzero(x_hat) == k
    np.testing.assert_array_equal(x_hat.reshape(-1)[indices], values)


def test_topk_count_is_exact_in_decimal():
    assert compression.topk_count(100, 0.07) == 7  # 0.07 * 100 == 7.000000000000001
    assert compression.topk_count(1000, 0.01) == 10
    assert compression.topk_count(1, 0.01) == 1
    assert compression.topk_count(3, 1.0) == 3
    assert compression.topk_count(101, 0.5) == 51


@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_payload_bytes_are_the_encoded_arrays_bytes(codec):
    for shape in SHAPES + [(164_000,), (0,)]:
        x = _tensor(shape, "normal")
        n = x.size
        payload = codec.encode(x)
        assert codec.payload_bytes(n) == sum(p.nbytes for p in payload), (codec, shape)
        with tf.device("/CPU:0"):
            tf_payload = codec.encode(tf.constant(x), xp=tf)
        tf_bytes = sum(p.shape.num_elements() * p.dtype.size for p in tf_payload)
        assert tf_bytes == codec.payload_bytes(n)
    assert Compression("none").payload_bytes(1000) == 4000
    assert Compression("bf16").payload_bytes(1000) == 2000
    assert Compression("int8").payload_bytes(1000) == 1000 + 4 * 4
    assert Compression("topk", fraction=0.01).payload_bytes(1000) == 80


@pytest.mark.parametrize("codec", [c for c in CODECS if c.lossy], ids=repr)
def test_error_feedback_conserves_the_sum_over_50_rounds(codec):
    rng = np.random.default_rng(4)
    shape = (33, 9)
    residual = np.zeros(shape, np.float32)
    total_sent = np.zeros(shape, np.float64)
    total_update = np.zeros(shape, np.float64)
    for _ in range(50):
        update = (rng.normal(size=shape) * 10.0 ** rng.uniform(-3, 0)).astype(np.float32)
        sent, new_residual = compression.compress_with_feedback(update, residual, codec)
        assert sent.dtype == new_residual.dtype == np.float32 and sent.shape == shape
        # Each push: what is sent plus what is kept is what there was, exactly.
        np.testing.assert_array_equal(sent + new_residual, update + residual)
        residual = new_residual
        total_sent += sent
        total_update += update
    scale = np.abs(total_update).max()
    np.testing.assert_allclose(total_sent + residual, total_update, rtol=0, atol=1e-5 * scale)
    if codec.codec == "topk" and codec.fraction < 1:
        assert np.abs(residual).max() > 0  # something was held back, and is accounted for


def test_error_feedback_in_a_tf_function_matches_numpy():
    codec = Compression("int8", block=16)
    rng = np.random.default_rng(5)
    updates = rng.normal(size=(50, 100)).astype(np.float32)
    residual = tf.Variable(tf.zeros([100]))

    @tf.function
    def push(update):
        sent, new_residual = compression.compress_with_feedback(
            update, residual.read_value(), codec, xp=tf
        )
        residual.assign(new_residual)
        return sent

    np_residual = np.zeros(100, np.float32)
    with tf.device("/CPU:0"):
        for update in updates:
            got = push(tf.constant(update)).numpy()
            want, np_residual = compression.compress_with_feedback(update, np_residual, codec)
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(residual.numpy(), np_residual)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"codec": "fp8"}, "Unknown compression codec 'fp8'; expected one of 'none', 'bf16'"),
        ({"codec": None}, "Unknown compression codec None"),
        ({"codec": "int8", "block": 0}, "block must be a positive integer, got 0"),
        ({"codec": "int8", "block": 2.5}, "block must be a positive integer, got 2.5"),
        ({"codec": "int8", "block": True}, "block must be a positive integer, got True"),
        ({"codec": "topk", "fraction": 0}, r"fraction must be a number in \(0, 1\], got 0"),
        ({"codec": "topk", "fraction": 1.5}, r"fraction must be a number in \(0, 1\], got 1.5"),
        ({"codec": "topk", "fraction": "1%"}, r"in \(0, 1\], got '1%'"),
        ({"codec": "bf16", "block": 64}, r"Compression\('bf16'\) takes no block .*block=64"),
        ({"codec": "int8", "fraction": 0.1}, r"takes no fraction \(only 'topk' does\)"),
    ],
)
def test_bad_configs_raise_naming_the_bad_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Compression(**kwargs)


def test_configs_and_their_defaults():
    assert Compression() == Compression("none") and not Compression().lossy
    assert Compression("int8").block == 256 and Compression("int8", block=64).block == 64
    assert Compression("topk").fraction == 0.01
    assert Compression("int8", block=np.int64(8)).block == 8
    assert compression.as_compression(None) == Compression("none")
    assert compression.as_compression("bf16") == Compression("bf16")
    c = Compression("topk", fraction=0.02)
    assert compression.as_compression(c) is c
    assert hash(Compression("int8")) == hash(Compression("int8", block=256))
    with pytest.raises(TypeError, match="compression must be None, a codec name"):
        compression.as_compression(8)
    with pytest.raises(ValueError, match="Unknown compression codec 'int4'"):
        compression.as_compression("int4")


def test_pull_compression_offers_a_bf16_copy_only():
    assert compression.as_pull_compression(None) == Compression("none")
    assert compression.as_pull_compression("bf16") == Compression("bf16")
    assert compression.as_pull_compression(Compression("bf16")) == Compression("bf16")
    for codec in ("int8", "topk"):
        with pytest.raises(ValueError, match=f"pull_compression '{codec}' is not supported"):
            compression.as_pull_compression(codec)
    with pytest.raises(TypeError, match="pull_compression must be None"):
        compression.as_pull_compression(2)


def test_a_tensor_without_a_static_shape_is_refused():
    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)])
    def run(x):
        return Compression("int8").encode(x, xp=tf)

    with pytest.raises(ValueError, match="needs a tensor with a static shape"):
        run.get_concrete_function()


def test_the_module_examples_run():
    failures, tried = doctest.testmod(compression)
    assert tried >= 8 and failures == 0
