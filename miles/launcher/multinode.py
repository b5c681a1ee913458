"""Addresses of a cluster that spans hosts: a head on loopback cannot be joined from another
host, so a multi-node launch (and a worker) refuses one before anything starts.

Every node of a cluster on one host (the test harness's two loopback nodes) is the one case
where loopback is right; it says so with MILES_SINGLE_HOST_CLUSTER=1.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping

SINGLE_HOST_ENV = "MILES_SINGLE_HOST_CLUSTER"
# Any address outside this host's networks: connecting a UDP socket sends nothing, it only asks
# the kernel which local address its route would leave from.
_ROUTE_PROBE = ("10.254.254.254", 1)


class LoopbackHeadError(ValueError):
    """A cluster of several hosts given a head address only this host can reach."""


def is_loopback(host: str) -> bool:
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def single_host_cluster(environ: Mapping[str, str] | None = None) -> bool:
    environ = os.environ if environ is None else environ
    return environ.get(SINGLE_HOST_ENV, "") == "1"


def routable_address() -> str | None:
    """This host's address on its default route, or None (no route, or only loopback)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(_ROUTE_PROBE)
            address = probe.getsockname()[0]
    except OSError:
        return None
    return None if is_loopback(address) or address == "0.0.0.0" else address


def _fix_hint() -> str:
    found = routable_address()
    example = found or "<this host's address on the network the other nodes share>"
    where = f" (this host's routable address: {found})" if found else ""
    return f"export MASTER_ADDR={example}{where}, or set {SINGLE_HOST_ENV}=1 if every node runs on this host"


def check_head_address(num_nodes: int, head_host: str, environ: Mapping[str, str] | None = None) -> None:
    """A head of our own for `num_nodes` > 1 hosts must listen on an address the others reach."""
    if num_nodes <= 1 or not is_loopback(head_host) or single_host_cluster(environ):
        return
    raise LoopbackHeadError(
        f"--num-nodes {num_nodes} with MASTER_ADDR={head_host}: the Ray head and torch.distributed would bind "
        f"loopback, which no other node can reach; fix: {_fix_hint()}"
    )


def check_worker_head(head_address: str, environ: Mapping[str, str] | None = None) -> None:
    """A worker joins another host's head; a loopback head means it would only ever find itself."""
    host, _, _ = head_address.rpartition(":")
    if not is_loopback(host) or single_host_cluster(environ):
        return
    raise LoopbackHeadError(
        f"--head-address {head_address} is loopback: a worker on another host cannot reach it; fix: give the "
        f"head's routable address (the MASTER_ADDR the train role was started with), or set {SINGLE_HOST_ENV}=1 "
        f"if the head runs on this host"
    )
