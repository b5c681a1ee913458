"""Ray's own `ray start`, with the Ray client server left off.

`ray start --head` starts Ray's client server (a gRPC port that runs whatever a `ray://` client
sends, on the node's routable address, port 10001 unless told another) whenever Ray's client
dependencies are importable, and `--ray-client-server-port` has no value that means "none". Nothing
here uses the client server: jobs go through the job server, drivers through the GCS. So this runs
`ray start` with the one question "are the client dependencies installed?" answered no, which is
Ray's own path for an install without them: no client server, no port.

Run by path with the launcher's interpreter (`python3 <this file> start ...`): it imports nothing
but Ray, and the node runs the same Ray as the launcher that planned it.
"""

from __future__ import annotations

import sys

# what Ray's CLI consults to decide on a client server (ray.scripts.scripts, Ray 2.52-2.60)
_CLIENT_CHECK = "get_ray_client_dependency_error"


def _client_server_off() -> ImportError:
    return ImportError("the launcher keeps the Ray client server off")


def main(argv: list[str]) -> int:
    from ray.scripts import scripts

    if not hasattr(scripts, _CLIENT_CHECK):  # a Ray that decides elsewhere: refuse rather than open the port
        print(f"error: this Ray ({scripts.ray.__version__}) has no ray.scripts.scripts.{_CLIENT_CHECK}; the launcher "
              f"cannot keep the Ray client server off; fix: install the Ray version constraints.txt names",
              file=sys.stderr, flush=True)
        return 2
    setattr(scripts, _CLIENT_CHECK, _client_server_off)
    sys.argv = ["ray", *argv]
    scripts.main()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
