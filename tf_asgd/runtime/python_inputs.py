"""Python-side training data, read by the chief and sent to the workers.

A `keras.utils.PyDataset`, a Python generator and a `tf.data` pipeline that calls Python
make each batch in the chief's interpreter, so the chief reads them with Keras's own data
adapter and each closure takes its windows' batches as arguments: `ChiefFeed.read` takes
them in order (each batch once per pass), `ChiefFeed.pack` flattens them into tensors of
values and shapes, and `sent_batches` rebuilds them on the worker. Epochs, `on_epoch_*`
calls and errors are as in Keras. Details: docs/architecture.md.
"""

import warnings
import weakref

import numpy as np
import tensorflow as tf

from tf_asgd import internals

_feeds = weakref.WeakKeyDictionary()  # the dataset handed to Keras -> its ChiefFeed
_fits = weakref.WeakKeyDictionary()  # model -> the ChiefFeed of its running fit

# Keras's own words when the data ends before the epoch (EpochIterator).
RAN_OUT = (
    "Your input ran out of data; interrupting training. Make sure that your dataset "
    "or generator can generate at least `steps_per_epoch * epochs` batches. You may "
    "need to use the `.repeat()` function when building your dataset."
)


def chief_feed(x, y, sample_weight, batch_size, shuffle, class_weight, what):
    """The `ChiefFeed` of `fit`'s training arguments, and the dataset to hand
    Keras in their place.

    Args:
        x, y, sample_weight, batch_size, shuffle, class_weight: as given to
            `fit` (Keras's adapter checks them and raises as Keras does).
        what: the data, in words (for error messages).

    Returns:
        `(feed, dataset)`: `dataset` has the data's element spec and is
        infinite (Keras must not end an epoch at the data's length; the feed
        does); it is never read: `feed_of(dataset)` is what the strategy
        hands out for it.

    Raises:
        ValueError: the data has a component that is not a dense tensor of
            known rank, or no batch.
    """
    adapter = internals.keras_data_adapter(x, y, sample_weight, batch_size, shuffle, class_weight)
    feed = ChiefFeed(adapter, what)
    dataset = adapter.get_tf_dataset().repeat()
    _feeds[dataset] = feed
    return feed, dataset


def feed_of(dataset):
    """The `ChiefFeed` that stands for `dataset` (from `chief_feed`), or None."""
    try:
        return _feeds.get(dataset)
    except TypeError:  # not weak-referenceable: not ours
        return None


def is_feed(iterator):
    """Whether a train function's `iterator` is a `ChiefFeed`."""
    return isinstance(iterator, ChiefFeed)


def start_fit(model, feed):
    """Records that `model`'s running `fit` reads `feed`."""
    _fits[model] = feed


def end_epoch(model):
    """At an epoch's end (its windows done): the data's `on_epoch_end`, if
    `model`'s running fit reads a `ChiefFeed`."""
    feed = _fits.get(model)
    if feed is not None:
        feed.end_epoch()


def end_fit(model, trainer):
    """After `fit` (also after an error): closes the fit's `ChiefFeed` and
    drops its windows that were never scheduled from `trainer`'s queue."""
    feed = _fits.pop(model, None)
    if feed is None:
        return
    feed.close()
    if trainer is not None:  # (windows stay queued only after an error)
        dropped = trainer.scheduler.drop_queued(lambda w: feed.holds(w[1]))
        feed.release([w[1] for w in dropped])


