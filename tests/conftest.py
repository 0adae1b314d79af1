"""Shared fixtures: offline digits data, one factory of real loopback TF clusters, and a
guard that turns a hang into a failure (`hang_guard`, for tests that kill tasks).

Tests under tests/cluster/ start TF servers, the launcher or a fresh TensorFlow process and
are marked `cluster`; tests under tests/unit/ do none of these (the fast tier:
`pytest tests/unit`, or `-m "not cluster"`).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import contextlib  # noqa: E402 (TF's log level is set before TF loads)
import faulthandler  # noqa: E402
import gc  # noqa: E402
import pathlib  # noqa: E402

import pytest  # noqa: E402

# Keras and tf_asgd are imported where a fixture needs them, in the processes that run
# tests: under `-n N` the controlling process only schedules, and need not load TF.

CLUSTER_TESTS = pathlib.Path(__file__).parent / "cluster"


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups (--dist=loadgroup)
def pytest_collection_modifyitems(config, items):
    for item in items:
        cluster = CLUSTER_TESTS in pathlib.Path(item.path).parents
        if cluster:
            item.add_marker(pytest.mark.cluster)
        # Under `-n N` a module's cluster, or any module-scoped fixture, is made once: the
        # tests that use it run in one process. Other tests (the launcher's, the benchmark suites')
        # go wherever a process is free, which keeps both cores busy to the end. A group is
        # named by the module's dotted path from the rootdir (`tests.cluster.test_push`).
        if _uses_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


def _uses_a_module_fixture(item):
    info = getattr(item, "_fixtureinfo", None)  # private: pytest has no public fixture scopes
    defs = info.name2fixturedefs.values() if info else ()
    return any(d[-1].scope in ("module", "class", "package") for d in defs)


@pytest.fixture(autouse=True)
def _seed():
    """Same initial weights every run; what stays random is the cluster's timing."""
    import keras

    keras.utils.set_random_seed(0)


@pytest.fixture(autouse=True)
def _free_what_the_test_left(request):
    """After a cluster test, frees the tf.functions it left while this process is still
    connected to its cluster. Freed later, while connected to another cluster, each one
    costs a synchronous RPC per task of that cluster (`internals.mark_tasks_gone`).

    What survives is frozen (`gc.freeze`): the next collection then walks only what later
    tests make, not TensorFlow's and Keras's modules again (about 0.2 s a test). A frozen
    object that later becomes cyclic garbage is never collected until the process exits;
    what it holds on a cluster's tasks goes with the module's clusters (`local_cluster`)."""
    yield
    if CLUSTER_TESTS in pathlib.Path(request.node.path).parents:
        gc.collect()
        gc.freeze()


@pytest.fixture(scope="session")
def _fork_server_anchor():
    """A one-worker cluster held open for the session: its fork server (`task_forks`)
    then outlives every module's clusters, and each new cluster forks its tasks from it
    instead of importing TensorFlow again (about 6 s of CPU and 4 s of waiting each)."""
    import tf_asgd

    with tf_asgd.LocalCluster(num_workers=1, num_ps=1, shared_process=True) as anchor:
        yield anchor


@pytest.fixture(autouse=True)
def _one_fork_server(request):
    """A cluster test's process holds one fork server from its first cluster test on."""
    if CLUSTER_TESTS in pathlib.Path(request.node.path).parents:
        request.getfixturevalue("_fork_server_anchor")


@pytest.fixture
def hang_guard():
    """A hang fails loudly: after 300 s the test process dumps its threads and
    exits (its LocalCluster tasks follow through their stdin lifeline). A module
    that kills tasks asks for it: `pytestmark = pytest.mark.usefixtures("hang_guard")`."""
    faulthandler.dump_traceback_later(300, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="session")
def digits():
    import tf_asgd

    return tf_asgd.data.load_digits()


@pytest.fixture(scope="session")
def flat(digits):
    """`digits` with each 8x8 image flattened to 64 features."""
    (x, y), (xt, yt) = digits
    return (x.reshape(len(x), -1), y), (xt.reshape(len(xt), -1), yt)


@pytest.fixture(scope="module")
def local_cluster():
    """The one cluster factory. `local_cluster(num_workers, num_ps=1)` is a cluster shared
    by every test of the module that asks for that shape, all its tasks in one child
    process. `local_cluster(..., own=True)` is a new, unstarted `LocalCluster` for one test
    (`with local_cluster(1, own=True, shared_process=False) as c:`), for tests that kill,
    stop or restart tasks.

    Shared clusters close with their module: their tasks exit holding whatever the
    module's fits left on the workers (per-worker iterators kept alive by `gc.freeze`),
    which a later module's connection would otherwise wait for the workers to destroy one
    by one (minutes, after a module of many fits on one strategy)."""
    import tf_asgd

    shared, stack = {}, contextlib.ExitStack()

    def make(num_workers, num_ps=1, shared_process=True, own=False):
        if own:
            return tf_asgd.LocalCluster(
                num_workers=num_workers, num_ps=num_ps, shared_process=shared_process
            )
        if (num_workers, num_ps) not in shared:
            shared[num_workers, num_ps] = stack.enter_context(
                tf_asgd.LocalCluster(num_workers=num_workers, num_ps=num_ps, shared_process=True)
            )
        return shared[num_workers, num_ps]

    with stack:
        yield make


@pytest.fixture(scope="module")
def cluster(local_cluster):
    """2 workers and 1 PS, shared: the shape most tests train on."""
    return local_cluster(2)
