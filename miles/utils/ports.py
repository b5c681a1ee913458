"""Free TCP ports on this host: one search, used by the launcher, the test clusters and the trainer's
process groups."""

from __future__ import annotations

import random
import socket



def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Ports the kernel reports free now. All sockets stay open until every port is picked, so
    the kernel cannot hand out the same one twice."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind((host, 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def free_ports_in(count: int, span: tuple[int, int], host: str = "127.0.0.1", avoid: set[int] = frozenset(),
                  tries: int = 200) -> list[int]:
    """`count` distinct ports inside `span`, each free now, drawn at random (so that two processes
    picking at once rarely meet)."""
    picked: list[int] = []
    for _ in range(tries):
        port = random.randrange(span[0], span[1])
        if port not in picked and port not in avoid and _port_is_free(port, host):
            picked.append(port)
            if len(picked) == count:
                return picked
    raise RuntimeError(f"no {count} free ports found in {span}")


def free_port_range(count: int, span: tuple[int, int], host: str = "127.0.0.1", avoid: set[int] = frozenset(),
                    tries: int = 50) -> int:
    """The lowest of `count` consecutive ports inside `span` that are all free now."""
    for _ in range(tries):
        low = random.randrange(span[0], span[1] - count)
        ports = range(low, low + count)
        if not avoid.intersection(ports) and all(_port_is_free(p, host) for p in ports):
            return low
    raise RuntimeError(f"no {count} consecutive free ports found in {span}")


def _port_is_free(port: int, host: str) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
            return True
        except OSError:
            return False
