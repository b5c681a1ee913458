"""When the Ray runner hands a case to Ray: the dispatch rule counted node by node (no Ray)."""

from ci.cases import Case
from ci.cluster_dispatch import ClusterDispatcher, GpuNode
from ci.ray_backend import unschedulable

NODES = [GpuNode("a", 4), GpuNode("b", 4)]


def names(started):
    return [case.name for case, _ in started]


def test_a_case_starts_only_where_one_node_has_its_gpus_free():
    cases = [Case("two_a", 2, 1.0), Case("three", 3, 1.0), Case("four", 4, 1.0), Case("two_b", 2, 1.0)]
    dispatcher = ClusterDispatcher(cases, NODES)
    # 8 GPUs are free in all, but after 2 + 3 no node has 4 left: "four" waits, "two_b" fits
    started = dispatcher.start_ready()
    assert names(started) == ["two_a", "three", "two_b"]
    assert sorted(node for _, nodes in started for node in nodes) == ["a", "a", "b"]
    dispatcher.release("three")
    assert names(dispatcher.start_ready()) == ["four"]


def test_a_multi_node_case_takes_a_bundle_on_distinct_nodes():
    wide = Case("wide", 4, 1.0, nodes=2)
    dispatcher = ClusterDispatcher([Case("one", 1, 1.0), wide], NODES)
    started = dict(dispatcher.start_ready())
    assert sorted(started[wide]) == ["a", "b"]
    assert dispatcher.free == {"a": 1, "b": 2} or dispatcher.free == {"a": 2, "b": 1}


def test_a_lost_case_is_requeued_first_and_its_dead_node_no_longer_counts():
    cases = [Case(f"c{i}", 4, 1.0) for i in range(3)]
    dispatcher = ClusterDispatcher(cases, NODES)
    (first, (node,)), _ = dispatcher.start_ready()
    dispatcher.drop_node(node)
    dispatcher.requeue(first)
    assert [c.name for c in dispatcher.waiting] == ["c0", "c2"]
    assert dispatcher.start_ready() == []  # the other node is busy with c1
    dispatcher.release("c1")
    assert names(dispatcher.start_ready()) == ["c0"]


def test_cases_no_node_can_take_are_named_with_the_reason():
    assert "largest node has 4" in unschedulable(Case("x", 8, 1.0), NODES)
    assert "needs 3 nodes" in unschedulable(Case("y", 6, 1.0, nodes=3), NODES)
    assert unschedulable(Case("z", 8, 1.0, nodes=2), NODES) is None
    assert unschedulable(Case("p", 4, 1.0, nodes=2, placement="STRICT_PACK"), NODES) is None
