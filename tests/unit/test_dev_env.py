"""The free ports the tests and the bench hand to the servers they start."""

import random
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import dev_env
from dev_env import free_port


def test_ports_taken_at_once_from_threads_are_distinct_free_and_below_the_ephemeral_range():
    random.seed(0)  # as a library may: the ports must not follow the global generator
    with ThreadPoolExecutor(8) as pool:
        ports = list(pool.map(lambda _: free_port(), range(200)))
    assert len(set(ports)) == 200
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert all(20000 <= port < low for port in ports)
    for port in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # none was left bound


def test_a_port_given_once_is_not_given_again_though_it_is_free_again(monkeypatch):
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    # eight ports to give, for this test alone
    for name, value in (("_PORTS_FROM", low - 8), ("_SHARE", 0), ("_SHARES", 1), ("_GIVEN", set())):
        monkeypatch.setattr(dev_env, name, value)
    ports = []
    with pytest.raises(OSError, match="not given before"):
        for _ in range(9):
            ports.append(free_port())
    assert 0 < len(ports) == len(set(ports)) <= 8
