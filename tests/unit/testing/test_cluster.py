"""The loopback multi-node cluster the multi-node recipe's CPU case runs against."""

import os
import stat
import urllib.error
import urllib.request

import pytest

from miles.testing.cluster import LocalRayCluster, free_ports
from miles.testing.runner import token_pids
from miles.launcher.processes import pids_in_session


def test_free_ports_are_distinct():
    ports = free_ports(8)
    assert len(set(ports)) == 8


@pytest.mark.slow  # the multinode rehearsal starts and ends this cluster in the README's command (runner checks for leftovers)
def test_two_node_cluster_starts_reports_both_nodes_and_leaves_nothing_behind(tmp_path):
    """Nothing behind includes what Ray starts without our token (the dashboard's module processes,
    each raylet's dashboard agent): an agent left alive once its raylet was gone spun for minutes
    (47 CPU-s of one suite run). Like the launcher's, the cluster requires a token of its own."""
    cluster = LocalRayCluster(nodes=2, cpus_per_node=1)
    try:
        cluster.start()
        assert cluster.alive_nodes() == 2
        assert cluster.env_for_recipe()["RAY_ADDRESS"] == cluster.address
        token_file = cluster.env_for_recipe()["RAY_AUTH_TOKEN_PATH"]
        assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600 and token_file.startswith(str(cluster.temp_dir))
        with pytest.raises(urllib.error.HTTPError, match="401"):  # the state API, asked without the token
            urllib.request.urlopen(f"{cluster.address}/api/v0/nodes", timeout=15)
        assert token_pids(cluster.token)  # the daemons carry the token
        # daemons without the token (the dashboard's module processes, the agent): found by session
        assert len(cluster.sessions) == 2
        assert set(pids_in_session(*cluster.sessions)) - set(token_pids(cluster.token))
    finally:
        ended, survivors = cluster.stop()
    assert survivors == [] and token_pids(cluster.token) == []
    assert pids_in_session(*cluster.sessions) == []
    assert ended
