"""Loopback-only networking for local clusters (Linux).

TF's gRPC server listens on every interface and has no authentication, so
`reexec_in_loopback_namespace()` starts the current program again inside a new user and
network namespace whose only interface is `lo` (docs/architecture.md says why). The
launcher does this by default for local runs (`--isolate_network`: `isolate_local_run`). Inside
such a namespace, `limit_bandwidth` puts a token bucket on `lo`: one shared link for the whole
job (`--bandwidth`: `check_bandwidth_request`, `limit_local_bandwidth`).

Example:
    tf_asgd.cluster.network.reexec_in_loopback_namespace()  # returns inside the namespace
    with tf_asgd.LocalCluster(num_workers=2, num_ps=1) as cluster:
        ...
"""

import fcntl
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys

ENV_MARKER = "TF_ASGD_LOOPBACK_NAMESPACE"  # set in the re-executed program

_UNSHARE = ("--user", "--map-root-user", "--net")
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1

# A token bucket's burst must exceed loopback's 64 kB MTU, or connections stall until
# they time out: at least 1 Mbit, else 10 ms of traffic at the rate.
MIN_BURST_BYTES = 125_000
TBF_LATENCY = "50ms"  # how long a packet may wait in the bucket's queue before it is dropped
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_BANDWIDTH = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


def in_loopback_namespace():
    """True inside a namespace entered by `reexec_in_loopback_namespace`."""
    return os.environ.get(ENV_MARKER) == "1"


