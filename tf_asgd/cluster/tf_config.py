"""`TF_CONFIG`: parsing and validating it, the roles it names, and resolvers from it.

A cluster is a dict `{job: ["host:port", ...]}` with jobs among `ROLES`; `tf_config_role`
reads this process's role from the environment, `make_resolver` gives the chief's view of
a cluster to `AsyncParameterServerStrategy`.

Example:
    cluster, task_type, task_index = tf_asgd.parse_tf_config(os.environ["TF_CONFIG"])
"""

import json
import os

ROLES = ("chief", "worker", "ps", "evaluator")


def parse_tf_config(text):
    """Parses and validates a `TF_CONFIG` JSON string.

    Args:
        text: the JSON text, `{"cluster": {job: ["host:port", ...]}, "task":
            {"type": job, "index": i}}`, with jobs among "chief", "worker",
            "ps" and "evaluator". A missing task index means 0; the
            evaluator's is not checked (it is no task of the cluster).

    Returns:
        `(cluster, task_type, task_index)`: the cluster dict as given, the
        task's job and its index.

    Raises:
        ValueError: quoting what is wrong: bad JSON, no "cluster" or "task"
            object, an unknown job, addresses that are not "host:port"
            strings, an index out of range, or a cluster with no `ps` or no
            `worker` task.

    Examples:
        >>> cluster, task_type, index = parse_tf_config(
        ...     '{"cluster": {"worker": ["w0:2222", "w1:2222"], "ps": ["p0:2222"]},'
        ...     ' "task": {"type": "worker", "index": 1}}'
        ... )
        >>> task_type, index, cluster["ps"]
        ('worker', 1, ['p0:2222'])
    """
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"TF_CONFIG is not valid JSON ({e}): {text!r}") from None
    if not isinstance(config, dict) or not isinstance(config.get("cluster"), dict):
        raise ValueError(f'TF_CONFIG needs a "cluster" object: {text!r}')
    cluster = config["cluster"]
    for job, addresses in cluster.items():
        if job not in ROLES:
            raise ValueError(
                f"TF_CONFIG cluster has unknown job {job!r}; expected some of {ROLES}."
            )
        if not isinstance(addresses, list) or not all(
            isinstance(a, str) and ":" in a for a in addresses
        ):
            raise ValueError(
                f"TF_CONFIG cluster job {job!r} must be a list of 'host:port' "
                f"strings, got {addresses!r}."
            )
    validate_cluster_spec(cluster)
    task = config.get("task")
    if not isinstance(task, dict):
        raise ValueError(f'TF_CONFIG needs a "task" object: {text!r}')
    task_type, task_index = task.get("type"), task.get("index", 0)
    if isinstance(task_index, str) and task_index.strip().isdigit():
        task_index = int(task_index)  # as TF's own TFConfigClusterResolver reads it
    if task_type not in ROLES:
        raise ValueError(f"TF_CONFIG task type {task_type!r} is not one of {ROLES}.")
    if task_type != "evaluator":
        n = len(cluster.get(task_type, []))
        if not isinstance(task_index, int) or not 0 <= task_index < n:
            raise ValueError(
                f"TF_CONFIG task index {task_index!r} is out of range for job "
                f"{task_type!r}, which has {n} task(s)."
            )
    return cluster, task_type, task_index


def tf_config_role(environ=None):
    """`(cluster, task_type, task_index)` from `TF_CONFIG`, or `None` when unset.

    Raises `ValueError` quoting what is wrong with a malformed `TF_CONFIG`
    (bad JSON, unknown role, index out of range, no ps or worker, no chief).
    """
    environ = os.environ if environ is None else environ
    text = environ.get("TF_CONFIG", "")
    if not text.strip():
        return None
    cluster, task_type, task_index = parse_tf_config(text)
    chiefs = cluster.get("chief", [])
    if len(chiefs) != 1:
        raise ValueError(
            "TF_CONFIG cluster needs exactly one 'chief' task (it runs the "
            f"coordinator and the training loop), got {chiefs!r} in: {text!r}"
        )
    return cluster, task_type, task_index


def validate_cluster_spec(cluster):
    """Raises `ValueError` unless `cluster` has at least one ps and one worker, each task
    at its own address (two tasks on one address fail later, deep in TF's eager
    service)."""
    for job in ("ps", "worker"):
        if not cluster.get(job):
            raise ValueError(
                f"The cluster has no {job!r} task; asynchronous parameter-server "
                f"training needs at least one ps and one worker. Cluster: {cluster}"
            )
    tasks = {}
    for job, addresses in cluster.items():
        pairs = addresses.items() if isinstance(addresses, dict) else enumerate(addresses)
        for index, address in pairs:
            tasks.setdefault(address, []).append(f"{job}:{index}")
    shared = {a: t for a, t in tasks.items() if len(t) > 1}
    if shared:
        named = "; ".join(f"{' and '.join(t)} at {a}" for a, t in shared.items())
        raise ValueError(
            f"Two cluster tasks have the same address ({named}): each task needs its "
            f"own host:port. Cluster: {cluster}"
        )


def validate_coordinator_task(resolver):
    """Raises `ValueError` where `resolver` says this process is a worker or ps task: the
    strategy coordinates from the chief, and a worker's or ps's process serves instead
    (with the training script run on every task, as `MultiWorkerMirroredStrategy` has it,
    each would otherwise wait for the others, itself included, until `connect_timeout`)."""
    task_type = getattr(resolver, "task_type", None)
    if task_type == "evaluator":
        raise ValueError(
            "This process is the cluster's evaluator (its TF_CONFIG says so), and "
            "AsyncParameterServerStrategy runs on the chief only: it would train as a "
            "second chief on the chief's address. An evaluator reads the chief's "
            "checkpoints instead: `python -m tf_asgd.launch --config=...` with this "
            "TF_CONFIG runs one (docs/launcher.md), or evaluate them with plain Keras."
        )
    if task_type not in ("worker", "ps"):
        return
    task = f"{task_type}:{getattr(resolver, 'task_id', 0)}"
    raise ValueError(
        f"This process is {task} of the cluster (its TF_CONFIG says so), and "
        "AsyncParameterServerStrategy runs on the chief only: the chief trains, the ps "
        "and worker tasks serve. Start each ps and worker task as a server instead, with "
        "`python -m tf_asgd.launch --config=...` (docs/launcher.md), or in your script: "
        "`if resolver.task_type in ('worker', 'ps'): tf.distribute.Server(resolver."
        "cluster_spec(), job_name=resolver.task_type, task_index=resolver.task_id, "
        "protocol='grpc').join()` before creating the strategy."
    )


def without_evaluator(resolver):
    """`resolver`, or where its cluster lists an `evaluator` job, a resolver of the same
    task without it: the evaluator runs no TF server, and TF's connection to a cluster
    that lists it waited for it without end."""
    import tensorflow as tf

    spec = resolver.cluster_spec().as_dict()
    if "evaluator" not in spec:
        return resolver
    spec.pop("evaluator")
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(spec),
        task_type=getattr(resolver, "task_type", None),
        task_id=getattr(resolver, "task_id", None),
        rpc_layer=getattr(resolver, "rpc_layer", None) or "grpc",
    )


def make_resolver(cluster, task_type="chief", task_index=0):
    """A `SimpleClusterResolver` for a cluster dict, from the chief's view."""
    import tensorflow as tf

    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster),
        task_type=task_type,
        task_id=task_index,
        rpc_layer="grpc",
    )
