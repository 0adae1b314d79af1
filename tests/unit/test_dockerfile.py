"""The Dockerfile builds the image configs/tfjob_mnist_gem.yaml runs, as written.

No container builder runs here (no daemon, and the base image cannot be
pulled offline), so this checks what can be checked without one: the
Dockerfile's instructions parse, the image installs tf_asgd with TF's CUDA
wheels on a GPU base at supported versions, and the image's /app, laid out
by replaying its COPY instructions (with .dockerignore) into a temporary
directory, has what every pod's `command` needs: the launcher module and the
config it names, which loads with the manifest's flags from there.
"""

import fnmatch
import json
import os
import re
import shlex
import shutil
import sys

import pytest
import yaml
from absl import flags
from ml_collections import config_flags

from helpers import ROOT

INSTRUCTIONS = {
    "FROM",
    "ARG",
    "ENV",
    "RUN",
    "COPY",
    "ADD",
    "WORKDIR",
    "EXPOSE",
    "CMD",
    "ENTRYPOINT",
    "USER",
    "LABEL",
    "VOLUME",
    "SHELL",
    "HEALTHCHECK",
    "STOPSIGNAL",
}


def parse_dockerfile(path):
    """`[(INSTRUCTION, argument text)]`: comments dropped, `\\` continuations joined."""
    out, pending = [], ""
    with open(path) as f:
        for raw in f:
            line = raw.rstrip("\n")
            if not pending and (not line.strip() or line.lstrip().startswith("#")):
                continue
            if pending and line.lstrip().startswith("#"):
                continue  # a comment inside a continuation
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            line, pending = pending + line, ""
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    assert not pending, "the Dockerfile ends inside a line continuation"
    return out


def exec_form(text):
    """The argv of a JSON-form CMD/ENTRYPOINT/RUN, else its shell words."""
    if text.startswith("["):
        return json.loads(text)
    return shlex.split(text)


def dockerignore(path):
    """A predicate `ignored(relative path)` for a .dockerignore (last match
    wins, `!` re-includes, a pattern also matches everything below it)."""
    patterns = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line and not line.startswith("#"):
                    patterns.append((line.startswith("!"), line.lstrip("!").strip("/")))

    def ignored(rel):
        parts = rel.split("/")
        result = False
        for negate, pattern in patterns:
            pattern = pattern.replace("**/", "*/") if pattern.startswith("**/") else pattern
            prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
            hit = any(fnmatch.fnmatch(p, pattern) for p in prefixes) or (
                pattern.startswith("*/") and any(fnmatch.fnmatch(p, pattern[2:]) for p in parts)
            )
            if hit:
                result = not negate
        return result

    return ignored


@pytest.fixture(scope="module")
def dockerfile():
    return parse_dockerfile(os.path.join(ROOT, "Dockerfile"))


@pytest.fixture(scope="module")
def tfjob():
    with open(os.path.join(ROOT, "configs", "tfjob_mnist_gem.yaml")) as f:
        return yaml.safe_load(f)


def _args(dockerfile):
    """ARG defaults, `{name: value}`."""
    return dict(a.split("=", 1) for i, a in dockerfile if i == "ARG" and "=" in a)


def _containers(tfjob):
    for role, spec in tfjob["spec"]["tfReplicaSpecs"].items():
        for container in spec["template"]["spec"]["containers"]:
            yield role, container


def test_the_dockerfile_parses_into_known_instructions(dockerfile):
    names = [i for i, _ in dockerfile]
    assert set(names) <= INSTRUCTIONS, set(names) - INSTRUCTIONS
    assert all(n == "ARG" for n in names[: names.index("FROM")]), "only ARG may precede FROM"
    assert names.count("FROM") == 1
    for instruction, text in dockerfile:
        if instruction in ("CMD", "ENTRYPOINT") or (instruction == "RUN" and text.startswith("[")):
            assert exec_form(text), text


