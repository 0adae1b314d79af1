"""configs/k8s_mnist_gem.yaml, the plain Kubernetes manifest, read as Kubernetes reads it.

No cluster runs here: the manifest is parsed with PyYAML, each pod's environment is expanded
as the kubelet expands it (`$(NAME)` refers to a variable defined above it; the downward API
gives the pod's completion index), and the TF_CONFIG that results is parsed by the launcher's
own parser. The host names it names must be the DNS names that the headless Service gives
the Indexed Jobs' pods (`<job>-<index>.<service>`), one per index, and every pod must run
what the TFJob manifest runs.
"""

import json
import os
import re

import pytest
import yaml

from tf_asgd.cluster.tf_config import parse_tf_config

from helpers import ROOT

INDEX_FIELD = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
ROLE_OF_TFJOB_REPLICA = {"Chief": "chief", "PS": "ps", "Worker": "worker"}


def _load(name):
    with open(os.path.join(ROOT, "configs", name)) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


@pytest.fixture(scope="module")
def manifest():
    return _load("k8s_mnist_gem.yaml")


@pytest.fixture(scope="module")
def tfjob_pods():
    """`{role: the TFJob's pod spec}`."""
    (tfjob,) = _load("tfjob_mnist_gem.yaml")
    return {
        ROLE_OF_TFJOB_REPLICA[replica]: dict(spec["template"]["spec"], replicas=spec["replicas"])
        for replica, spec in tfjob["spec"]["tfReplicaSpecs"].items()
    }


def _of_kind(manifest, kind):
    return [doc for doc in manifest if doc["kind"] == kind]


def _expand(env, config_maps, index):
    """`{name: value}` of a container's `env` as the kubelet sets it for the pod of
    completion index `index`: `$(NAME)` expands a variable defined earlier in the list
    (an undefined one stays as written)."""
    values = {}
    for var in env:
        if "value" in var:
            values[var["name"]] = re.sub(
                r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                lambda m: values.get(m.group(1), m.group(0)),
                var["value"],
            )
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            assert source["fieldRef"]["fieldPath"] == INDEX_FIELD, var
            values[var["name"]] = str(index)
        else:
            ref = source["configMapKeyRef"]
            values[var["name"]] = config_maps[ref["name"]]["data"][ref["key"]]
    return values


def _role_jobs(manifest):
    """`{role: (Job, its container, {index: TF_CONFIG as parsed by the launcher})}`."""
    config_maps = {doc["metadata"]["name"]: doc for doc in _of_kind(manifest, "ConfigMap")}
    jobs = {}
    for job in _of_kind(manifest, "Job"):
        (container,) = job["spec"]["template"]["spec"]["containers"]
        parsed = {}
        for index in range(job["spec"]["completions"]):
            env = _expand(container["env"], config_maps, index)
            parsed[index] = parse_tf_config(env["TF_CONFIG"])
        roles = {task_type for _, task_type, _ in parsed.values()}
        assert len(roles) == 1, (job["metadata"]["name"], roles)
        jobs[roles.pop()] = (job, container, parsed)
    return jobs


def test_kinds_a_headless_service_a_config_map_a_network_policy_and_a_job_per_role(manifest):
    kinds = sorted(doc["kind"] for doc in manifest)
    assert kinds == ["ConfigMap", "Job", "Job", "Job", "NetworkPolicy", "Service"]
    for doc in manifest:
        want = {"Job": "batch/v1", "NetworkPolicy": "networking.k8s.io/v1"}.get(doc["kind"], "v1")
        assert doc["apiVersion"] == want, doc["metadata"]["name"]
    (service,) = _of_kind(manifest, "Service")
    assert service["spec"]["clusterIP"] == "None"
    # Tasks dial each other while they start, before any readiness.
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert sorted(_role_jobs(manifest)) == ["chief", "ps", "worker"]


def test_every_tf_config_host_is_the_dns_name_of_an_indexed_jobs_pod(manifest):
    """`<job>-<index>.<service>:<port>` for every index of every role's Job, and only
    those: the host names an Indexed Job's pods get under the headless Service."""
    (service,) = _of_kind(manifest, "Service")
    name = service["metadata"]["name"]
    (port,) = [p["port"] for p in service["spec"]["ports"]]
    jobs = _role_jobs(manifest)
    clusters = {
        json.dumps(cluster, sort_keys=True)
        for _, _, parsed in jobs.values()
        for cluster, _, _ in parsed.values()
    }
    assert len(clusters) == 1, "every pod must get the same cluster spec"
    cluster = json.loads(clusters.pop())
    assert sorted(cluster) == sorted(jobs)
    for role, (job, container, parsed) in jobs.items():
        spec, pod = job["spec"], job["spec"]["template"]
        assert spec["completionMode"] == "Indexed"
        assert spec["completions"] == spec["parallelism"] == len(cluster[role]), role
        assert pod["spec"]["subdomain"] == name, role
        labels = pod["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items(), role
        want = [f"{job['metadata']['name']}-{i}.{name}:{port}" for i in range(spec["completions"])]
        assert cluster[role] == want
        assert [p["containerPort"] for p in container["ports"]] == [port]
        # Pod i is task i of its role.
        assert {i: (t, k) for i, (_, t, k) in parsed.items()} == {
            i: (role, i) for i in range(spec["completions"])
        }


def test_replicas_match_the_tfjob(manifest, tfjob_pods):
    jobs = _role_jobs(manifest)
    assert {role: job["spec"]["completions"] for role, (job, _, _) in jobs.items()} == {
        role: pod["replicas"] for role, pod in tfjob_pods.items()
    }


def test_every_pod_runs_the_tfjobs_image_and_command(manifest, tfjob_pods):
    jobs = _role_jobs(manifest)
    assert sorted(jobs) == sorted(tfjob_pods)
    for role, (job, container, _) in jobs.items():
        theirs = tfjob_pods[role]["containers"][0]
        for key in ("image", "workingDir", "command", "volumeMounts"):
            assert container.get(key) == theirs.get(key), (role, key)
        pod = job["spec"]["template"]["spec"]
        assert pod.get("volumes") == tfjob_pods[role].get("volumes"), role
    assert jobs["chief"][1]["command"][:4] == [
        "python",
        "-m",
        "tf_asgd.launch",
        "--config=configs/mnist_gem.py",
    ]
    assert "--resume" in jobs["chief"][1]["command"]


def test_the_network_policy_admits_only_the_jobs_own_pods(manifest):
    (policy,) = _of_kind(manifest, "NetworkPolicy")
    (service,) = _of_kind(manifest, "Service")
    selector = service["spec"]["selector"]
    assert policy["spec"]["podSelector"] == {"matchLabels": selector}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": selector}}]
    assert "ports" not in rule  # every port, from these pods only


def test_every_resource_is_valid_against_the_kubernetes_schemas(manifest):
    """Strict schema validation (no unknown field) with the `kubernetes-validate` package
    (its schemas ship in its 22 MB wheel: not a test dependency, so this skips unless it
    is installed: `pip install kubernetes-validate`)."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for doc in manifest:
        for version in ("1.29.0", kubernetes_validate.latest_version()):
            kubernetes_validate.validate(doc, version, strict=True)
