"""Loopback-only namespaces (tf_asgd.cluster.network), in a real child process."""

import pytest

from tf_asgd.cluster import network


def test_check_available_names_what_is_missing(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(OSError, match=r"the `unshare` command \(util-linux\) is not installed"):
        network.check_available()


def test_bandwidths_parse_as_tc_reads_them():
    assert network.parse_bandwidth("100mbit") == 100_000_000
    assert network.parse_bandwidth("1gbit") == network.parse_bandwidth("1GBit") == 10**9
    assert network.parse_bandwidth(" 2.5gbit ") == 2_500_000_000
    assert network.parse_bandwidth("640kbit") == 640_000
    assert network.parse_bandwidth("8000bit") == network.parse_bandwidth(8000) == 8000
    assert network.parse_bandwidth(1.5e6) == 1_500_000
    for bad in ("fast", "100mbps", "100MB", "-1gbit", "0mbit", "", 0, -5, True, None, 1e400):
        with pytest.raises(ValueError, match=r"bandwidth must be a number of bits per second"):
            network.parse_bandwidth(bad)


def test_bursts_exceed_loopbacks_mtu():
    # 1 Mbit at least (a burst under loopback's 64 kB MTU stalls connections), else 10 ms.
    assert network.tbf_burst_bytes(10**6) == network.tbf_burst_bytes(10**8) == 125_000
    assert network.tbf_burst_bytes(2 * 10**8) == 250_000
    assert network.tbf_burst_bytes(10**9) == 1_250_000


def test_no_limit_is_set_outside_a_namespace_of_its_own():
    assert not network.in_loopback_namespace()
    with pytest.raises(RuntimeError, match=r"Cannot limit its bandwidth: this process is not in"):
        network.limit_bandwidth("100mbit")
    with pytest.raises(RuntimeError, match=r"Cannot clear its bandwidth limit"):
        network.clear_bandwidth_limit()


def test_a_missing_tc_is_named(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(network.os, "access", lambda path, mode: False)
    with pytest.raises(OSError, match=r"the `tc` command \(iproute2\) is not installed"):
        network.bandwidth_limit()