def check_available():
    """Raises `OSError` naming why a loopback-only namespace cannot be made here."""
    if not sys.platform.startswith("linux"):
        raise OSError(f"loopback-only namespaces need Linux, this is {sys.platform}")
    unshare = shutil.which("unshare")
    if unshare is None:
        raise OSError("the `unshare` command (util-linux) is not installed")
    probe = subprocess.run([unshare, *_UNSHARE, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise OSError(
            "this kernel refuses unprivileged user namespaces "
            f"({probe.stderr.strip() or 'unshare exited ' + str(probe.returncode)}; "
            "see sysctl user.max_user_namespaces, kernel.unprivileged_userns_clone, "
            "kernel.apparmor_restrict_unprivileged_userns, or a container's seccomp profile)"
        )
    return unshare


def reexec_in_loopback_namespace(argv=None):
    """Replaces this process with the same program inside a loopback-only
    network namespace, then brings `lo` up there and returns.

    Called again inside the namespace (the re-executed program runs the same
    code), it only makes sure `lo` is up and returns. Outside, it checks first
    (`check_available`), so a failure raises `OSError` with this process
    untouched; on success it does not return (`os.execv`: same PID, same
    stdin/stdout/stderr, same signals).

    Args:
        argv: the program to run again; default: this Python with
            `sys.orig_argv[1:]` (the same script or `-m` module and arguments).
    """
    if in_loopback_namespace():
        _bring_up_loopback()
        return
    unshare = check_available()
    if argv is None:
        argv = [sys.executable, *sys.orig_argv[1:]]
    os.environ[ENV_MARKER] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(unshare, [unshare, *_UNSHARE, "--", *argv])
    except OSError:
        del os.environ[ENV_MARKER]
        raise


def _bring_up_loopback():
    """`ip link set lo up`, without needing iproute2 (we are root in our namespace)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(s, _SIOCGIFFLAGS, request))[1]
        if not flags & _IFF_UP:
            fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | _IFF_UP))
    names = [name for _, name in socket.if_nameindex()]
    if names != ["lo"]:
        raise OSError(f"expected a namespace with only the loopback interface, found {names}")


def parse_bandwidth(value):
    """A bandwidth in bits per second, from a number or a string like `"100mbit"`.

    Args:
        value: a positive number of bits per second, or a string: a number and
            one of `bit`, `kbit`, `mbit`, `gbit`, `tbit` (decimal, as `tc` reads
            them; any case), e.g. `"100mbit"`, `"1gbit"`, `"2.5Gbit"`.

    Returns:
        The bits per second, a positive Python int.

    Raises:
        ValueError: anything else, naming the value.

    Examples:
        >>> parse_bandwidth("100mbit"), parse_bandwidth("1.5gbit"), parse_bandwidth(8e6)
        (100000000, 1500000000, 8000000)
    """
    rate = None
    if isinstance(value, str):
        match = _BANDWIDTH.fullmatch(value)
        if match and match.group(2).lower() in _UNITS:
            rate = float(match.group(1)) * _UNITS[match.group(2).lower()]
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        rate = float(value)
    if rate is None or not rate >= 1 or rate == float("inf"):
        raise ValueError(
            f"bandwidth must be a number of bits per second >= 1 or a string like '100mbit' "
            f"or '1gbit' (units: {', '.join(_UNITS)}), got {value!r}."
        )
    return int(round(rate))


def tbf_burst_bytes(rate):
    """The token bucket's burst for `rate` bits/s: `max(1 Mbit, 10 ms of traffic)`, in bytes."""
    return max(MIN_BURST_BYTES, int(rate) // 800)


def limit_bandwidth(rate):
    """Limits the loopback of this job's own namespace to `rate`, for every task in it.

    Runs `tc qdisc replace dev lo root tbf rate <rate> burst <burst> latency 50ms`
    (`tbf_burst_bytes`). Only inside a namespace made by
    `reexec_in_loopback_namespace` (this process, or its parent, called it), so
    nothing outside the job's namespace changes. Called again, it replaces the
    limit.

    Args:
        rate: bits per second, or a string (`parse_bandwidth`).

    Returns:
        The rate in bits per second.

    Raises:
        ValueError: a bad rate.
        RuntimeError: this process is not in such a namespace.
        OSError: `tc` is missing, or the kernel refused the qdisc.

    Example:
        network.reexec_in_loopback_namespace()
        network.limit_bandwidth("100mbit")  # every connection on `lo` shares 100 Mbit/s
    """
    rate = parse_bandwidth(rate)
    _check_own_namespace("limit its bandwidth")
    burst = tbf_burst_bytes(rate)
    _tc(
        "qdisc",
        "replace",
        "dev",
        "lo",
        "root",
        "tbf",
        "rate",
        f"{rate}bit",
        "burst",
        str(burst),
        "latency",
        TBF_LATENCY,
    )
    return rate


def clear_bandwidth_limit():
    """Removes `limit_bandwidth`'s limit from this namespace's loopback (none: no-op).

    Raises:
        RuntimeError: this process is not in a namespace of `reexec_in_loopback_namespace`.
        OSError: `tc` is missing or fails.
    """
    _check_own_namespace("clear its bandwidth limit")
    if bandwidth_limit() is not None:
        _tc("qdisc", "del", "dev", "lo", "root")


def bandwidth_limit():
    """The token bucket on this namespace's loopback, or `None` without one.

    Returns:
        `(rate, burst_bytes)` of the root `tbf` qdisc on `lo`, or `None` without one.

    Raises:
        OSError: `tc` is missing or fails.
    """
    for qdisc in json.loads(_tc("-j", "qdisc", "show", "dev", "lo") or "[]"):
        if qdisc.get("kind") == "tbf" and qdisc.get("root"):
            options = qdisc["options"]
            return 8 * int(options["rate"]), int(options["burst"])
    return None


def _check_own_namespace(what):
    names = [name for _, name in socket.if_nameindex()]
    if not in_loopback_namespace() or names != ["lo"]:
        raise RuntimeError(
            f"Cannot {what}: this process is not in a loopback-only network namespace of its "
            f"own (interfaces {names}), and tf_asgd changes no network outside one. Call "
            "tf_asgd.cluster.network.reexec_in_loopback_namespace() first (it runs the "
            "program again inside one), or use the launcher's --bandwidth."
        )


def _tc(*args):
    tc = shutil.which("tc") or next(
        (p for p in ("/usr/sbin/tc", "/sbin/tc") if os.access(p, os.X_OK)), None
    )
    if tc is None:
        raise OSError("the `tc` command (iproute2) is not installed")
    proc = subprocess.run([tc, *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise OSError(
            f"`tc {' '.join(args)}` failed: {proc.stderr.strip() or 'exit ' + str(proc.returncode)}"
            " (the kernel may lack the tbf qdisc: sch_tbf)"
        )
    return proc.stdout


def isolate_local_run(mode, argv, must_download=None):
    """Moves a local run into a loopback-only network namespace, or logs why not.

    Returns only inside the namespace, or when the run stays outside it
    (`reexec_in_loopback_namespace`).

    Args:
        mode: the launcher's `--isolate_network`: "yes" (or raise), "auto" (or a
            warning), "no" (stay outside).
        argv: the program to run again inside the namespace.
        must_download: the data set the run must download first, or `None`; with
            "auto", the run then stays outside (a loopback-only namespace has no network).

    Raises:
        OSError: `mode` "yes", and no such namespace can be made here (it says why).
    """
    from absl import logging  # here: the module itself needs only the standard library

    if mode == "no":
        return
    if mode == "auto" and not in_loopback_namespace() and must_download:
        logging.warning(
            "Not isolating the local cluster to loopback: %s must be downloaded first "
            "(a loopback-only namespace has no network). Its ports listen on every "
            "interface; once the data is here, runs are isolated.",
            must_download,
        )
        return
    try:
        # Outside: does not return. Inside, TF starts quietly (see quiet_tf_startup).
        reexec_in_loopback_namespace(argv)
    except OSError as e:
        if mode == "yes":
            raise
        logging.warning(
            "The local cluster's ports listen on every interface (TF 2.21 binds 0.0.0.0; "
            "its gRPC has no authentication) because %s. Firewall this machine, or "
            "pass --isolate_network=no to accept this.",
            e,
        )
        return
    logging.info(
        "Isolated: this run has its own network namespace with only loopback; "
        "no one outside can reach the cluster's ports."
    )


def check_bandwidth_request(value, isolate, local=True, must_download=None):
    """The launcher's `--bandwidth`, checked before the run moves to its namespace.

    Args:
        value: the rate (`parse_bandwidth`), or `None`.
        isolate: the launcher's `--isolate_network` ("auto", "yes" or "no").
        local: whether the run is local (no `TF_CONFIG`).
        must_download: the data set the run must download first, or `None`.

    Returns:
        The rate in bits/s, or `None` without `value`.

    Raises:
        ValueError: a bad rate, a run that is not local, or `isolate` "no" (the
            message names the conflict: a usage error).
        OSError: no namespace of its own can be made here, or `must_download`
            must be downloaded first (the message says why).
    """
    if value is None:
        return None
    try:
        rate = parse_bandwidth(value)
    except ValueError as e:
        raise ValueError(f"--bandwidth: {e}") from None
    if not local:
        raise ValueError(
            "--bandwidth limits a local run's own network namespace; under TF_CONFIG the "
            "tasks run on their machines' network (limit it there)."
        )
    if isolate == "no":
        raise ValueError(
            "--bandwidth needs the run in its own network namespace: it cannot be combined "
            "with --isolate_network=no."
        )
    if not in_loopback_namespace():
        try:
            check_available()
        except OSError as e:
            raise OSError(f"--bandwidth needs a network namespace of its own, but {e}.") from None
        if must_download:
            raise OSError(
                f"--bandwidth runs in a network namespace without a network, "
                f"but {must_download} must be downloaded first: run once without --bandwidth."
            )
    return rate


def limit_local_bandwidth(rate):
    """Limits this run's namespace loopback to `rate` bits/s (`limit_bandwidth`), and logs it.

    Raises:
        OSError: `limit_bandwidth` or `bandwidth_limit` failed (the message names
            the rate and why).
    """
    from absl import logging

    try:
        limit_bandwidth(rate)
        limit, burst = bandwidth_limit()
    except (OSError, RuntimeError) as e:
        raise OSError(f"--bandwidth={rate}bit, but {e}.") from None
    logging.info(
        "Bandwidth: this run's loopback is limited to %d bits/s (tbf, burst %d bytes), "
        "one link for the chief and every task.",
        limit,
        burst,
    )
