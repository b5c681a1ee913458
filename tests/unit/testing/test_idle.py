"""Session services (a worker's Ray cluster) end once no test has used them for IDLE_S and start
again for the next test that wants them."""

from types import SimpleNamespace

from miles.testing.idle import IDLE_S, IdleEnded, end_idle_services


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def service(clock, wanted=frozenset()):
    log = []
    made = iter(range(100))
    svc = IdleEnded(start=lambda: log.append("start") or f"cluster{next(made)}",
                    stop=lambda value: log.append(f"stop {value}"),
                    wanted_by=lambda item: item.name in wanted, clock=clock)
    return svc, log


def item(name):
    return SimpleNamespace(name=name, fixturenames=[])


def test_a_service_idle_for_idle_s_is_ended_before_a_test_that_does_not_want_it_and_started_again_after():
    clock = Clock()
    svc, log = service(clock)
    with svc.using() as value:
        assert value == "cluster0"
    clock.now += IDLE_S - 1
    end_idle_services(item("unrelated"))
    assert svc.running and log == ["start"]
    clock.now += 1
    end_idle_services(item("unrelated"))
    assert not svc.running and log == ["start", "stop cluster0"]
    with svc.using() as value:
        assert value == "cluster1"
    assert svc.starts == 2 and log[-1] == "start"


def test_a_held_service_or_one_the_next_test_wants_is_never_ended():
    clock = Clock()
    svc, log = service(clock, wanted={"ray test"})
    with svc.using():
        clock.now += 10 * IDLE_S
        assert not svc.end_if_idle(item("unrelated"))  # a test still holds it
    clock.now += 10 * IDLE_S
    assert not svc.end_if_idle(item("ray test"))
    assert svc.running
    assert svc.end_if_idle(item("unrelated"))
    assert log == ["start", "stop cluster0"]


def test_idle_is_counted_from_the_last_release_and_close_ends_a_running_service_once():
    clock = Clock()
    svc, log = service(clock)
    with svc.using():
        pass
    clock.now += IDLE_S / 2
    with svc.using():  # used again: the wait starts over
        pass
    clock.now += IDLE_S / 2
    assert not svc.end_if_idle(item("unrelated"))
    svc.close()
    svc.close()
    assert log == ["start", "stop cluster0"]


def test_the_workers_ray_is_wanted_and_held_by_a_test_that_asks_for_it(request, local_ray, worker_ray):
    assert worker_ray.wanted_by(request.node)
    assert worker_ray.running and local_ray.is_initialized()
    assert not worker_ray.end_if_idle(None)
