"""Free TCP ports on this host: one search, used by the launcher, the test clusters and the
benchmarks' process groups."""

from __future__ import annotations

import random
import socket

# Below Linux's ephemeral range (32768-60999): the kernel gives those to outgoing connections, and
# one can take a port between our pick and the daemon's bind (seen: a raylet's object-manager port
# taken, the raylet dead and `ray start` waiting without end).
PORT_SPAN = (12000, 30000)
# drawn from the OS, not the `random` module: a process that seeded it (a trainer, a test) would
# otherwise draw the same ports as every other process seeded alike
_DRAW = random.SystemRandom()


def free_ports(count: int, host: str = "127.0.0.1", avoid: set[int] = frozenset(), span: tuple[int, int] = PORT_SPAN,
               tries: int = 200) -> list[int]:
    """`count` distinct ports inside `span`, each free now, drawn at random (so that two processes
    picking at once rarely meet)."""
    picked: list[int] = []
    for _ in range(tries):
        port = _DRAW.randrange(span[0], span[1])
        if port not in picked and port not in avoid and _port_is_free(port, host):
            picked.append(port)
            if len(picked) == count:
                return picked
    raise RuntimeError(f"no {count} free ports found in {span}")


def free_port_range(count: int, span: tuple[int, int] = PORT_SPAN, host: str = "127.0.0.1",
                    avoid: set[int] = frozenset(), tries: int = 50) -> int:
    """The lowest of `count` consecutive ports inside `span` that are all free now."""
    for _ in range(tries):
        low = _DRAW.randrange(span[0], span[1] - count)
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
