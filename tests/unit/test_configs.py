"""Configs: every config loads, overrides work, models build, missing data fails clearly."""

import glob
import inspect
import math
import os
import pickle
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from absl import flags
from ml_collections import config_flags

from tf_asgd import data, models
from tf_asgd.launch import config_fields, input_pipeline, run_parts

from helpers import ROOT

CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))
NAMES = [os.path.basename(p)[:-3] for p in CONFIGS]


def load(name, *overrides):
    argv = ["launch", f"--config={os.path.join(ROOT, 'configs', name + '.py')}", *overrides]
    fv = flags.FlagValues()
    # Override flags (--config.x=...) are defined from the argv they will parse.
    config_flags.DEFINE_config_file("config", flag_values=fv, lock_config=True, sys_argv=argv)
    fv(argv)
    return fv.config


def test_the_issue_configs_exist():
    assert {"default", "mnist_gem", "cifar10_asgd", "imagenet_paine2013"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_config_has_every_field_of_default(name):
    default, config = load("default"), load(name)
    assert set(config.keys()) == set(default.keys())
    for sub in ("optimizer", "gem", "outer"):
        assert set(config[sub].keys()) == set(default[sub].keys())
    assert config.model in config_fields.MODELS
    assert config.dataset in config_fields.DATASETS


def test_every_field_is_documented_once():
    """`config_fields.CONFIG_FIELDS` (what --help prints) names exactly the fields of the default
    config."""
    default = load("default")
    fields = set()
    for key, value in default.to_dict().items():
        fields |= {f"{key}.{sub}" for sub in value} if isinstance(value, dict) else {key}
    assert fields == set(config_fields.CONFIG_FIELDS)
    assert all(config_fields.CONFIG_FIELDS.values())


def _formula(text, n):
    """`text`, a formula of N as the help writes it (`1/sqrt(2N)`, `2 sin(pi/(4N-2))`),
    evaluated at N = `n`."""
    python = re.sub(r"(\d)\s*([A-Za-z(])", r"\1*\2", text)  # 2N -> 2*N, 2 sin( -> 2*sin(
    names = {"max": max, "min": min, "sqrt": math.sqrt, "sin": math.sin, "pi": math.pi, "N": n}
    return eval(python, {"__builtins__": {}}, names)


def test_the_help_states_the_default_outer_rate_the_code_computes():
    from tf_asgd.rules import outer_optimizers

    formula = config_fields.OUTER_RATE_FORMULA
    help_text = config_fields.CONFIG_FIELDS["outer.name"]
    assert formula in help_text and f"{config_fields.OUTER_RATE_AT_8} at 8 workers" in help_text
    for n in range(1, 65):
        assert _formula(formula, n) == pytest.approx(
            outer_optimizers.default_outer_learning_rate(n), rel=1e-12
        ), n
    assert f"{outer_optimizers.default_outer_learning_rate(8):.3f}" == config_fields.OUTER_RATE_AT_8
    # The limit the help names is the code's, and the default is inside it.
    assert "inside the stability limit 2 sin(pi/(4N-2))" in help_text
    for n in (1, 2, 8, 64):
        limit = outer_optimizers.stability_limit(n)
        assert outer_optimizers.default_outer_learning_rate(n) <= limit
        assert _formula("2 sin(pi/(4N-2))", n) == pytest.approx(limit)


def test_the_help_states_both_staleness_defaults_and_why_they_differ():
    """The strategy scales no push by its staleness (its default outer rate damps them);
    configs/default.py trains with GEM, whose pushes the PS adds at rate 1, so it keeps DynSGD."""
    from tf_asgd.strategy import AsyncParameterServerStrategy

    strategy_default = inspect.signature(AsyncParameterServerStrategy).parameters["staleness"]
    assert strategy_default.default == config_fields.STRATEGY_STALENESS == "none"
    default = load("default")
    assert default.staleness == config_fields.DEFAULT_CONFIG_STALENESS == "dynsgd"
    assert default.gem.enabled and run_parts.make_outer_optimizer(default) is None
    help_text = config_fields.CONFIG_FIELDS["staleness"]
    assert "the strategy's default is none" in help_text
    assert "configs/default.py sets dynsgd" in help_text and "GEM" in help_text


def test_the_help_states_the_outer_optimizers_own_rates():
    """`outer.learning_rate` 0 takes the optimizer's own rate; the help lists them."""
    help_text = config_fields.CONFIG_FIELDS["outer.learning_rate"]
    for name, rate in (("sgd", 1.0), ("nesterov", 0.7), ("delayed_nesterov", 0.7)):
        c = load("default", f"--config.outer.name={name}", "--config.outer.learning_rate=0.0")
        assert run_parts.make_outer_optimizer(c).learning_rate == rate, name
    assert "sgd 1, nesterov and delayed_nesterov 0.7" in help_text


def test_papers_settings():
    gem = load("mnist_gem")
    assert (gem.batch_size, gem.optimizer.momentum, gem.gem.enabled) == (64, 0.9, True)
    assert 0.05 <= gem.optimizer.learning_rate <= 0.1
    paine = load("imagenet_paine2013")
    assert (paine.n_sync, paine.num_workers, paine.gpus_per_worker) == (100, 8, 1)
    assert paine.ten_crop_eval and paine.augment
    default = load("default")
    assert (default.num_workers, default.num_ps, default.n_sync, default.gem.enabled) == (
        2,
        1,
        10,
        True,
    )


def test_command_line_overrides():
    c = load(
        "default",
        "--config.epochs=7",
        "--config.optimizer.learning_rate=0.1",
        "--config.gem.enabled=False",
        "--config.max_staleness=3",
        "--config.staleness=none",
    )
    assert c.epochs == 7 and c.optimizer.learning_rate == 0.1
    assert c.gem.enabled is False and c.max_staleness == 3 and c.staleness == "none"
    assert load("default").max_staleness is None


def test_unknown_override_is_refused():
    with pytest.raises((flags.Error, AttributeError, KeyError), match="no_such_field"):
        load("default", "--config.no_such_field=1")


def test_make_optimizer_wraps_gem_when_enabled():
    from tf_asgd import optimizers

    c = load("default", "--config.gem.kappa=2.0")
    opt = run_parts.make_optimizer(c)
    assert isinstance(opt, optimizers.GEM)
    c = load("default", "--config.gem.enabled=False", "--config.optimizer.learning_rate=0.2")
    opt = run_parts.make_optimizer(c)
    assert isinstance(opt, keras.optimizers.SGD)
    assert float(opt.learning_rate) == pytest.approx(0.2) and opt.momentum == 0.9


def test_outer_optimizer_fields_build_the_strategys_outer_optimizer():
    from tf_asgd.rules import outer_optimizers

    assert run_parts.make_outer_optimizer(load("default")) is None  # the strategy's default
    c = load("default", "--config.outer.name=nesterov")
    assert run_parts.make_outer_optimizer(c) == outer_optimizers.OuterSGD(
        0.7, momentum=0.9, nesterov=True
    )
    c = load("default", "--config.outer.name=sgd", "--config.outer.momentum=0.0")
    assert run_parts.make_outer_optimizer(c) == outer_optimizers.OuterSGD()
    c = load("default", "--config.outer.name=delayed_nesterov", "--config.outer.learning_rate=0.5")
    assert run_parts.make_outer_optimizer(c) == outer_optimizers.DelayedNesterov(0.5, momentum=0.9)
    c = load("default", "--config.outer.name=adamw")
    with pytest.raises(
        ValueError, match="Unknown outer optimizer 'adamw'; expected one of default, sgd"
    ):
        run_parts.make_outer_optimizer(c)


def test_gem_convnet_on_digits_is_refused_with_the_fix():
    c = load("default", "--config.model=gem_mnist_convnet")
    with pytest.raises(
        ValueError, match="needs MNIST's 28x28 images; dataset 'digits'.*digits_convnet"
    ):
        run_parts.make_model(c)


@pytest.mark.parametrize("name", NAMES)
def test_model_matches_its_data(name):
    c = load(name)
    model = run_parts.make_model(c)
    shape = {
        "digits": (8, 8, 1),
        "mnist": (28, 28, 1),
        "cifar10": (c.crop_size or 32,) * 2 + (3,),
        "imagenet": (c.crop_size,) * 2 + (3,),
    }[c.dataset]
    assert model.input_shape[1:] == shape
    assert model.output_shape[-1] == (1000 if c.dataset == "imagenet" else 10)


@pytest.mark.parametrize("name", ["mnist_gem", "cifar10_asgd", "imagenet_paine2013"])
def test_missing_data_names_the_path_and_the_remedy(name, tmp_path):
    missing = str(tmp_path / "nothing-here")
    c = load(name, f"--config.data_dir={missing}", "--config.download=False")
    with pytest.raises(data.MissingDataError) as err:
        input_pipeline.load_data_arrays(c)
    assert missing in str(err.value)
    assert "--config.data_dir" in str(err.value)


def test_missing_data_without_download_names_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    with pytest.raises(data.MissingDataError, match=str(tmp_path)):
        data.load_mnist("", download=False)


def test_mnist_from_a_local_keras_npz(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "mnist.npz"
    np.savez(
        path,
        x_train=rng.integers(0, 255, (70, 28, 28), dtype=np.uint8),
        y_train=rng.integers(0, 10, 70),
        x_test=rng.integers(0, 255, (30, 28, 28), dtype=np.uint8),
        y_test=rng.integers(0, 10, 30),
    )
    c = load("mnist_gem", f"--config.data_dir={path}", "--config.batch_size=16")
    d = input_pipeline.make_data(c)
    x, y = next(iter(d.train))
    assert x.shape == (16, 28, 28, 1) and x.dtype == tf.float32
    assert 0.0 <= float(tf.reduce_min(x)) and float(tf.reduce_max(x)) <= 1.0
    assert d.steps_per_epoch == 70 // 16


def test_cifar10_from_local_python_batches_with_augmentation(tmp_path):
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {
            b"data": rng.integers(0, 255, (8, 3072), dtype=np.uint8),
            b"labels": [int(v) for v in rng.integers(0, 10, 8)],
        }
        with open(tmp_path / name, "wb") as f:
            pickle.dump(batch, f)
    c = load("cifar10_asgd", f"--config.data_dir={tmp_path}", "--config.batch_size=4")
    (x, y), (xt, yt) = data.load_cifar10(str(tmp_path), download=False)
    assert x.shape == (40, 32, 32, 3) and xt.shape == (8, 32, 32, 3) and y.shape == (40,)
    d = input_pipeline.make_data(c)
    xb, _ = next(iter(d.train))
    xt_b, _ = next(iter(d.test))
    assert xb.shape == (4, 24, 24, 3) and xt_b.shape == (4, 24, 24, 3)
    model = run_parts.make_model(c)
    assert model(xb).shape == (4, 10)


def test_imagenet_from_a_class_directory(tmp_path):
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for wnid in ("n01", "n02"):
            os.makedirs(tmp_path / split / wnid)
            for i in range(3):
                img = rng.integers(0, 255, (40, 50, 3), dtype=np.uint8)
                keras.utils.save_img(str(tmp_path / split / wnid / f"{i}.png"), img)
    c = load(
        "imagenet_paine2013",
        f"--config.data_dir={tmp_path}",
        "--config.image_size=36",
        "--config.crop_size=32",
        "--config.batch_size=2",
    )
    d = input_pipeline.make_data(c)
    x, y = next(iter(d.train))
    assert x.shape == (2, 32, 32, 3) and set(np.asarray(y)) <= {0, 1}
    xi, _ = next(iter(d.test_images))
    assert xi.shape == (2, 36, 36, 3)  # uncropped, for the 10-crop evaluation


def test_ten_crops_are_corners_centre_and_mirrors():
    x = tf.reshape(tf.range(2 * 5 * 5, dtype=tf.float32), (2, 5, 5, 1))
    crops = data.ten_crops(x, 3).numpy()
    assert crops.shape == (10, 2, 3, 3, 1)
    xn = x.numpy()
    np.testing.assert_array_equal(crops[0], xn[:, :3, :3])
    np.testing.assert_array_equal(crops[3], xn[:, 2:, 2:])
    np.testing.assert_array_equal(crops[4], xn[:, 1:4, 1:4])
    np.testing.assert_array_equal(crops[5], xn[:, :3, :3][:, :, ::-1])


def test_ten_crop_evaluate_averages_softmax_over_views():
    model = keras.Sequential(
        [keras.Input((3, 3, 1)), keras.layers.Flatten(), keras.layers.Dense(4)]
    )
    rng = np.random.default_rng(1)
    x = rng.normal(size=(6, 5, 5, 1)).astype("float32")
    views = data.ten_crops(tf.constant(x), 3).numpy()
    probs = np.mean([tf.nn.softmax(model(v)).numpy() for v in views], axis=0)
    y = probs.argmax(-1)
    y[:2] = (y[:2] + 1) % 4  # two wrong at top-1
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    got = input_pipeline.ten_crop_evaluate(model, ds, 3)
    assert got["ten_crop_accuracy"] == pytest.approx(4 / 6)
    top4 = np.argsort(-probs, -1)[:, :4]
    assert got["ten_crop_top5_accuracy"] == pytest.approx(
        np.mean([y[i] in top4[i] for i in range(6)])
    )


def test_cuda_convnet_lrn_layer_round_trips(tmp_path):
    model = models.cuda_convnet_cifar10()
    path = str(tmp_path / "m.keras")
    model.save(path)
    again = keras.models.load_model(path)
    x = np.random.default_rng(0).uniform(0, 255, (2, 24, 24, 3)).astype("float32")
    np.testing.assert_allclose(model(x), again(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "flag,says",
    [
        ("--config=no/such/config.py", "--config: could not load 'no/such/config.py'"),
        ("--config.epoch=3", """--config: no field 'epoch'. Did you mean "epochs\""""),
    ],
)
def test_a_config_mistake_is_one_line(tmp_path, flag, says):
    """A config file that cannot be read, or an override naming no field, exits with one
    line naming it (ml_collections raised them as tracebacks of 36 and 55 lines)."""
    import subprocess
    import sys

    args = ["--config=configs/default.py", flag] if flag.startswith("--config.") else [flag]
    proc = subprocess.run(
        [sys.executable, "-m", "tf_asgd.launch", *args, f"--workdir={tmp_path / 'w'}"],
        cwd=ROOT,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("tf_asgd.launch: ") and says in line
