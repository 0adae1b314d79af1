"""Offline data sets (MNIST-1D generated here, digits upsampled) and the model builders."""

import contextlib
import random
import socket
import sys

import keras
import numpy as np
import pytest

from tf_asgd import data, models


def _no_network(*args, **kwargs):
    raise OSError("network disabled by the test")


def _no_download(*args, **kwargs):
    raise AssertionError("load_mnist1d called mnist1d's get_dataset (it downloads)")


@contextlib.contextmanager
def _offline():
    """No socket may connect, and mnist1d's downloading `get_dataset` raises."""
    import mnist1d.data

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket.socket, "connect", _no_network)
        mp.setattr(socket, "create_connection", _no_network)
        mp.setattr(mnist1d.data, "get_dataset", _no_download)
        yield


@pytest.fixture(scope="module")
def mnist1d():
    """The standard set, generated offline: every test that uses it also shows that
    `load_mnist1d` needs no network (generating it takes about a second)."""
    with _offline():
        return data.load_mnist1d()


def test_load_mnist1d_shapes_dtypes_and_classes(mnist1d):
    (x, y), (xt, yt) = mnist1d
    assert x.shape == (4000, 40, 1) and xt.shape == (1000, 40, 1)
    assert x.dtype == np.float32 and xt.dtype == np.float32
    assert y.dtype == np.int64 and yt.dtype == np.int64
    assert set(np.unique(y)) == set(range(10)) and set(np.unique(yt)) <= set(range(10))
    assert np.all(np.isfinite(x))
    # The generator standardises the whole set.
    both = np.concatenate([x, xt])
    assert abs(both.mean()) < 1e-3 and abs(both.std() - 1) < 1e-3


def test_load_mnist1d_is_the_package_standard_set(mnist1d):
    from mnist1d.data import get_dataset_args, make_dataset

    d = make_dataset(get_dataset_args())
    (x, y), (xt, yt) = mnist1d
    np.testing.assert_array_equal(x[..., 0], d["x"].astype("float32"))
    np.testing.assert_array_equal(xt[..., 0], d["x_test"].astype("float32"))
    np.testing.assert_array_equal(y, d["y"])
    np.testing.assert_array_equal(yt, d["y_test"])


def test_load_mnist1d_needs_no_network_and_never_downloads(mnist1d):
    import mnist1d.data as m
    import requests

    (x, y), (xt, yt) = mnist1d  # generated under _offline()
    assert x.shape == (4000, 40, 1) and yt.shape == (1000,)
    with _offline():  # and that guard does hold
        with pytest.raises(requests.exceptions.ConnectionError):
            requests.get("http://127.0.0.1:9/", timeout=1)
        with pytest.raises(AssertionError, match="downloads"):
            m.get_dataset(m.get_dataset_args())


def test_load_mnist1d_is_seeded_and_leaves_global_random_state_alone(mnist1d):
    random.seed(123)
    np.random.seed(123)
    expected = (random.random(), np.random.rand())
    random.seed(123)
    np.random.seed(123)
    (x, y), _ = data.load_mnist1d(num_train=400, num_test=100, seed=7)
    assert (random.random(), np.random.rand()) == expected
    (x2, y2), _ = data.load_mnist1d(num_train=400, num_test=100, seed=7)
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)
    (x3, _), _ = data.load_mnist1d(num_train=400, num_test=100, seed=8)
    assert not np.array_equal(x, x3)


def test_load_mnist1d_other_sizes_split_by_count_with_equal_classes():
    (x, y), (xt, yt) = data.load_mnist1d(num_train=930, num_test=70)
    assert x.shape == (930, 40, 1) and xt.shape == (70, 40, 1)
    counts = np.bincount(np.concatenate([y, yt]))
    assert counts.tolist() == [100] * 10  # (930 + 70) / 10 per class


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_train=0),
        dict(num_test=-1),
        dict(num_train=4001),
        dict(num_train=True),
        dict(num_test=2.5),
    ],
)
def test_load_mnist1d_rejects_bad_sizes(kwargs):
    with pytest.raises(ValueError, match="num_t"):
        data.load_mnist1d(**kwargs)


def test_load_mnist1d_without_the_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mnist1d", None)
    monkeypatch.setitem(sys.modules, "mnist1d.data", None)
    with pytest.raises(ImportError, match="pip install mnist1d"):
        data.load_mnist1d()


def test_load_digits_images_upsamples_the_digits_split():
    (x, y), (xt, yt) = data.load_digits_images(32)
    (x8, y8), (xt8, yt8) = data.load_digits()
    assert x.shape == (len(x8), 32, 32, 3) and xt.shape == (len(xt8), 32, 32, 3)
    assert x.dtype == np.float32 and 0.0 <= x.min() and x.max() <= 1.0
    np.testing.assert_array_equal(y, y8)
    np.testing.assert_array_equal(yt, yt8)
    np.testing.assert_array_equal(x[..., 0], x[..., 2])  # grey in every channel
    # Each 4x4 block follows its 8x8 source pixel (bilinear blurs the edges a little).
    blocks = x[..., 0].reshape(len(x), 8, 4, 8, 4).mean(axis=(2, 4))
    assert np.corrcoef(blocks.ravel(), x8[..., 0].ravel())[0, 1] > 0.95
    assert data.load_digits_images(16, channels=1)[0][0].shape[1:] == (16, 16, 1)
    with pytest.raises(ValueError, match="size"):
        data.load_digits_images(4)


