"""How long a KV transfer takes: a link model per data plane, with each instance's NIC a queue.

A transfer of B bytes costs `fixed_s + B / bandwidth_bytes_per_s` on its link. An instance sends
(or receives) one transfer at a time at full bandwidth: a transfer starts when both the sender's
outgoing and the receiver's incoming side are free (FIFO), which is how a saturated NIC shares out.
Data planes (docs/architecture.md, "Data planes"): gRPC over the network is what duet builds; the
others are what a deployment could put behind the same seam, with datasheet bandwidths.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LinkModel:
    plane: str
    bandwidth_bytes_per_s: float
    fixed_s: float  # per transfer: connection set-up, Prepare/Commit not included (the profile's handover_fixed_s)

    def transfer_s(self, num_bytes: int) -> float:
        return self.fixed_s + num_bytes / self.bandwidth_bytes_per_s


# Effective figures, not line rates: gRPC streams reach about 60-70 % of a NIC.
DATA_PLANES: dict[str, LinkModel] = {
    "grpc-loopback": LinkModel("grpc-loopback", 1.5e9, 0.3e-3),  # this kind of CPU box, bench/transfer_bench.py order
    "grpc-25gbe": LinkModel("grpc-25gbe", 2.0e9, 0.5e-3),
    "grpc-100gbe": LinkModel("grpc-100gbe", 8.0e9, 0.3e-3),
    "rdma-400g": LinkModel("rdma-400g", 45e9, 20e-6),
    "nvlink-h100": LinkModel("nvlink-h100", 350e9, 10e-6),
}
DEFAULT_PLANE = "grpc-25gbe"


class LinkError(ValueError):
    pass


def data_plane(name: str) -> LinkModel:
    try:
        return DATA_PLANES[name]
    except KeyError:
        raise LinkError(f"unknown data plane {name!r}; one of {', '.join(DATA_PLANES)}") from None


class Network:
    """The NIC queues of every instance: when a transfer can start, and when it ends."""

    def __init__(self, link: LinkModel) -> None:
        self.link = link
        self._send_free_s: dict[str, float] = {}
        self._recv_free_s: dict[str, float] = {}
        self.bytes_sent: dict[str, int] = {}
        self.bytes_received: dict[str, int] = {}

    def schedule(self, sender: str, receiver: str, num_bytes: int, now_s: float) -> float:
        """Book a transfer; returns when its last byte arrives."""
        start_s = max(now_s, self._send_free_s.get(sender, 0.0), self._recv_free_s.get(receiver, 0.0))
        end_s = start_s + self.link.transfer_s(num_bytes)
        self._send_free_s[sender] = end_s
        self._recv_free_s[receiver] = end_s
        self.bytes_sent[sender] = self.bytes_sent.get(sender, 0) + num_bytes
        self.bytes_received[receiver] = self.bytes_received.get(receiver, 0) + num_bytes
        return end_s
