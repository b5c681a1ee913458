import socket

from miles.utils.ports import PORT_SPAN, free_port_range, free_ports


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    ports = free_ports(12, avoid={PORT_SPAN[0]})
    assert len(set(ports)) == 12 and PORT_SPAN[0] not in ports
    assert all(PORT_SPAN[0] <= p < PORT_SPAN[1] < 32768 for p in ports)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_held_by_another_socket_is_never_picked():
    with socket.socket() as held:
        held.bind(("127.0.0.1", free_ports(1)[0]))
        port = held.getsockname()[1]
        assert free_ports(1, span=(port, port + 2)) == [port + 1]
        assert free_port_range(1, span=(port - 1, port + 1)) == port - 1


def test_draws_after_the_same_random_seed_still_differ():
    # two processes that seeded the random module alike (a trainer, a test) must not draw alike
    import random

    state = random.getstate()
    try:
        random.seed(0)
        first = free_ports(8)
        random.seed(0)
        assert free_ports(8) != first
    finally:
        random.setstate(state)
