"""How a `tf.data.Dataset` given to `fit` is split over the workers.

TensorFlow's convention (`tf.data.experimental.AutoShardPolicy`, as
`MultiWorkerMirroredStrategy` applies it): by file where the pipeline reads files, else by
data; the pipeline's `options().experimental_distribute.auto_shard_policy` chooses, and
`OFF` opts out. `plan` resolves the policy on the chief before anything is scheduled;
`shard` applies it on each worker to the dataset rebuilt from its graph. Every worker
rebuilds the same graph, so a seeded shuffle draws the same order on each, and sharding
it by batch gives disjoint batches; under sharding by file or data the chief gives
unseeded shuffles the same seeds for every worker. Why and what each policy costs:
docs/guide/data.md.
"""

import dataclasses
import time
import weakref

import numpy as np
import tensorflow as tf

from tf_asgd import internals

Policy = tf.data.experimental.AutoShardPolicy

# tf.data's file readers (TF's `auto_shard.cc` looks for the same ones).
READERS = frozenset(
    {
        "TFRecordDataset",
        "TFRecordDatasetV2",
        "TextLineDataset",
        "FixedLengthRecordDataset",
        "FixedLengthRecordDatasetV2",
        "ArrayRecordDataset",
        "RecordIODataset",
        "SSTableDataset",
    }
)
# Shuffles whose seeds are inputs: (op, index of `seed`, index of `seed2`).
_SEEDED_SHUFFLES = {"ShuffleDatasetV3": (2, 3), "ShuffleAndRepeatDatasetV2": (2, 3)}
_EXTERNAL_STATE_WARN = 0  # DatasetToGraphV2's ExternalStatePolicy.WARN, as TF's coordinator
_chief_copies = weakref.WeakKeyDictionary()  # a dataset built before connecting -> `on_chief`'s
_sources = weakref.WeakKeyDictionary()  # `on_chief`'s copy -> the dataset whose Python it calls


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """How a dataset is split over the workers.

    Attributes:
        policy: the `AutoShardPolicy` applied: `FILE`, `DATA`, `HINT` or `OFF`.
        reason: why, in words, for the log line of each `fit`.
        graph: the dataset's serialized graph as the workers rebuild it (a string
            tensor), unseeded shuffles given fixed seeds under `FILE` and `DATA`.
        num_workers: the workers it is split over.
    """

    policy: Policy
    reason: str
    graph: tf.Tensor
    num_workers: int

    def describe(self):
        """One line for the log: what each worker reads."""
        if self.policy == Policy.OFF:
            return f"not sharded: every worker reads all of it ({self.reason})"
        what = {Policy.FILE: "by file", Policy.DATA: "by batch", Policy.HINT: "by hint"}
        return f"sharded {what[self.policy]} over {self.num_workers} workers ({self.reason})"


def serialize(dataset):
    """The dataset's graph, serialized as TF's coordinator ships it (a string tensor)."""
    return tf.raw_ops.DatasetToGraphV2(
        input_dataset=tf.data.experimental.to_variant(dataset),
        external_state_policy=_EXTERNAL_STATE_WARN,
        strip_device_assignment=True,
    )


def rebuild(graph, element_spec):
    """The dataset of a serialized graph (`serialize`)."""
    return tf.data.experimental.from_variant(
        tf.raw_ops.DatasetFromGraph(graph_def=graph), element_spec
    )


