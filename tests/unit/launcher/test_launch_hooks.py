from miles.launcher.launch_run import ClusterInfo, _call_hook

CLUSTER = ClusterInfo(job_server_url="http://127.0.0.1:8265", gcs_address="127.0.0.1:6379", run_dir="/out/r1")


def test_hook_taking_a_parameter_receives_the_cluster_info():
    seen = []
    _call_hook(seen.append, CLUSTER)
    assert seen == [CLUSTER]


def test_hook_without_parameters_is_called_without_arguments():
    calls = []
    _call_hook(lambda: calls.append("called"), CLUSTER)
    assert calls == ["called"]
