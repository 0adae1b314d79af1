"""Shared fixtures: offline digits data and real loopback TF clusters."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import pytest

import tf_asgd

CLUSTER_FIXTURES = {"cluster", "cluster1", "cluster3", "cluster4", "sharded_cluster"}


def pytest_collection_modifyitems(config, items):
    # A test that takes a cluster fixture starts one; the rest mark themselves.
    for item in items:
        if CLUSTER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.cluster)


@pytest.fixture(autouse=True)
def _seed():
    """Same initial weights every run; what stays random is the cluster's timing."""
    keras.utils.set_random_seed(0)


@pytest.fixture(scope="session")
def digits():
    return tf_asgd.data.load_digits()


@pytest.fixture(scope="session")
def cluster():
    """2 workers and 1 PS, all tasks in one child process, for the session."""
    with tf_asgd.LocalCluster(num_workers=2, num_ps=1, shared_process=True) as c:
        yield c


@pytest.fixture(scope="session")
def cluster1():
    """1 worker and 1 PS."""
    with tf_asgd.LocalCluster(num_workers=1, num_ps=1, shared_process=True) as c:
        yield c


@pytest.fixture(scope="session")
def cluster3():
    """3 workers and 1 PS (GEM's fixed-order test)."""
    with tf_asgd.LocalCluster(num_workers=3, num_ps=1, shared_process=True) as c:
        yield c


@pytest.fixture(scope="session")
def cluster4():
    """4 workers and 1 PS (convergence with the default outer optimizer)."""
    with tf_asgd.LocalCluster(num_workers=4, num_ps=1, shared_process=True) as c:
        yield c


def compile_digits(model, optimizer=None):
    model.compile(
        optimizer or keras.optimizers.SGD(0.05, momentum=0.9),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model