def on_chief(dataset):
    """`dataset` as the chief can iterate it now.

    Connecting to a cluster renames this process's devices (`/job:localhost` becomes
    `/job:chief`), so a dataset built before the strategy was created is on a device
    that no longer exists: an iterator of it fails (TF's coordinator ships datasets
    as graphs, which is why training on it works). So do the ops that
    `tf.py_function`, `tf.numpy_function` and `Dataset.from_generator` pinned to the
    old name, also in a dataset built later on top of such a one. Such a dataset is
    rebuilt from its graph on the chief's devices, those ops moved to the new name
    (they call back into this process); its elements are the same. The copy of a
    pipeline without them is made once per dataset.

    Args:
        dataset: a `tf.data.Dataset` given to `fit`, `evaluate` or `predict`.

    Returns:
        `dataset` itself where its device is still this process's, else the copy.

    Raises:
        ValueError: the dataset was built before connecting and its graph cannot be
            serialized.
    """
    host = _task(tf.DeviceSpec.from_string(internals.host_address_space()))
    known = {host} | {
        _task(tf.DeviceSpec.from_string(d.name)) for d in tf.config.list_logical_devices()
    }
    stale = _stale_tasks(dataset, known)
    if not stale:
        return dataset
    copy = _chief_copies.get(dataset)
    if copy is not None:
        return copy
    try:  # devices kept: the old name is what marks the ops to move
        graph = tf.raw_ops.DatasetToGraphV2(
            input_dataset=tf.data.experimental.to_variant(dataset),
            external_state_policy=_EXTERNAL_STATE_WARN,
            strip_device_assignment=False,
        )
    except tf.errors.OpError as e:
        own = _task(tf.DeviceSpec.from_string(internals.dataset_device(dataset)))
        if own not in stale:
            return dataset  # only what it reads is older: it may iterate as it is
        raise ValueError(
            "This tf.data.Dataset was built before the strategy connected to the cluster, "
            f"which renamed this process's devices (/job:{own[0]} is gone), and it cannot "
            f"be rebuilt on the new ones: {e.message}. Build the dataset after creating the "
            "AsyncParameterServerStrategy (inside the `with LocalCluster(...)` block)."
        ) from e
    graph_def = tf.compat.v1.GraphDef.FromString(graph.numpy())
    moved = 0
    for nodes in [graph_def.node] + [f.node_def for f in graph_def.library.function]:
        for node in nodes:
            spec = tf.DeviceSpec.from_string(node.device) if node.device else None
            if spec is not None and _task(spec) in stale:
                spec = spec.replace(job=host[0], replica=host[1], task=host[2])
                node.device, moved = spec.to_string(), moved + 1
    copy = rebuild(tf.constant(graph_def.SerializeToString()), dataset.element_spec)
    if moved:  # its Python functions live as long as the dataset that registered them
        _sources[copy] = dataset
    else:
        _chief_copies[dataset] = copy
    return copy


def _task(spec):
    """The task part of a `tf.DeviceSpec`."""
    return spec.job, spec.replica, spec.task


def _stale_tasks(dataset, known):
    """The tasks not in `known` (`_task`s: this process's and the cluster's) that
    `dataset`, or a dataset it reads, was built on."""
    found, todo, seen = set(), [dataset], set()
    while todo:
        d = todo.pop()
        if id(d) in seen:
            continue
        seen.add(id(d))
        spec = tf.DeviceSpec.from_string(internals.dataset_device(d))
        if spec.job and _task(spec) not in known:
            found.add(_task(spec))
        todo.extend(internals.dataset_inputs(d))
    return found


def plan(dataset, num_workers, rng=None):
    """Resolves the dataset's `auto_shard_policy` for `num_workers` workers, on the chief.

    `AUTO` (TF's default) shards by file where the pipeline reads at least as many
    files as there are workers, else by data. `FILE` with fewer files than workers,
    or no file at all, is refused here rather than failing on the workers.

    Args:
        dataset: the `tf.data.Dataset` given to `fit`.
        num_workers: the number of workers.
        rng: a `numpy.random.Generator` for the seeds of unseeded shuffles (default: a
            fresh one).

    Returns:
        A `ShardPlan`.

    Raises:
        ValueError: the policy is `FILE` and the pipeline reads fewer files than there
            are workers (or reads none).
    """
    policy = Policy(int(dataset.options().experimental_distribute.auto_shard_policy))
    graph = serialize(dataset)
    if policy == Policy.OFF:
        return ShardPlan(policy, "auto_shard_policy OFF", graph, num_workers)
    if policy == Policy.HINT:
        return ShardPlan(policy, "auto_shard_policy HINT", graph, num_workers)
    graph_def = tf.compat.v1.GraphDef.FromString(graph.numpy())
    files = _count_files(graph_def, num_workers)
    if policy == Policy.FILE and (files is None or files < num_workers):
        found = "no files" if files is None else f"{files} file(s)"
        raise ValueError(
            f"auto_shard_policy FILE needs at least as many input files as workers: the "
            f"dataset reads {found} for {num_workers} workers. Write more files, or use "
            "AutoShardPolicy.DATA (each worker reads everything and keeps its batches)."
        )
    if files is not None and files >= num_workers:
        chosen, reason = Policy.FILE, f"reads at least {files} files"
    else:
        chosen = Policy.DATA
        reason = "reads no files" if files is None else f"reads {files} file(s), fewer than workers"
        if policy == Policy.DATA:
            reason = "auto_shard_policy DATA"
    # Shards must agree on the order they split (the batches, or a shuffled file list).
    graph_def, fixed = _fix_shuffle_seeds(graph_def, rng or np.random.default_rng())
    if fixed:
        reason += f"; {fixed} unseeded shuffle(s) seeded alike on every worker"
        graph = tf.constant(graph_def.SerializeToString())
    return ShardPlan(chosen, reason, graph, num_workers)


