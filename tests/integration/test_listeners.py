"""The embedded single-host cluster listens on loopback only: every listener duet owns (the gRPC
front end, the OpenAI HTTP API, the metrics port, each instance's KV receiver), and every one of
Ray's that duet starts (GCS, raylet, workers, agents), is bound to 127.0.0.1, read from the kernel's socket table of the cluster's processes (the probe process,
where the front end and the router run, and Ray's actor processes, where the instances run). The
probe starts its own Ray in a process of its own, as `duet serve` does."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import struct
import subprocess
import sys
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
    """This process and Ray's worker processes (their command lines start with "ray::"; those of
    other users cannot be read and are skipped, and no other process holds the ports checked)."""
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


def _descendants(root: int) -> dict[int, str]:
    """Pid -> command name of `root` and every process under it (the Ray it started: GCS, raylet,
    agents, workers), whoever else runs Ray on this machine."""
    parents, names = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        names[int(entry.name)] = command.rsplit("/", 1)[-1] or stat.split("(", 1)[1].split(")", 1)[0]
    found = {root}
    grew = True
    while grew:
        children = {pid for pid, parent in parents.items() if parent in found} - found
        found |= children
        grew = bool(children)
    return {pid: names.get(pid, "?") for pid in found}


def _probe() -> dict[str, object]:
    """Start the cluster, send one request, and report each duet-owned listener: its port, the
    address it advertises (KV receivers) and the addresses its sockets are bound to."""
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
            "ray": {"num_cpus": 2},
        }
    )
    with ClusterHarness(config) as harness:
        # One request through the KV path, so that every listener has been used once.
        with harness.client(timeout_s=60) as client:
            tokens = client.complete("hello", max_tokens=2, temperature=0.0, ignore_eos=True).usage.completion_tokens
        cluster = harness.cluster
        assert cluster is not None and cluster.http is not None and cluster.metrics_port is not None
        transfer = harness.call(lambda: [m.info.transfer_address for m in harness.router.fleet.members.values()])
        owned: dict[str, dict[str, object]] = {
            "frontend.port": {"port": int(harness.target.rsplit(":", 1)[1])},
            "frontend.http_port": {"port": cluster.http.port},
            "frontend.metrics_port": {"port": cluster.metrics_port},
        }
        for index, address in enumerate(address for address in transfer if address):
            host, port = address.rsplit(":", 1)
            owned[f"KV receiver {index}"] = {"port": int(port), "advertised": host}
        listening = _listening_sockets()
        ours = {inode for pid in _cluster_pids() for inode in _socket_inodes(pid)} & set(listening)
        for entry in owned.values():
            entry["bound"] = sorted({listening[inode][0] for inode in ours if listening[inode][1] == entry["port"]})
        # Everything else the cluster's own processes listen on: Ray's.
        owned_ports = {entry["port"] for entry in owned.values()}
        ray_listeners = sorted(
            {
                (name, *listening[inode])
                for pid, name in _descendants(os.getpid()).items()
                for inode in _socket_inodes(pid) & set(listening)
                if listening[inode][1] not in owned_ports
            }
        )
    return {"tokens": tokens, "owned": owned, "ray": ray_listeners}


def test_every_listener_duet_owns_is_on_loopback() -> None:
    # In a process of its own, started as `duet serve` is: without the switch tests/conftest.py sets
    # (read when Ray is imported, so this process cannot drop it), Ray gives its processes the
    # machine's routable address, which is what the bind host must not follow.
    env = {key: value for key, value in os.environ.items() if key != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, __file__], env=env, cwd=root, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["tokens"] == 2
    owned = report["owned"]
    assert sum(1 for name in owned if name.startswith("KV receiver")) >= 1
    for name, entry in owned.items():
        assert entry.get("advertised", "127.0.0.1") == "127.0.0.1", f"{name} advertises {entry['advertised']}"
        assert entry["bound"], f"{name} (port {entry['port']}) is not listening in any of the cluster's processes"
        assert entry["bound"] == ["127.0.0.1"], f"{name} (port {entry['port']}) listens on {entry['bound']}"
    # Ray is told to keep its own listeners on loopback too (cluster/deploy/launch.py keep_ray_on_loopback).
    assert report["ray"], "found none of Ray's listeners"
    off_loopback = [listener for listener in report["ray"] if listener[1] != "127.0.0.1"]
    assert not off_loopback, f"Ray listens off loopback: {off_loopback}"


if __name__ == "__main__":
    print(json.dumps(_probe()))