class ChiefFeed:
    """Python-side training data, read on the chief window by window.

    Keras's train function receives it in place of the workers' iterator
    (`strategy._WindowDataset`); the trainer reads each window's batches
    (`read`), packs a closure's (`pack`) and releases them once the window's
    result is back (`release`).

    Args:
        adapter: Keras's data adapter for the data
            (`internals.keras_data_adapter`).
        what: the data, in words.

    Attributes:
        element_spec: the batches' `tf.TensorSpec`s (Keras's, from the data's
            first batches).
        num_batches: batches in a pass (`len()` of a `PyDataset`), or None.
        steps_per_epoch: the fit's steps per epoch (set by the Keras hook).
        ran_out: True once a Python generator has no more batches.
    """

    def __init__(self, adapter, what):
        self.what = what
        self._adapter = adapter
        self._once = internals.adapter_reads_once(adapter)
        # A tf.data pipeline repeats (an epoch may span passes); data of a
        # known length ends an epoch at a pass's end, as Keras does.
        self._pass_length = (
            None if internals.adapter_is_tf_dataset(adapter) else adapter.num_batches
        )
        self.num_batches = adapter.num_batches  # a pass's batches, or None if unknown
        self.element_spec = adapter.get_tf_dataset().element_spec
        self._specs = _dense_specs(self.element_spec, what)
        self.signature = tuple(
            (tf.TensorSpec([None], s.dtype), tf.TensorSpec([None, s.shape.rank], tf.int64))
            for s in self._specs
        )
        self.key = repr(self.element_spec)  # one trace per element spec
        self.steps_per_epoch = None
        self.ran_out = False
        self._pass, self._pass_read, self._pass_over = None, 0, False
        self._ahead = []  # read for the model's build, not yet given to a window
        self._windows = {}  # window id -> its batches (lists of arrays), until released
        self._in_epoch = False
        self._epoch_read = 0
        self._warned = False
        adapter.on_epoch_end()  # as Keras's fit does before its first epoch

    # ---- reading, on the chief --------------------------------------------

    def __iter__(self):  # Keras's epoch iterator takes `iter()` of what the strategy hands out
        return self

    def __next__(self):
        raise TypeError(
            "A ChiefFeed is read window by window by the strategy's train function "
            "(`read`), not batch by batch."
        )

    def local_iterator(self):
        """For the model's build on the chief (`keras_hook.local_mode`): an
        iterator of the first batch, which stays the first one trained on."""
        if not self._ahead:
            batch = self._next()
            if batch is None:
                raise ValueError(f"The training data ({self.what}) has no batch to train on.")
            self._ahead.append(batch)
        leaves = [tf.constant(a) for a in self._ahead[0]]
        return iter([tf.nest.pack_sequence_as(self.element_spec, leaves)])

    def read(self, window_id, num_steps):
        """Reads window `window_id`'s batches, `num_steps` of them or fewer
        where the epoch's pass ends (or a generator runs out, `ran_out`).

        Returns:
            The number of batches read (the window's steps; 0: no window).
        """
        batches = []
        while len(batches) < num_steps:
            batch = self._next()
            if batch is None:
                break
            batches.append(batch)
        self._epoch_read += len(batches)
        if len(batches) < num_steps and not self._warned:
            self._warned = True  # once an epoch, as Keras warns
            warnings.warn(RAN_OUT, stacklevel=2)
        if batches:
            self._windows[window_id] = batches
        return len(batches)

    def _next(self):
        """The next batch (checked, as NumPy leaves), or None where the
        epoch's pass is over or the data ran out."""
        if not self._in_epoch:
            self._adapter.on_epoch_begin()
            self._in_epoch = True
        if self._ahead:
            return self._ahead.pop(0)
        if self.ran_out or self._pass_over:
            return None
        if (
            self._pass is not None
            and self._pass_length is not None
            and (self._pass_read >= self._pass_length)
        ):
            self._pass_over = True  # the next epoch starts a new pass, as in Keras
            return None
        for _ in range(2):  # a finished pass may be followed by a new one
            if self._pass is None:
                self._pass, self._pass_read = iter(self._adapter.get_numpy_iterator()), 0
            try:
                batch = next(self._pass)
            except StopIteration:
                if self._once or self._pass_read == 0:
                    self.ran_out = True  # a generator is read once; an empty pass ends it too
                    return None
                self._pass = None
                if self._pass_length is not None:
                    self._pass_over = True  # shorter than its len(): the epoch ends here
                    return None
                continue
            self._pass_read += 1
            return self._checked(batch)
        self.ran_out = True
        return None

    def _checked(self, batch):
        """A batch's leaves as arrays of the spec's dtypes, after checking
        them against the element spec as `Dataset.from_generator` would."""
        try:
            tf.nest.assert_same_structure(batch, self.element_spec, check_types=False)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"A batch of the training data ({self.what}) does not have the structure "
                f"of its first batches ({self.element_spec}): {e}"
            ) from None
        out = []
        for leaf, spec in zip(tf.nest.flatten(batch), self._specs):
            array = np.asarray(leaf, dtype=spec.dtype.as_numpy_dtype)
            if not spec.shape.is_compatible_with(array.shape):
                raise TypeError(
                    f"The training data ({self.what}) gave an element of shape {array.shape} "
                    f"where an element of shape {spec.shape} was expected (from its first "
                    "batches): make the dimensions other than the batch size the same in "
                    "every batch, or different in the first two."
                )
            out.append(array)
        return out

    def end_epoch(self):
        """At an epoch's end, with its windows done: the adapter's (the
        `PyDataset`'s) `on_epoch_end`, as Keras calls it at the end of an
        epoch's steps (not for an epoch stopped early by `stop_training`),
        and the next epoch starts a new pass of data of known length."""
        full = self.steps_per_epoch is None or self._epoch_read >= self.steps_per_epoch
        if self._in_epoch and (full or self._pass_over or self.ran_out):
            self._adapter.on_epoch_end()
            self._in_epoch = False
        read_all = self._pass_length is not None and self._pass_read >= self._pass_length
        if self._pass_over or read_all:  # as Keras: the next epoch starts a new pass
            self._pass, self._pass_over = None, False
        self._epoch_read, self._warned = 0, False

    def close(self):
        """After `fit`: stops a `PyDataset`'s enqueuer (its threads or
        processes) if an epoch left it running (after an error, or an epoch
        stopped early), without calling the user's `on_epoch_end` (Keras
        does not then either), and drops the current pass."""
        internals.stop_adapter_workers(self._adapter)
        self._pass, self._in_epoch = None, False

    # ---- sending, to the closures -----------------------------------------

    @property
    def batches_held(self):
        """Batches read and kept for windows whose results are not back yet."""
        return sum(len(b) for b in self._windows.values())

    def holds(self, window_id):
        """Whether window `window_id`'s batches are here."""
        return window_id in self._windows

    def pack(self, window_ids):
        """The batches of windows `window_ids`, in order, as a closure's
        argument: per component, a 1-D tensor of all values and an
        `[N, rank]` int64 tensor of each batch's shape (see `signature`)."""
        batches = [b for w in window_ids for b in self._windows[w]]
        packed = []
        for c, spec in enumerate(self._specs):
            leaves = [b[c] for b in batches]
            values = np.concatenate([a.reshape(-1) for a in leaves])
            shapes = np.array([a.shape for a in leaves], np.int64).reshape(
                len(leaves), spec.shape.rank
            )
            packed.append((tf.constant(values, spec.dtype), tf.constant(shapes)))
        return tuple(packed)

    def release(self, window_ids):
        """Drops the batches of windows whose results are back."""
        for w in window_ids:
            self._windows.pop(w, None)


