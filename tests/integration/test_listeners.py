"""The embedded single-host cluster listens on loopback only: every listener duet owns (the gRPC
front end, the OpenAI HTTP API, the metrics port, each instance's KV receiver) is bound to
127.0.0.1, read from the kernel's socket table of the cluster's processes (this one, where the
front end and the router run, and Ray's actor processes, where the instances run)."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from pathlib import Path

import pytest
from cluster_harness import ClusterHarness

from cluster.deploy.config import ClusterConfig

pytestmark = pytest.mark.timeout(300)

_LISTEN = "0A"  # TCP state of a listening socket in /proc/net/tcp*


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _address(hex_address: str, family: int) -> str:
    raw = bytes.fromhex(hex_address)
    if family == socket.AF_INET:
        return socket.inet_ntop(family, struct.pack("<I", struct.unpack(">I", raw)[0]))
    # IPv6: four 32-bit words, each in host (little-endian) order. gRPC binds 127.0.0.1 through a
    # dual-stack socket, which the table shows as the IPv4-mapped ::ffff:127.0.0.1: the same address.
    address = ipaddress.IPv6Address(struct.pack("<4I", *struct.unpack(">4I", raw)))
    return str(address.ipv4_mapped or address)


def _listening_sockets() -> dict[int, tuple[str, int]]:
    """Socket inode -> (address, port) of every listening TCP socket in this network namespace."""
    found = {}
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        path = Path("/proc/net") / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != _LISTEN:
                continue
            hex_address, hex_port = fields[1].split(":")
            found[int(fields[9])] = (_address(hex_address, family), int(hex_port, 16))
    return found


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[len("socket:[") : -1]))
    except OSError:
        pass
    return inodes


def _cluster_pids() -> set[int]:
    """This process and Ray's worker processes (their command lines start with "ray::")."""
    pids = {os.getpid()}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "cmdline").read_bytes().startswith(b"ray::"):
                pids.add(int(entry.name))
        except OSError:
            continue
    return pids


def test_every_listener_duet_owns_is_on_loopback(ray_cluster) -> None:
    config = ClusterConfig.from_dict(
        {
            "dtype": "float32",
            "device": "cpu",
            "instances": [
                {"role": "PREFILL", "count": 1, "num_cpus": 0.5},
                {"role": "GENERATION", "count": 1, "num_cpus": 0.5},
            ],
            "engine": {"num_blocks": 64, "tokens_per_block": 16, "chunk_unit_tokens": 16, "max_num_tokens": 64},
            "frontend": {"port": 0, "metrics_port": 0, "http_port": _free_port()},
        }
    )
    with ClusterHarness(config) as harness:
        # One request through the KV path, so that every listener has been used once.
        with harness.client(timeout_s=60) as client:
            assert client.complete("hello", max_tokens=2, temperature=0.0, ignore_eos=True).usage.completion_tokens == 2
        cluster = harness.cluster
        assert cluster is not None and cluster.http is not None and cluster.metrics_port is not None
        transfer = harness.call(lambda: [m.info.transfer_address for m in harness.router.fleet.members.values()])
        owned = {
            "frontend.port": int(harness.target.rsplit(":", 1)[1]),
            "frontend.http_port": cluster.http.port,
            "frontend.metrics_port": cluster.metrics_port,
        }
        for index, address in enumerate(address for address in transfer if address):
            host, port = address.rsplit(":", 1)
            assert host == "127.0.0.1", f"a KV receiver advertises {address}"
            owned[f"KV receiver {index}"] = int(port)
        assert sum(1 for name in owned if name.startswith("KV receiver")) >= 1
        listening = _listening_sockets()
        ours = {inode for pid in _cluster_pids() for inode in _socket_inodes(pid)} & set(listening)
        for name, port in owned.items():
            bound = sorted({listening[inode][0] for inode in ours if listening[inode][1] == port})
            assert bound, f"{name} (port {port}) is not listening in any of the cluster's processes"
            assert bound == ["127.0.0.1"], f"{name} (port {port}) listens on {bound}"
