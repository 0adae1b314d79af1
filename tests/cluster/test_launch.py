"""The launcher end to end: `python -m tf_asgd.launch` as users run it.

Each test starts real processes (the launcher, its local TF cluster, or
TF_CONFIG tasks on loopback) and checks that every one of them is gone at
the end.
"""

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from tf_asgd.launch import roles as training
from tf_asgd.launch import run_parts

from helpers import ROOT
from launching import (
    SHORT,
    alive,
    assert_all_stopped,
    before_module_list,
    launcher,
    local_cluster_pids,
    local_cluster_ports,
    parent_pid,
    run_launcher,
    start_launcher,
)


def test_help_lists_every_flag_and_loads_no_tensorflow():
    """The launcher reads its flags and config before it imports TensorFlow
    (it may re-execute itself in a network namespace first)."""
    cmd, env = launcher(["--help"])
    proc = subprocess.run(
        [cmd[0], "-X", "importtime", *cmd[1:]],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode in (0, 1), proc.stderr  # absl's --help exits 1
    out = proc.stdout + proc.stderr
    for flag in ("--config", "--workdir", "--[no]resume", "--gpus_per_worker"):
        assert flag in out
    for field in (
        "n_sync",
        "staleness",
        "gem.enabled",
        "num_workers",
        "batch_size",
        "steps_per_epoch",
    ):
        assert field in out
    imported = {
        line.rsplit("|", 1)[1].strip()
        for line in proc.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "tf_asgd.launch.config_fields" in imported
    assert not imported & {"tensorflow", "keras"}


def test_default_run_prints_no_noise_then_resume_continues_version_and_epochs(tmp_path):
    workdir = str(tmp_path / "run")
    t0 = time.time()
    _clean_default_run(workdir)
    first_secs = time.time() - t0

    for name in ("model.keras", "metrics.csv", "results.json", "DONE", "checkpoints"):
        assert os.path.exists(os.path.join(workdir, name)), name
    with open(os.path.join(workdir, "results.json")) as f:
        r1 = json.load(f)
    assert r1["epochs"] == 6 and r1["initial_epoch"] == 0
    windows_per_epoch = 1  # 10 steps per epoch, n_sync 10
    assert r1["version"] == r1["windows"] == 6 * windows_per_epoch
    assert r1["test_accuracy"] > 0.3  # 10 classes: chance is 0.1
    assert 0 <= r1["mean_staleness"] <= 1  # 2 workers
    with open(os.path.join(workdir, "metrics.csv")) as f:
        rows = f.read().splitlines()
    assert rows[0].startswith("epoch") and "samples_per_sec" in rows[0] and "staleness" in rows[0]
    assert len(rows) == 7

    # A second run without --resume refuses to clobber the checkpoints, before it loads TF.
    resumed = [*SHORT, "--config.steps_per_epoch=10", "--config.epochs=7"]
    again = run_launcher(
        [*resumed, f"--workdir={workdir}"], extra_env={"PYTHONPROFILEIMPORTTIME": "1"}
    )
    refusal = again.stderr.splitlines()[-1]
    assert again.returncode == 1 and "already holds checkpoints" in refusal, again.stderr[-3000:]
    assert "--resume" in refusal and "Traceback" not in again.stderr
    assert not re.search(r"^import time: .*\| tensorflow$", again.stderr, re.MULTILINE)

    second = run_launcher([*resumed, "--resume", f"--workdir={workdir}"])
    assert second.returncode == 0, second.stderr[-3000:]
    assert_all_stopped(local_cluster_pids(second.stderr))
    with open(os.path.join(workdir, "results.json")) as f:
        r2 = json.load(f)
    assert r2["initial_epoch"] == 6 and r2["epochs"] == 7
    # The version counter went on from the checkpoint: one more epoch of windows.
    assert r2["version"] == r1["version"] + windows_per_epoch
    with open(os.path.join(workdir, "metrics.csv")) as f:
        rows = f.read().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == [str(e) for e in range(7)]
    print(f"launcher, 6 short epochs: {first_secs:.1f} s, accuracy {r1['test_accuracy']:.3f}")

    # The evaluator role reads the same checkpoints: the newest one gives the
    # chief's final test metrics (central variables restored exactly).
    spec = importlib.util.spec_from_file_location(
        "default_config", os.path.join(ROOT, "configs", "default.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    config.epochs = 7
    config.steps_per_epoch = 10
    evaluated = training.evaluate_checkpoints(config, workdir, timeout_secs=1)
    assert [e["epoch"] for e in evaluated][-1] == 7
    assert evaluated[-1]["accuracy"] == pytest.approx(r2["test_accuracy"], abs=1e-6)
    assert os.path.exists(os.path.join(workdir, "eval_metrics.csv"))


def _cmdline(pid):
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()


def _userns_available():
    from tf_asgd.cluster import network

    try:
        network.check_available()
        return True
    except OSError:
        return False


def _listening_sockets(pid="self"):
    """`{socket inode: port}` of the TCP sockets listening in the network
    namespace of process `pid` (Linux /proc)."""
    found = {}
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{name}") as f:
                rows = [r.split() for r in f.read().splitlines()[1:]]
        except OSError:
            continue
        found.update({r[9]: int(r[1].rsplit(":", 1)[1], 16) for r in rows if r[3] == "0A"})
    return found


def _reachable(port):
    """Whether a TCP connection to 127.0.0.1:port from this process succeeds."""
    with socket.socket() as s:
        s.settimeout(5)
        return s.connect_ex(("127.0.0.1", int(port))) == 0


@pytest.mark.parametrize("isolate", ["auto", "no"])
def test_ctrl_c_stops_every_process_and_ports_stay_in_the_job(tmp_path, isolate):
    """By default a local run lives in a loopback-only network namespace: its
    tasks' ports cannot be reached from outside the job, not even from this
    machine's own loopback. With --isolate_network=no they can (TF listens
    on 0.0.0.0). Either way Ctrl-C stops every process."""
    stop_timeout = 30  # the launcher's own bound on stopping (--stop_timeout)
    proc = start_launcher(
        [
            *SHORT,
            "--config.epochs=1000",
            f"--workdir={tmp_path}",
            f"--isolate_network={isolate}",
            f"--stop_timeout={stop_timeout}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        log = []
        for line in proc.stderr:  # wait until training runs
            log.append(line)
            if "saved checkpoint" in line:
                break
        ports = local_cluster_ports("".join(log))
        cluster_pids = local_cluster_pids("".join(log))
        assert cluster_pids and all(alive(pid) for pid in cluster_pids)
        # One TensorFlow import for the run: the tasks' fork server is a copy of the
        # launcher (its child, on the same command line), not a `task_server --forks`.
        forks = cluster_pids[-1]
        assert parent_pid(forks) == proc.pid and _cmdline(forks) == _cmdline(proc.pid)
        isolated = "Isolated: this run has its own network namespace" in "".join(log)
        assert isolated == (isolate == "auto" and _userns_available()), "".join(log)[-3000:]
        ours = os.readlink("/proc/self/ns/net")
        pids = [proc.pid, *cluster_pids]
        assert [os.readlink(f"/proc/{pid}/ns/net") != ours for pid in pids] == [isolated] * len(
            pids
        )
        if isolated:
            # The job's listening sockets exist in its namespace and not in
            # ours (compared by socket inode: a port *number* the job picked
            # may be in use out here by another cluster, e.g. a fixture).
            job = _listening_sockets(pids[-1])
            assert {int(p) for p in ports} <= set(job.values())
            assert not set(job) & set(_listening_sockets())
        else:  # the same comparison sees a shared namespace
            assert set(_listening_sockets(pids[-1])) & set(_listening_sockets())
            assert all(_reachable(p) for p in ports)
        t0 = time.time()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=stop_timeout + 30)
        secs = time.time() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    print(f"Ctrl-C ({isolate}): the launcher exited {proc.returncode} after {secs:.1f} s")
    # 130 = 128 + SIGINT: stopped cleanly (checkpoint, tasks stopped); 1 would
    # mean the --stop_timeout bound had to end it (stacks in the log).
    assert proc.returncode == 130, before_module_list(err)[-3000:]
    assert "Rerun with --resume" in err and "Traceback" not in err, err[-3000:]
    assert_all_stopped(cluster_pids)


# What a clean run must not print: TF's errors about removing functions from
# tasks already stopped and their gRPC details, retracing warnings, TF's own
# INFO lines, tracebacks.
_NOT_IN_A_CLEAN_RUN = re.compile(
    r"^E0000|Failed to remove function remotely|GRPC error|Error received from peer|"
    r"grpc_status|retracing|^INFO:tensorflow|Traceback|Exception ignored",
    re.MULTILINE,
)


def _clean_default_run(workdir):
    """The README's first command, shortened: 6 epochs of 10 steps (6
    checkpoints: TF's per-save retracing warned from the 5th), with its
    per-epoch validation, and TF's log level left to the launcher. Its output
    is the config, the progress and the results: no error line, no TF INFO
    line, none of TF's start-up lines (the launcher loads TF quietly, after
    its re-exec)."""
    cmd, env = launcher(
        [
            "--config=configs/default.py",
            "--config.epochs=6",
            "--config.steps_per_epoch=10",
            f"--workdir={workdir}",
        ]
    )
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert_all_stopped(local_cluster_pids(proc.stderr))
    bad = sorted({m.group(0) for m in _NOT_IN_A_CLEAN_RUN.finditer(out)})
    assert not bad, f"{bad} in:\n{out[-4000:]}"
    for noise in ("absl::InitializeLog", "cudart_stub", "cpu_feature_guard", "cuInit"):
        assert noise not in out, out[:3000]
    for wanted in ("config:", "n_sync: 10", "optimizer.momentum: 0.9", "done: test accuracy"):
        assert wanted in out, wanted
    printed = [line for line in out.splitlines() if line.strip()]
    assert len(printed) == len(set(printed)), "a line printed twice"
    # One line per epoch: the launcher's, not Keras's as well; no warning on a clean run.
    epoch_lines = [line for line in out.splitlines() if re.search(r"\b[Ee]poch \d+/6\b", line)]
    done = [k for k in range(1, 7) for line in epoch_lines if f"epoch {k}/6 done" in line]
    assert done == [1, 2, 3, 4, 5, 6], epoch_lines
    assert len(epoch_lines) == 6, epoch_lines
    assert not re.search(r"^\s*10/10 ", out, re.MULTILINE), "Keras's progress line as well"
    assert not re.search(r"^W\d{4} .*keras_hook", out, re.MULTILINE), "a warning on a clean run"
    assert len(re.findall(r"saved checkpoint \S+ \(epoch \d\)", out)) == 6


def test_isolate_network_yes_without_unshare_stops_with_a_clear_error(tmp_path):
    path = os.path.join(str(tmp_path), "bin")  # a PATH with python but no `unshare`
    os.makedirs(path)
    os.symlink(sys.executable, os.path.join(path, "python"))
    proc = run_launcher(
        [*SHORT, "--config.epochs=1", f"--workdir={tmp_path}/run", "--isolate_network=yes"],
        extra_env={"PATH": path},
    )
    assert proc.returncode != 0
    assert (
        "--isolate_network=yes, but the `unshare` command (util-linux) is not installed"
        in proc.stderr
    )
    assert "local cluster" not in proc.stderr  # nothing was started


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def test_a_synchronous_run_from_the_config(tmp_path):
    """`config.synchronous` reaches the strategy: rounds of 2 windows, none stale,
    under the synchronous default's gain of N; the log and results give the
    epoch's noise scale."""
    proc = run_launcher(
        [
            *SHORT,
            "--config.epochs=1",
            "--config.synchronous=True",
            "--config.gem.enabled=False",
            "--config.staleness=none",
            f"--workdir={tmp_path}/run",
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "run" / "results.json") as f:
        results = json.load(f)
    # 20 steps of n_sync 10 on 2 workers: one round of 2 windows.
    assert results["windows"] == results["applied"] == 2
    assert results["max_staleness"] == 0 and results["num_workers"] == 2
    assert results["history"]["noise_scale"] == [results["noise_scale"]]
    assert (
        "gradient noise scale" in proc.stderr and "over the last epoch's 1 round(s)" in proc.stderr
    )
    assert results["lr_scale"] == 1.0  # the rounds' gain is on the PS


def test_an_asynchronous_run_without_gem_runs_the_workers_at_sqrt_n_times_the_rate(tmp_path):
    """`config.lr_scaling` "auto" (the default) under the default outer rule: 2 workers at
    sqrt(2) times the optimizer's rate, in the results and the log; "none" turns it off."""
    rates = {}
    for scaling in ("auto", "none"):
        proc = run_launcher(
            [
                *SHORT,
                "--config.epochs=1",
                "--config.gem.enabled=False",
                "--config.staleness=none",
                f"--config.lr_scaling={scaling}",
                f"--workdir={tmp_path}/{scaling}",
            ]
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        with open(tmp_path / scaling / "results.json") as f:
            rates[scaling] = json.load(f)["lr_scale"]
        said = "the workers ran at 1.41 times the optimizer's rate (lr_scaling='auto'"
        assert (said in proc.stderr) == (scaling == "auto")
    assert rates == {"auto": pytest.approx(2**0.5), "none": 1.0}


def test_tf_config_roles_on_loopback(tmp_path):
    """ps and worker tasks serve until SIGTERM; the chief trains against them."""
    p = _free_ports(3)
    cluster = {
        "chief": [f"localhost:{p[0]}"],
        "worker": [f"localhost:{p[1]}"],
        "ps": [f"localhost:{p[2]}"],
    }

    def start(task_type, extra=()):
        cmd, env = launcher([*SHORT, "--config.epochs=1", *extra])
        env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": task_type, "index": 0}})
        return subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )

    servers = [start("ps"), start("worker")]
    try:
        chief = start("chief", [f"--workdir={tmp_path}"])
        _, err = chief.communicate(timeout=240)
        assert chief.returncode == 0, err[-3000:]
        with open(tmp_path / "results.json") as f:
            results = json.load(f)
        assert results["num_workers"] == 1 and results["windows"] == 2
        for s in servers:  # still serving after the chief is done
            assert s.poll() is None
            s.send_signal(signal.SIGTERM)
        for s in servers:
            s.communicate(timeout=30)
            assert s.returncode == 0
    finally:
        for s in servers:
            if s.poll() is None:
                s.kill()
                s.wait()


def test_a_task_whose_port_is_taken_exits_with_one_clear_line():
    """A second worker:0 (two tasks given one index), or any program on the port: the
    launcher exits 1 with one line naming the task, its address and the likely cause."""
    taken = socket.socket()
    taken.bind(("localhost", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    p = _free_ports(2)
    cluster = {
        "chief": [f"localhost:{p[0]}"],
        "worker": [f"localhost:{port}"],
        "ps": [f"localhost:{p[1]}"],
    }
    try:
        cmd, env = launcher([*SHORT])
        env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 0}})
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    finally:
        taken.close()
    assert proc.returncode == 1
    assert (
        f"tf_asgd.launch: Could not start the TF server of worker:0 at localhost:{port}: "
        "is its port in use" in proc.stderr
    )
    assert "Traceback" not in proc.stderr


def test_a_chief_whose_tasks_never_answer_exits_with_one_line(tmp_path):
    """The chief under TF_CONFIG, no worker or PS started: after `connect_timeout` it
    exits 1 with one line naming the tasks, as other launcher failures do."""
    p = _free_ports(3)
    cluster = {
        "chief": [f"localhost:{p[0]}"],
        "worker": [f"localhost:{p[1]}"],
        "ps": [f"localhost:{p[2]}"],
    }
    cmd, env = launcher([*SHORT, "--config.connect_timeout=5", f"--workdir={tmp_path}"])
    env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": "chief", "index": 0}})
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "tf_asgd.launch: Could not reach 2 cluster task(s) within 5 s" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_interrupt_checkpoint_is_not_written_twice_and_says_so(tmp_path, caplog):
    """A Ctrl-C/SIGTERM right after an epoch's checkpoint (no window pushed
    since) writes no second copy, and says which checkpoint holds the run."""
    import logging as py_logging

    import tensorflow as tf

    step = tf.Variable(5, dtype=tf.int64)
    manager = tf.train.CheckpointManager(
        tf.train.Checkpoint(step=step), str(tmp_path), max_to_keep=3
    )
    first = run_parts.save_checkpoint(manager, 5, "epoch 1")
    with caplog.at_level(py_logging.INFO):
        run_parts.checkpoint_on_interrupt(manager, lambda: 5)
    assert manager.checkpoints == [first]
    assert (
        f"interrupted: the newest checkpoint {first} already holds every pushed window"
        in caplog.text
    )
    run_parts.checkpoint_on_interrupt(manager, lambda: 7)  # a window was pushed: a new one
    assert manager.latest_checkpoint.endswith("-7")


def test_bandwidth_limits_the_runs_namespace_or_is_refused(tmp_path):
    # Refusals come before any cluster starts.
    proc = run_launcher([*SHORT, f"--workdir={tmp_path}/a", "--bandwidth=fast"])
    assert proc.returncode != 0 and "--bandwidth: bandwidth must be" in proc.stderr
    proc = run_launcher(
        [*SHORT, f"--workdir={tmp_path}/b", "--bandwidth=1gbit", "--isolate_network=no"]
    )
    assert proc.returncode != 0 and "cannot be combined with --isolate_network=no" in proc.stderr
    if not _userns_available():
        return
    proc = run_launcher(
        [*SHORT, "--config.epochs=1", f"--workdir={tmp_path}/c", "--bandwidth=1gbit"]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Bandwidth: this run's loopback is limited to 1000000000 bits/s" in proc.stderr
    assert os.path.exists(tmp_path / "c" / "results.json")
