"""A Ray address checked before `ray.init`, which retries an unreachable GCS for minutes.

`host:port` must parse and accept a TCP connection within CONNECT_TIMEOUT seconds; `auto` (the
cluster this machine belongs to) is left to Ray.
"""

from __future__ import annotations

import socket

CONNECT_TIMEOUT = 10.0


class RayAddressError(ValueError):
    pass


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536 or " " in host:
        raise RayAddressError(f"--ray-address {address!r} is not host:port; fix: give the head's GCS address, "
                              f"e.g. HEAD:6379, or auto")
    return host, int(port)


def check_reachable(address: str, timeout: float = CONNECT_TIMEOUT) -> None:
    if address == "auto":
        return
    host, port = split_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return
    except OSError as err:
        raise RayAddressError(f"--ray-address {address}: nothing answers there within {timeout:.0f} s ({err}); "
                              f"fix: start the cluster (ray start --head --port {port}) or give its head's "
                              f"address") from None
