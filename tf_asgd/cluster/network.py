"""Loopback-only networking for local clusters (Linux).

TF's gRPC server listens on every interface and has no authentication, so
`reexec_in_loopback_namespace()` starts the current program again inside a new user and
network namespace whose only interface is `lo` (docs/architecture.md says why). The
launcher does this by default for local runs (`--isolate_network`).

Example:
    tf_asgd.cluster.network.reexec_in_loopback_namespace()  # returns inside the namespace
    with tf_asgd.LocalCluster(num_workers=2, num_ps=1) as cluster:
        ...
"""

import fcntl
import os
import shutil
import socket
import struct
import subprocess
import sys

ENV_MARKER = "TF_ASGD_LOOPBACK_NAMESPACE"  # set in the re-executed program

_UNSHARE = ("--user", "--map-root-user", "--net")
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


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
