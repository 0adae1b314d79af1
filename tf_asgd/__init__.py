"""tf_asgd: asynchronous parameter-server training for Keras 3 on TensorFlow.

GPU A-SGD (Paine et al. 2013): workers train local copies for `n_sync` minibatches
between a pull and a push, and the PS scales each push by its staleness. GEM (Hermans &
Louppe 2018) rescales each worker's update to match a momentum-SGD proxy's energy.

Example:
    with tf_asgd.LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=10)
        with strategy.scope():
            model = tf_asgd.models.digits_convnet()
            model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        (x, y), _ = tf_asgd.data.load_digits()
        model.fit(x, y, batch_size=32, epochs=3)
"""

import importlib
import os
import sys

_EXPORTS = {
    "AsyncParameterServerStrategy": "tf_asgd.strategy",
    "AsyncStats": "tf_asgd.runtime.counters",
    "ClusterTaskLostError": "tf_asgd.errors",
    "ClusterUnreachableError": "tf_asgd.errors",
    "Compression": "tf_asgd.rules.compression",
    "DelayedNesterov": "tf_asgd.optimizers",
    "LocalCluster": "tf_asgd.cluster.local_cluster",
    "MetricStateError": "tf_asgd.errors",
    "MissingDataError": "tf_asgd.errors",
    "OuterSGD": "tf_asgd.optimizers",
    "TrainStepError": "tf_asgd.errors",
    "UnsupportedFeatureError": "tf_asgd.errors",
    "WindowRecord": "tf_asgd.runtime.records",
    "WorkerStalledError": "tf_asgd.errors",
    "WorkersLostError": "tf_asgd.errors",
    "parse_tf_config": "tf_asgd.cluster.tf_config",
}
_SUBMODULES = ("data", "errors", "models", "optimizers", "rules")


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"tf_asgd.{name}")
    else:
        raise AttributeError(f"module 'tf_asgd' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


def _started_module():
    """The module `python -m` is starting, while it imports this package first; else None.
    Also a module `LocalCluster` starts quietly (`python -c "'module';..." module ...`)."""
    if sys.argv and sys.argv[0] == "-m":
        return sys.orig_argv[-len(sys.argv)]
    if len(sys.argv) > 1 and sys.argv[0] == "-c":
        if sys.orig_argv[-len(sys.argv)].startswith(repr(sys.argv[1]) + ";"):
            return sys.argv[1]
    return None


# `python -m tf_asgd.launch` imports what it uses itself: it re-executes
# itself in a network namespace before it loads TensorFlow (seconds on a
# small machine). A task server loads TensorFlow alone. Everyone else gets
# everything at once, which also registers tf_asgd's Keras objects (GEM,
# the models' layers) for loading.
if _started_module() not in ("tf_asgd.launch", "tf_asgd.cluster.task_server"):
    # Imported before TensorFlow, tf_asgd loads it without its start-up banners
    # (every other line it prints is shown; TF_ASGD_VERBOSE_TF=1 shows them all).
    if "tensorflow" not in sys.modules and os.environ.get("TF_ASGD_VERBOSE_TF") != "1":
        from tf_asgd.cluster.tf_startup import filtered_stderr

        with filtered_stderr():
            import tensorflow  # noqa: F401 (loaded here, used by every module below)
    for _name in (*_SUBMODULES, *_EXPORTS):
        __getattr__(_name)

__version__ = "0.1.0"

__all__ = [
    "AsyncParameterServerStrategy",
    "AsyncStats",
    "ClusterTaskLostError",
    "ClusterUnreachableError",
    "Compression",
    "DelayedNesterov",
    "LocalCluster",
    "MetricStateError",
    "MissingDataError",
    "OuterSGD",
    "TrainStepError",
    "UnsupportedFeatureError",
    "WindowRecord",
    "WorkerStalledError",
    "WorkersLostError",
    "data",
    "errors",
    "models",
    "optimizers",
    "parse_tf_config",
    "rules",
]