def test_gpu_base_with_tensorflow_cuda_wheels_at_supported_versions(dockerfile):
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from helpers import supported_versions

    args = _args(dockerfile)
    base = dict(dockerfile)["FROM"]
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
    assert base.startswith("nvidia/cuda:") or (
        base.startswith("tensorflow/tensorflow:") and "gpu" in base
    )
    keras_minors, tf_minors = supported_versions()
    assert ".".join(args["TF_VERSION"].split(".")[:2]) in tf_minors
    assert ".".join(args["KERAS_VERSION"].split(".")[:2]) in keras_minors
    runs = " ".join(t for i, t in dockerfile if i == "RUN")
    assert '".[and-cuda]"' in runs and '"tensorflow[and-cuda]==${TF_VERSION}"' in runs
    assert '"keras==${KERAS_VERSION}"' in runs


def test_the_tfjob_runs_this_image_as_written(dockerfile, tfjob, tmp_path):
    """Every pod's image, workingDir and command fit the image's layout."""
    env = " ".join(t for i, t in dockerfile if i == "ENV")
    workdirs = [t for i, t in dockerfile if i == "WORKDIR"]
    assert "ENTRYPOINT" not in dict(dockerfile), "the manifest's command must not be prefixed"
    runs = " ".join(t for i, t in dockerfile if i == "RUN")
    assert (
        "PATH=/opt/venv/bin:" in env and "python3 -m venv /opt/venv" in runs
    )  # `python` is the venv's

    # The image's /app: replay the COPY instructions (relative to WORKDIR) honouring .dockerignore.
    ignored = dockerignore(os.path.join(ROOT, ".dockerignore"))
    image, cwd = tmp_path / "image", "/"
    for instruction, text in dockerfile:
        if instruction == "WORKDIR":
            cwd = os.path.join(cwd, text)
        if instruction == "COPY":
            *sources, dest = shlex.split(text)
            target = image / os.path.join(cwd, dest).lstrip("/")
            for source in sources:  # Docker: a directory's contents go into dest
                src = os.path.join(ROOT, source)
                assert os.path.exists(src) and not ignored(source.rstrip("/")), source
                if os.path.isdir(src):
                    shutil.copytree(
                        src,
                        target,
                        dirs_exist_ok=True,
                        ignore=lambda d, names: [
                            n for n in names if ignored(os.path.relpath(os.path.join(d, n), ROOT))
                        ],
                    )
                else:
                    assert dest.endswith("/") or len(sources) == 1, text
                    into = target if dest.endswith("/") else target.parent
                    into.mkdir(parents=True, exist_ok=True)
                    shutil.copy(
                        src,
                        into / (os.path.basename(source) if dest.endswith("/") else target.name),
                    )

    containers = list(_containers(tfjob))
    assert {role for role, _ in containers} == {"Chief", "PS", "Worker"}
    for role, container in containers:
        assert container["image"].endswith(":0.1.0") and container["image"].split("/")[
            -1
        ].startswith("tf-asgd")
        assert container["workingDir"] == workdirs[-1] == "/app", role
        command = container["command"]
        assert command[:3] == ["python", "-m", "tf_asgd.launch"], role
        app = image / container["workingDir"].lstrip("/")
        assert (app / "pyproject.toml").exists()
        assert (app / "tf_asgd" / "launch" / "__main__.py").exists()
        config = next(a.split("=", 1)[1] for a in command if a.startswith("--config="))
        assert (app / config).exists(), (
            f"{role}: {config} is not in the image's {container['workingDir']}"
        )
        # The config loads from the image's layout with the manifest's own overrides.
        overrides = [a for a in command[3:] if a.startswith("--config.")]
        argv = ["launch", f"--config={app / config}", *overrides]
        fv = flags.FlagValues()
        config_flags.DEFINE_config_file("config", flag_values=fv, lock_config=True, sys_argv=argv)
        fv(argv)
        assert fv.config.dataset == "mnist", role
        if role == "Chief":
            assert fv.config.data_dir == "/shared/data/mnist.npz"
    # Nothing the image does not need travels into the build context.
    assert (
        ignored("results/compat/compat.csv")
        and ignored(".git/HEAD")
        and ignored("tests/unit/test_dockerfile.py")
    )
    assert not ignored("tf_asgd/launch.py") and ignored(
        "tf_asgd/__pycache__/launch.cpython-311.pyc"
    )
