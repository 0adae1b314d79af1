"""What an `AsyncParameterServerStrategy` keeps between calls: per model, and per dataset.

`ModelStates` holds one `ModelState` per model in one weak-keyed map (nothing is stored on
the model, and a model that is gone takes its state with it); `TrainingData` holds what
the strategy keeps of the datasets `fit` trained on. They are the public interface
between the strategy and the layers below it: the Keras hook reads and writes them through
`strategy.model_states` and `strategy.training_data`, and the runtime gets what it needs
(the outer optimizer, the running fit's steps per epoch) as arguments.
"""

import weakref

from tf_asgd.keras_glue.evaluation import Evaluator
from tf_asgd.runtime import input_sharding
from tf_asgd.runtime.scheduling import WindowTrainer


class ModelState:
    """One model's state under an `AsyncParameterServerStrategy`.

    Attributes:
        trainer: the model's `scheduling.WindowTrainer`, or None before its
            first `fit` (`ModelStates.ensure_trainer` builds it).
        fitting: whether `model.fit` is running.
        steps_per_epoch: the running `fit`'s steps per epoch; None outside `fit`.
        epochs_left: the running `fit`'s epochs not yet ended, the running one
            included; 0 outside `fit`.
        fit_span: `(first step, steps)` of the running or last `fit`: the
            optimizer's step count at its start (None until the trainer reads
            it, at the fit's first window: `WindowTrainer.fit_step_span`), and
            the steps it was asked for.
        fits: the model's `fit` calls so far, the running one included.
        evaluator: the model's `evaluation.Evaluator`, or None before its
            first evaluation on the workers (`ModelStates.ensure_evaluator`).
        outer_state: the `tf.Module` that tracks the outer optimizer's slots
            (`strategy.outer_state(model)`), or None before it is asked for.
    """

    def __init__(self):
        self.trainer = None
        self.fitting = False
        self.steps_per_epoch = None
        self.epochs_left = 0
        self.fit_span = (0, 0)
        self.fits = 0
        self.evaluator = None
        self.outer_state = None

    def start_fit(self, steps_per_epoch, epochs=1):
        """Records that `model.fit` started, with `steps_per_epoch` steps an epoch
        and `epochs` epochs to run (its span sets the workers' rate warm-up and
        anneal: `WindowTrainer.fit_step_span`)."""
        self.fitting = True
        self.steps_per_epoch = steps_per_epoch
        self.epochs_left = max(1, epochs)
        self.fits += 1
        self.fit_span = (None, steps_per_epoch * max(1, epochs))

    def end_fit(self):
        """Records that `model.fit` ended (also after an error)."""
        self.fitting = False
        self.steps_per_epoch = None
        self.epochs_left = 0


class ModelStates:
    """A strategy's per-model state: a `ModelState` per model, weakly keyed by it.

    `get` only looks up; `get_or_create`, `ensure_trainer` and
    `ensure_evaluator` create what is missing.

    Args:
        strategy: the `AsyncParameterServerStrategy` the models belong to.
        outer_optimizer_for: `fn(optimizer) -> outer optimizer`: what the
            pushes of a model compiled with `optimizer` get on the PS.
    """

    def __init__(self, strategy, outer_optimizer_for):
        self._strategy = strategy
        self._outer_optimizer_for = outer_optimizer_for
        self._states = weakref.WeakKeyDictionary()  # model -> its ModelState

    def get(self, model):
        """`model`'s `ModelState`, or None if it has none (nothing is created)."""
        return self._states.get(model)

    def get_or_create(self, model):
        """`model`'s `ModelState`, created (empty) on first use."""
        state = self._states.get(model)
        if state is None:
            state = self._states[model] = ModelState()
        return state

    def ensure_trainer(self, model):
        """`model`'s `WindowTrainer`, built on first use and again after the
        model was compiled with another optimizer."""
        state = self.get_or_create(model)
        trainer = state.trainer
        if trainer is None or trainer.optimizer is not model.optimizer:
            trainer = WindowTrainer(
                model, self._strategy, self._outer_optimizer_for(model.optimizer), state
            )
            state.trainer = trainer
        return trainer

    def ensure_evaluator(self, model):
        """`model`'s `Evaluator` (built on first use), or None when the
        strategy evaluates on the chief (`evaluation="chief"`)."""
        if self._strategy.evaluation != "workers":
            return None
        state = self.get_or_create(model)
        if state.evaluator is None:
            state.evaluator = Evaluator(model, self._strategy)
        return state.evaluator


class TrainingData:
    """What a strategy keeps of the datasets `fit` trains on, for every model
    alike (the strategy's dataset wrapper iterates without knowing the model)."""

    def __init__(self):
        self._batch_sharded = weakref.WeakSet()  # datasets sharded by batch over the workers
        self._last_iterator = None  # (dataset, per_worker_dataset_fn, iterator)
        self._last_repeated = None  # (a fit's dataset, its repeat())
        self._plans = weakref.WeakKeyDictionary()  # dataset -> its input_sharding.ShardPlan
        self._sharded_iterators = weakref.WeakSet()  # per-worker iterators over shards

    def shard_by_batch(self, dataset):
        """Marks a dataset built from arrays (by `keras_hook`) to be sharded by
        batch over the workers."""
        self._batch_sharded.add(dataset)

    def is_sharded_by_batch(self, dataset):
        """Whether `shard_by_batch(dataset)` was called."""
        return dataset in self._batch_sharded

    def shard_plan(self, dataset, num_workers):
        """How `dataset` is split over `num_workers` workers (an
        `input_sharding.ShardPlan`), resolved once per dataset object: arrays (marked
        by `shard_by_batch`) by batch, a `tf.data.Dataset` by its `auto_shard_policy`."""
        plan = self._plans.get(dataset)
        if plan is None or plan.num_workers != num_workers:
            if self.is_sharded_by_batch(dataset):
                plan = input_sharding.ShardPlan(
                    input_sharding.Policy.DATA,
                    "arrays",
                    input_sharding.serialize(dataset),
                    num_workers,
                )
            else:
                plan = input_sharding.plan(dataset, num_workers)
            self._plans[dataset] = plan
        return plan

    def mark_sharded(self, iterator):
        """Marks a per-worker iterator as reading each worker's own shard."""
        self._sharded_iterators.add(iterator)

    def is_sharded(self, iterator):
        """Whether `mark_sharded(iterator)` was called: its workers need no offset."""
        return iterator in self._sharded_iterators

    def repeated(self, dataset):
        """`dataset.repeat()`, the last call's object again for the same
        `dataset` (what `fit` trains on: the same object lets a later `fit`
        keep the workers' iterators, `iterator`)."""
        if self._last_repeated is None or self._last_repeated[0] is not dataset:
            self._last_repeated = (dataset, dataset.repeat())
        return self._last_repeated[1]

    def iterator(self, dataset, per_worker_dataset_fn, make):
        """The workers' iterator for training on `dataset`: the last `fit`'s
        when it trained on the same dataset object with the same
        `per_worker_dataset_fn`, else a new one, `make()`, which replaces it.

        Kept because deleting a per-worker iterator holds the workers for up
        to seconds at the next `fit`'s start (results/throughput/README.md),
        and because each worker skips its offset of batches only once per
        model (`window.WindowFunction._shift_data_once`): fresh iterators
        would start every worker at the same batch again.
        """
        last = self._last_iterator
        if last is None or last[0] is not dataset or last[1] is not per_worker_dataset_fn:
            last = self._last_iterator = (dataset, per_worker_dataset_fn, make())
        return last[2]