def test_mnist1d_cnn_is_the_papers_and_learns(mnist1d):
    model = models.mnist1d_cnn()
    assert model.name == "mnist1d_cnn"
    assert model.count_params() == 5210  # 150 + 1900 + 1900 + 1260
    convs = [layer for layer in model.layers if isinstance(layer, keras.layers.Conv1D)]
    assert [c.kernel_size for c in convs] == [(5,), (3,), (3,)]
    assert all(c.filters == 25 and c.strides == (2,) and c.padding == "same" for c in convs)
    assert model.output_shape == (None, 10)
    acc = _held_out_accuracy(model, keras.optimizers.Adam(1e-2), mnist1d, 100, 4)  # 160 steps
    assert acc > 0.5, acc  # chance is 0.1


def _held_out_accuracy(model, optimizer, data, batch_size, epochs):
    """`model`'s held-out accuracy after `epochs` of plain Keras on `data`."""
    (x, y), (xt, yt) = data
    model.compile(
        optimizer,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0)
    return model.evaluate(xt, yt, verbose=0)[1]


def test_mnist1d_transformer_attends_and_learns(mnist1d):
    model = models.mnist1d_transformer()
    assert model.name == "mnist1d_transformer"
    attention = [la for la in model.layers if isinstance(la, keras.layers.MultiHeadAttention)]
    assert len(attention) == 2 and all(a.num_heads == 4 for a in attention)
    assert model.get_layer("positions").positions.shape == (40, 64)
    assert model.output_shape == (None, 10)
    acc = _held_out_accuracy(model, keras.optimizers.Adam(1e-3), mnist1d, 32, 2)  # 250 steps
    assert acc > 0.4, acc  # chance is 0.1
    restored = keras.models.clone_model(model)  # the custom layer's config round-trips
    assert restored.count_params() == model.count_params()


def test_lookup_sequences_follow_one_table_and_align_for_teacher_forcing():
    (x, y), (xt, yt) = data.load_lookup_sequences(2000, 500, length=12, vocab=8, noise=0.0)
    assert x.shape == (2000, 11) and y.shape == (2000, 9) and xt.shape == (500, 11)
    assert x.dtype == np.int32 and y.dtype == np.int64
    np.testing.assert_array_equal(y[:, :-1], x[:, 3:])  # target i is the input at 3 + i
    # Without noise each target is one function of the tokens 1 and 3 back, held out too.
    seq = np.concatenate([np.concatenate([x, y[:, -1:]], 1), np.concatenate([xt, yt[:, -1:]], 1)])
    table = {}
    for row in seq:
        for t in range(3, len(row)):
            assert table.setdefault((row[t - 1], row[t - 3]), row[t]) == row[t]
    again, _ = data.load_lookup_sequences(2000, 500, length=12, vocab=8, noise=0.0)
    np.testing.assert_array_equal(again[0], x)
    (noisy, _), _ = data.load_lookup_sequences(2000, 500, length=12, vocab=8, noise=0.5)
    assert not np.array_equal(noisy, x)


def test_causal_decoder_is_causal_and_learns_the_table():
    train, test = data.load_lookup_sequences(4000, 500, length=12, vocab=8, noise=0.0)
    model = models.causal_decoder(11, 9, vocab=8, classes=8, width=32, heads=2)
    assert model.output_shape == (None, 9, 8)
    x = train[0][:4]
    changed = x.copy()
    changed[:, -1] = (changed[:, -1] + 1) % 8
    before, after = model(x).numpy(), model(changed).numpy()
    np.testing.assert_allclose(before[:, :-1], after[:, :-1], atol=1e-5)  # nothing looks ahead
    assert not np.allclose(before[:, -1], after[:, -1])
    acc = _held_out_accuracy(model, keras.optimizers.AdamW(3e-3), (train, test), 32, 3)
    assert acc > 0.5, acc  # chance is 1/8; 375 steps


def test_resnet_bn_shape_parameters_and_residual_blocks():
    model = models.resnet_bn()
    assert model.name == "resnet_bn"
    assert model.count_params() == 309994
    assert model.input_shape == (None, 32, 32, 3) and model.output_shape == (None, 10)
    kinds = [type(layer).__name__ for layer in model.layers]
    assert kinds.count("Add") == 3 and kinds.count("BatchNormalization") == 9
    (x, _), _ = data.load_digits_images(32)
    assert model(x[:4], training=False).shape == (4, 10)
    deeper = models.resnet_bn(
        input_shape=(16, 16, 1), widths=(8, 16), blocks_per_stage=2, num_classes=3
    )
    assert deeper.output_shape == (None, 3)
    assert [type(layer).__name__ for layer in deeper.layers].count("Add") == 4
