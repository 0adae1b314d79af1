"""Free ports for a local cluster's tasks, below the kernel's ephemeral range.

Example:
    chief, ps, worker = ports.pick_ports(3)
"""

import random
import socket


def pick_ports(n):
    """Returns `n` distinct free ports, below the kernel's ephemeral range where it can.

    Outgoing connections take their source ports from the ephemeral range. A task's
    port there can be taken while the task is down, by another connection or by a
    client's retries to that port connecting to themselves (TCP simultaneous open),
    and the task then cannot restart on it.
    """
    low = ephemeral_range_start()
    first = max(1024, low // 2)
    if low - first < 64 * n:  # no room below the range: any port the kernel gives
        candidates = [0] * n
    else:
        candidates = random.SystemRandom().sample(range(first, low), min(low - first, 256 * n))
    socks, ports = [], []
    try:
        for candidate in candidates:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("", candidate))  # TF's servers listen on every address
            except OSError:
                s.close()
                continue
            socks.append(s)
            ports.append(s.getsockname()[1])
            if len(ports) == n:
                return ports
    finally:
        for s in socks:
            s.close()
    raise RuntimeError(f"no {n} free ports between {first} and {low}.")


def ephemeral_range_start():
    """The first port of Linux's ephemeral range (32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
