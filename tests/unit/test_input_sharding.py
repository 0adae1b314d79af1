"""`input_sharding.plan` resolves a dataset's `auto_shard_policy` on the chief: files
counted, too few refused under FILE, unseeded shuffles given the same seeds; `shard` gives
each worker its part."""

import numpy as np
import pytest
import tensorflow as tf

from tf_asgd.runtime import input_sharding

Policy = tf.data.experimental.AutoShardPolicy


def _with_policy(dataset, policy):
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = policy
    return dataset.with_options(options)


def _files(tmp_path, n):
    paths = []
    for f in range(n):
        path = str(tmp_path / f"part-{f}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for k in range(4):
                writer.write(str(10 * f + k).encode())
        paths.append(path)
    return paths


def test_in_memory_data_is_sharded_by_batch_and_each_worker_gets_its_own():
    # Unshuffled: in one process the rebuilt shuffles share their seed generator, where
    # the workers' do not (cluster/test_input_sharding_on_cluster.py checks shuffles).
    dataset = tf.data.Dataset.range(40).batch(4)
    plan = input_sharding.plan(dataset, 2)
    assert (plan.policy, plan.reason) == (Policy.DATA, "reads no files")
    assert plan.describe() == "sharded by batch over 2 workers (reads no files)"
    parts = []
    for index in range(2):
        rebuilt = input_sharding.rebuild(plan.graph, dataset.element_spec)
        parts.append([b.numpy().tolist() for b in input_sharding.shard(rebuilt, plan, index)])
    whole = [b.numpy().tolist() for b in input_sharding.rebuild(plan.graph, dataset.element_spec)]
    assert parts[0] == whole[0::2] and parts[1] == whole[1::2]


def test_files_are_counted_and_enough_of_them_are_sharded_by_file(tmp_path):
    paths = _files(tmp_path, 3)
    for dataset in (
        tf.data.TFRecordDataset(paths).batch(2),
        tf.data.Dataset.list_files(str(tmp_path / "*.tfrecord"), shuffle=False)
        .interleave(tf.data.TFRecordDataset)
        .batch(2),
    ):
        plan = input_sharding.plan(dataset, 3)
        assert (plan.policy, plan.reason) == (Policy.FILE, "reads at least 3 files")
        assert input_sharding.plan(dataset, 4).reason == "reads 3 file(s), fewer than workers"
        with pytest.raises(ValueError, match="FILE needs at least as many input files"):
            input_sharding.plan(_with_policy(dataset, Policy.FILE), 4)
    # Each worker reads its own file.
    dataset = tf.data.TFRecordDataset(paths).batch(2)
    plan = input_sharding.plan(dataset, 3)
    first = [
        next(iter(input_sharding.shard(dataset, plan, tf.constant(i, tf.int64))))[0].numpy()
        for i in range(3)
    ]
    assert first == [b"0", b"10", b"20"]


def test_off_and_explicit_policies_are_honoured():
    dataset = tf.data.Dataset.range(8).batch(2)
    assert input_sharding.plan(_with_policy(dataset, Policy.OFF), 2).policy == Policy.OFF
    assert input_sharding.plan(_with_policy(dataset, Policy.DATA), 2).policy == Policy.DATA
    assert input_sharding.plan(_with_policy(dataset, Policy.HINT), 2).policy == Policy.HINT
    with pytest.raises(ValueError, match="reads no files for 2 workers"):
        input_sharding.plan(_with_policy(dataset, Policy.FILE), 2)


def _shuffle_seeds(graph):
    graph_def = tf.compat.v1.GraphDef.FromString(graph.numpy())
    nodes = {n.name: n for n in graph_def.node}
    return [
        [tf.make_ndarray(nodes[n.input[i]].attr["value"].tensor).item() for i in (2, 3)]
        for n in graph_def.node
        if n.op == "ShuffleDatasetV3"
    ]


def test_unseeded_shuffles_get_the_same_seeds_on_every_worker():
    """Under sharding by data an unseeded shuffle (seeds 0, 0: random on each worker) gets
    seeds in the graph that every worker rebuilds; a seeded one keeps its own."""
    tf.random.set_seed(None)  # the test fixture sets a global seed: here none is
    unseeded = tf.data.Dataset.range(64).shuffle(64).batch(8)
    assert _shuffle_seeds(input_sharding.serialize(unseeded)) == [[0, 0]]
    plan = input_sharding.plan(unseeded, 2, rng=np.random.default_rng(0))
    assert "1 unseeded shuffle(s) seeded alike" in plan.reason
    [[seed, seed2]] = _shuffle_seeds(plan.graph)
    assert seed != 0 and seed2 != 0
    seeded = tf.data.Dataset.range(64).shuffle(64, seed=3).batch(8)
    plan = input_sharding.plan(seeded, 2)
    assert "unseeded" not in plan.reason
    assert _shuffle_seeds(plan.graph) == _shuffle_seeds(input_sharding.serialize(seeded))


def test_a_shuffled_file_list_is_seeded_alike_under_file_sharding(tmp_path):
    """`list_files` shuffles its file names unseeded by default: each worker would split a
    different order of files. Under FILE the chief seeds that shuffle too."""
    _files(tmp_path, 3)
    tf.random.set_seed(None)
    dataset = (
        tf.data.Dataset.list_files(str(tmp_path / "*.tfrecord"))
        .interleave(tf.data.TFRecordDataset)
        .batch(2)
    )
    assert [0, 0] in _shuffle_seeds(input_sharding.serialize(dataset))
    plan = input_sharding.plan(dataset, 2)
    assert plan.policy == Policy.FILE and "seeded alike" in plan.reason
    assert all(seed != 0 and seed2 != 0 for seed, seed2 in _shuffle_seeds(plan.graph))
