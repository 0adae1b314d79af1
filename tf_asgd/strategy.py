"""`AsyncParameterServerStrategy`: GPU A-SGD on TF's parameter-server runtime.

Example:

```python
import keras, tf_asgd

with tf_asgd.LocalCluster(num_workers=2, num_ps=1) as cluster:
    strategy = tf_asgd.AsyncParameterServerStrategy(
        cluster.resolver, n_sync=10, staleness="dynsgd")
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, epochs=2, batch_size=32)
    print(strategy.stats())
```
"""

import tensorflow as tf
from tensorflow.python.distribute.coordinator import values as coordinator_values

from tf_asgd import cluster as cluster_lib
from tf_asgd import keras_hook, update_rules
from tf_asgd.counters import PushCounters


class _WindowDataset:
    """What `experimental_distribute_dataset` hands to Keras.

    Iterated during training, it yields one per-worker iterator of the
    dataset repeated forever, the same one every epoch (each worker draws its
    own batches; Keras's `steps_per_epoch` ends an epoch). Iterated by
    evaluate, predict or the model's symbolic build
    (`keras_hook.local_mode`), it yields a plain iterator on the chief.

    Every worker runs the same dataset graph, so with a global seed set
    (`keras.utils.set_random_seed`) all would draw the same batches in the
    same order; worker `i` therefore skips `i` batches before its first
    window (`scheduling.WindowTrainer`), so that no two workers train on the
    same batch at the same time. (Skipping more, to spread workers over an
    epoch, would cost a slow input pipeline that many batches per worker.)
    """

    def __init__(self, dataset, strategy):
        self._dataset = dataset
        self._strategy = strategy
        self._iterator = None

    def __iter__(self):
        if keras_hook.in_local_mode():
            return iter(self._dataset)
        if self._iterator is None:
            transform = self._strategy.per_worker_dataset_fn
            if transform is None:
                source = self._dataset.repeat()
            else:
                source = self._per_worker_fn(transform)
            per_worker = self._strategy.coordinator.create_per_worker_dataset(source)
            self._iterator = iter(per_worker)
        return self._iterator

    def _per_worker_fn(self, transform):
        """A dataset function that applies `transform(dataset, worker_index)`
        on each worker. The chief's dataset travels as its serialized graph,
        as TF's coordinator sends a dataset object; a function that captured
        the dataset itself would fail on the worker."""
        graph = coordinator_values.serialize_dataset_to_graph(self._dataset)
        spec = self._dataset.element_spec

        def dataset_fn():
            dataset = coordinator_values.deserialize_dataset_from_graph(graph, spec)
            index = tf.distribute.coordinator.experimental_get_current_worker_index()
            out = transform(dataset, index)
            if not isinstance(out, tf.data.Dataset):
                raise TypeError(
                    f"per_worker_dataset_fn must return a tf.data.Dataset, got {type(out).__name__}."
                )
            if out.element_spec != spec:
                raise ValueError(
                    "per_worker_dataset_fn must keep the dataset's element_spec "
                    f"(the model was built for it): got {out.element_spec}, expected {spec}."
                )
            return out.repeat()

        return dataset_fn

    @property
    def element_spec(self):
        return self._dataset.element_spec


class AsyncParameterServerStrategy(tf.distribute.experimental.ParameterServerStrategy):
    """Asynchronous windowed SGD with staleness-scaled updates on the PS.

    Variables created under `scope()` live on the PS tasks (whole variables
    placed round-robin over the PS, or split by `variable_partitioner`).
    Keras's `model.fit` on a model built under the scope trains it with one
    `ClusterCoordinator` closure per window of `n_sync` local steps on some
    worker: pull, `n_sync` steps of the compiled optimizer on the worker's own
    copy, push the accumulated update once. The PS applies
    `staleness_scale(tau) * update`, where `tau` counts the pushes committed
    between this window's pull and its push.

    Args:
        cluster_resolver: a `tf.distribute.cluster_resolver.ClusterResolver`
            (e.g. `TFConfigClusterResolver()` or `LocalCluster.resolver`) with
            at least one `ps` and one `worker` task.
        n_sync: local steps per window (`1` is classic per-step async SGD).
        staleness: `"none"` (Downpour) or `"dynsgd"` (scale by 1/(tau+1)).
        max_staleness: pushes with `tau > max_staleness` are dropped and
            counted; `None` keeps every push.
        variable_partitioner: passed to `ParameterServerStrategy`.
        per_worker_dataset_fn: optional `fn(dataset, worker_index) -> dataset`,
            run on each worker (inside a `tf.function`; `worker_index` is a
            scalar tensor) on the batched dataset that `fit` was given, before
            it is repeated. Shard the data per worker
            (`lambda ds, i: ds.shard(num_workers, i)`) or emulate workers of
            different speeds (`tf_asgd.data.emulated_device_time`). It must keep
            the dataset's `element_spec`.
    """

    def __init__(
        self,
        cluster_resolver,
        n_sync=10,
        staleness="dynsgd",
        max_staleness=None,
        variable_partitioner=None,
        per_worker_dataset_fn=None,
    ):
        # Validate everything before connecting, so bad input changes nothing.
        if isinstance(n_sync, bool) or not isinstance(n_sync, int) or n_sync <= 0:
            raise ValueError(f"n_sync must be a positive integer, got {n_sync!r}.")
        if per_worker_dataset_fn is not None and not callable(per_worker_dataset_fn):
            raise TypeError(
                "per_worker_dataset_fn must be a function (dataset, worker_index) -> "
                f"dataset or None, got {per_worker_dataset_fn!r}."
            )
        update_rules.validate_staleness(staleness, max_staleness)
        cluster_lib.validate_cluster_spec(cluster_resolver.cluster_spec().as_dict())
        keras_hook.install()
        super().__init__(cluster_resolver, variable_partitioner=variable_partitioner)
        self.n_sync = n_sync
        self.staleness = staleness
        self.max_staleness = max_staleness
        self.per_worker_dataset_fn = per_worker_dataset_fn
        # evaluate/predict run on the chief against the central variables.
        self.extended._allow_run_without_coordinator = True
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(self)
        with self.scope():
            self.counters = PushCounters()

    def experimental_distribute_dataset(self, dataset, options=None):
        return _WindowDataset(dataset, self)

    def stats(self, trainer=None):
        """The run's push counters as an `AsyncStats`.

        `trainer` (a model's `WindowTrainer`) gives the byte counts their
        per-window size; without one they are reported as 0.
        """
        pull = trainer.bytes_per_pull if trainer else 0
        push = trainer.bytes_per_push if trainer else 0
        return self.counters.stats(pull, push)

    def window_log(self, model):
        """Every finished window of `model`'s training so far, in the order the
        chief saw them: a list of `scheduling.WindowRecord` (worker, pushed,
        mean loss, time seen, GEM's pi statistics)."""
        trainer = getattr(model, "_asgd_trainer", None)
        return list(trainer.window_log) if trainer else []

    def window_results(self, model, record):
        """Metric results of one window's own steps, e.g.
        `{"loss": 0.31, "accuracy": 0.9}`, for a record of `window_log`."""
        return model._asgd_trainer.window_results(record)

    def model_stats(self, model):
        """`stats()` with byte counts for `model`."""
        return self.stats(getattr(model, "_asgd_trainer", None))
