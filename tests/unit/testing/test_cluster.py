"""The loopback multi-node cluster the multi-node recipe's CPU case runs against."""

import pytest

from miles.testing.cluster import LocalRayCluster, free_ports
from miles.testing.runner import token_pids


def test_free_ports_are_distinct():
    ports = free_ports(8)
    assert len(set(ports)) == 8


def test_two_node_cluster_starts_reports_both_nodes_and_leaves_nothing_behind(tmp_path):
    cluster = LocalRayCluster(nodes=2, cpus_per_node=1)
    try:
        cluster.start()
        assert cluster.alive_nodes() == 2
        assert cluster.env_for_recipe()["RAY_ADDRESS"] == cluster.address
        assert token_pids(cluster.token)  # the daemons carry the token
    finally:
        ended, survivors = cluster.stop()
    assert survivors == [] and token_pids(cluster.token) == []
    assert ended
