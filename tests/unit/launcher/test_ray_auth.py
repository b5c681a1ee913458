"""Who may talk to a cluster: its own token, found only where each cluster names it."""

import os
import stat

import pytest

from miles.launcher import ray_auth
from miles.launcher.ray_auth import (
    ClusterAuth,
    RayAuthError,
    external_auth,
    headers_for,
    joining_auth,
    own_cluster_auth,
    requested_mode,
    users_auth,
    write_fresh_token,
)


@pytest.fixture
def stale_home(tmp_path):
    """A HOME whose ~/.ray/auth_token some earlier command left behind."""
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("stale-token-from-an-earlier-ray-init")
    return home


@pytest.mark.parametrize("value, mode", [(None, "token"), ("", "token"), ("token", "token"), ("TOKEN", "token"),
                                         ("disabled", "disabled")])
def test_every_cluster_requires_a_token_unless_the_user_opts_out_by_name(value, mode):
    assert requested_mode({} if value is None else {"RAY_AUTH_MODE": value}) == mode


def test_an_unknown_auth_mode_is_refused_naming_the_variable_and_the_fix():
    with pytest.raises(RayAuthError, match=r"RAY_AUTH_MODE='off' is not a Ray auth mode; fix: .*RAY_AUTH_MODE=disabled"):
        requested_mode({"RAY_AUTH_MODE": "off"})


def test_a_fresh_token_is_random_private_from_its_creation_and_replaces_an_earlier_one(tmp_path):
    auth = own_cluster_auth(tmp_path / "run", environ={})
    old_umask = os.umask(0)  # the most permissive umask: the file must still be 0600
    try:
        write_fresh_token(auth)
        first = auth.token()
        write_fresh_token(auth)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(os.stat(auth.token_file).st_mode) == 0o600
    assert len(first) == 64 and int(first, 16) >= 0 and auth.token() != first
    assert auth.headers() == {"Authorization": f"Bearer {auth.token()}"}


def test_the_plan_entry_names_the_token_file_never_the_token(tmp_path):
    auth = own_cluster_auth(tmp_path, environ={})
    write_fresh_token(auth)
    entry = auth.plan_entry()
    assert entry == {"mode": "token", "token_file": str(tmp_path / "ray_auth_token")}
    assert auth.token() not in repr(entry)
    assert "warning" in ClusterAuth("disabled").plan_entry()


def test_a_worker_joins_only_with_the_token_it_is_given_never_a_stale_one_in_home(stale_home, tmp_path):
    with pytest.raises(RayAuthError, match=r"the head requires its token .*fix: export RAY_AUTH_TOKEN_PATH="):
        joining_auth({"HOME": str(stale_home)})
    token_file = tmp_path / "head_token"
    token_file.write_text("the-heads-token-value")
    given = joining_auth({"RAY_AUTH_TOKEN_PATH": str(token_file)})
    assert given.token() == "the-heads-token-value" and given.node_env({})["RAY_AUTH_TOKEN_PATH"] == str(token_file)
    assert joining_auth({"RAY_AUTH_MODE": "disabled"}).enabled is False
    (tmp_path / "empty").write_text("")
    with pytest.raises(RayAuthError, match="is empty"):
        joining_auth({"RAY_AUTH_TOKEN_PATH": str(tmp_path / "empty")})


def test_an_external_clusters_token_is_found_where_ray_looks_first_found_wins(stale_home, tmp_path, monkeypatch):
    token_file = tmp_path / "cluster_token"
    token_file.write_text("from-the-path")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "from-the-variable")
    both = {"RAY_AUTH_TOKEN": "from-the-variable", "RAY_AUTH_TOKEN_PATH": str(token_file)}
    assert users_auth("token", both).token() == "from-the-variable"
    assert users_auth("token", {"RAY_AUTH_TOKEN_PATH": str(token_file)}, home=stale_home).token() == "from-the-path"
    assert users_auth("token", {}, home=stale_home).token_file == str(stale_home / ".ray" / "auth_token")
    with pytest.raises(RayAuthError, match=r"requires a token and none in RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH"):
        users_auth("token", {}, home=tmp_path / "empty_home")


def test_an_external_cluster_without_auth_is_used_after_one_warning_naming_the_risk(capsys):
    url = "http://10.0.0.9:8265"
    try:
        auth = external_auth(url, "disabled", environ={})
        assert not auth.enabled and headers_for(url) == {}
    finally:
        ray_auth.forget(url)
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and warning[0].startswith(f"warning: the Ray cluster at {url} checks no token: anyone")


def test_headers_go_by_cluster_the_launcher_remembered_before_the_environment(tmp_path):
    mine = own_cluster_auth(tmp_path, environ={})
    write_fresh_token(mine)
    url = "http://127.0.0.1:1"
    other = tmp_path / "other"
    other.write_text("some-other-clusters-token")
    environ = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(other)}
    assert headers_for(url, environ) == {"Authorization": "Bearer some-other-clusters-token"}
    ray_auth.remember(url + "/", mine)
    try:
        assert headers_for(url, environ) == mine.headers()
    finally:
        ray_auth.forget(url)
    assert headers_for(url, {}) == {}