def shard(dataset, shard_plan, index):
    """On a worker: `dataset` (rebuilt from `shard_plan.graph`) as its shard.

    Args:
        dataset: the rebuilt dataset.
        shard_plan: its `ShardPlan`.
        index: the worker's index, a scalar tensor.

    Returns:
        The worker's part of `dataset` (all of it under `OFF`).
    """
    n = shard_plan.num_workers
    if shard_plan.policy == Policy.OFF or n == 1:
        return dataset
    index = tf.cast(index, tf.int64)
    if shard_plan.policy == Policy.DATA:
        # TF's DATA rewrite shards the pipeline's last elements (its batches): the same.
        return dataset.shard(n, index)
    return internals.auto_shard_dataset(dataset, n, index, shard_plan.policy)


def _functions_reading_files(graph_def):
    """Names of the graph's library functions that read files, directly or through
    functions they call."""
    calls, reads = {}, set()
    for f in graph_def.library.function:
        name = f.signature.name
        calls[name] = {
            a.func.name for node in f.node_def for a in node.attr.values() if a.HasField("func")
        }
        if any(node.op in READERS for node in f.node_def):
            reads.add(name)
    grew = True
    while grew:
        grew = False
        for name, called in calls.items():
            if name not in reads and called & reads:
                reads.add(name)
                grew = True
    return reads


def _count_files(graph_def, num_workers):
    """How many files the pipeline reads, counted up to `num_workers`; None if it reads
    none (or none that TF's FILE sharding would find)."""
    nodes = {node.name: node for node in graph_def.node}
    reading = _functions_reading_files(graph_def)
    for node in graph_def.node:
        if node.op in READERS:  # a reader at the top: its file names are a constant
            source = nodes.get(node.input[0].split(":")[0])
            if source is not None and source.op == "Const":
                return int(tf.make_ndarray(source.attr["value"].tensor).size)
            return None
        funcs = {a.func.name for a in node.attr.values() if a.HasField("func")}
        if funcs & reading:  # flat_map / interleave over a dataset of file names
            return _count_elements(graph_def, node.input[0].split(":")[0], num_workers)
    return None


def _count_elements(graph_def, node_name, limit):
    """The elements (up to `limit`) of the dataset that node `node_name` makes."""
    sub = tf.compat.v1.GraphDef()
    sub.CopyFrom(graph_def)
    for node in sub.node:
        if node.op == "_Retval":
            del node.input[:]
            node.input.append(node_name)
    try:
        files = rebuild(tf.constant(sub.SerializeToString()), tf.TensorSpec([], tf.string))
        return int(files.take(limit).reduce(0, lambda n, _: n + 1))
    except (tf.errors.OpError, TypeError, ValueError):
        return None


def _fix_shuffle_seeds(graph_def, rng):
    """`(graph_def, count)`: the graph with every top-level shuffle whose seeds are both 0
    (random on each worker) given the same random seeds, and how many were."""
    out = tf.compat.v1.GraphDef()
    out.CopyFrom(graph_def)
    nodes = {node.name: node for node in out.node}
    fixed = 0
    for node in out.node:
        if node.op not in _SEEDED_SHUFFLES:
            continue
        seeds = [nodes.get(node.input[i].split(":")[0]) for i in _SEEDED_SHUFFLES[node.op]]
        if any(s is None or s.op != "Const" for s in seeds):
            continue
        if any(tf.make_ndarray(s.attr["value"].tensor).item() != 0 for s in seeds):
            continue
        for s in seeds:
            value = np.int64(rng.integers(1, 2**31 - 1))
            s.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value))
        fixed += 1
    return out, fixed


COUNT_LIMIT_S = 60.0  # the longest a dataset of unknown length is counted on the chief


def count_batches(dataset, limit_s=None):
    """The batches of one pass over `dataset`, whose length `tf.data` does not know (files,
    `filter`, `from_generator`), counted by reading it once on the chief, as Keras learns an
    epoch's steps from its first pass.

    Args:
        dataset: a `tf.data.Dataset` of unknown cardinality.
        limit_s: the longest the count may take (None: `COUNT_LIMIT_S`).

    Returns:
        `(batches, seconds)`.

    Raises:
        ValueError: the pass did not end within `limit_s` (it may be infinite).
    """
    limit_s = COUNT_LIMIT_S if limit_s is None else limit_s
    start, count = time.monotonic(), 0
    for _ in dataset.prefetch(tf.data.AUTOTUNE):
        count += 1
        if time.monotonic() - start > limit_s:
            raise ValueError(
                f"fit under AsyncParameterServerStrategy needs an epoch's steps: the training "
                f"data's length is unknown, and reading it once on the chief found more than "
                f"{count} batches in {limit_s:g} s without an end (it may repeat forever). "
                "Pass `steps_per_epoch=...` to `fit`, or give the dataset its length with "
                "`dataset.apply(tf.data.experimental.assert_cardinality(n))`."
            )
    return count, time.monotonic() - start