def _dense_specs(element_spec, what):
    """The flat `tf.TensorSpec`s of `element_spec`; raises `ValueError` for a
    component that is not a dense tensor of known rank."""
    specs = tf.nest.flatten(element_spec)
    for spec in specs:
        if not isinstance(spec, tf.TensorSpec) or spec.shape.rank is None:
            raise ValueError(
                f"fit under AsyncParameterServerStrategy sends the batches of {what} from the "
                f"chief to the workers as dense tensors of known rank; one component is "
                f"{spec}. Make every component a dense array (for a tf.data pipeline, give "
                "a py_function's result its shape with tf.ensure_shape), or write the data "
                "to TFRecord files and read them with tf.data.TFRecordDataset."
            )
    return specs


def sent_batches(packed, element_spec):
    """Inside the traced closure: an iterator over the batches `ChiefFeed.pack`
    sent, in order, each with `element_spec`'s static shape.

    Args:
        packed: per component, `(values, shapes)` (see `ChiefFeed.pack`).
        element_spec: the batches' element spec.

    Returns:
        A `tf.data` iterator (what a window reads with `next`).
    """
    specs = tf.nest.flatten(element_spec)
    parts = []
    for (values, shapes), spec in zip(packed, specs):
        sizes = tf.reduce_prod(shapes, axis=1)
        parts.append((values, shapes, tf.cumsum(sizes, exclusive=True), sizes, spec))
    count = tf.shape(packed[0][1], out_type=tf.int64)[0]

    def batch(i):
        leaves = []
        for values, shapes, starts, sizes, spec in parts:
            flat = tf.slice(values, [starts[i]], [sizes[i]])
            leaves.append(tf.ensure_shape(tf.reshape(flat, shapes[i]), spec.shape))
        return tf.nest.pack_sequence_as(element_spec, leaves)

    return iter(tf.data.Dataset.range(count).map(batch))


def window_on_sent_batches(window, element_spec):
    """The function a closure runs on sent batches: `window.run` (a
    `window.WindowFunction`) on `sent_batches` of `element_spec`, without the
    data shift. Trace it with `(feed.signature, plan spec, limits spec)`."""

    def run(packed, plan, limits):
        return window.run_on_sent_batches(sent_batches(packed, element_spec), plan, limits)

    return tf.function(run, autograph=False)
