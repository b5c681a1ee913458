"""Who may talk to a Ray cluster: the holders of its token.

Ray (2.52+) checks a token on its GCS, raylets, agents and dashboard when `RAY_AUTH_MODE=token`,
and every process finds the token the way Ray documents, first found wins: `RAY_AUTH_TOKEN` (the
value), `RAY_AUTH_TOKEN_PATH` (a file), `~/.ray/auth_token`.

Every cluster the launcher starts requires a token of its own: a fresh random one, in a file of
mode 0600 under the run's directory, named to each node by `RAY_AUTH_TOKEN_PATH` in `ray start`'s
environment (and so to every worker, job and driver the node starts), with `RAY_AUTH_TOKEN`
removed there. A token some earlier command left in `~/.ray` therefore never reaches our
clusters. The token itself is never in an argv, a log line or a plan: only its file's path is.
Our own HTTP clients (job submission, the state API) send it as a header (`headers_for`).

`RAY_AUTH_MODE=disabled` is the explicit opt-out: a warning says what it opens.
"""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from miles.launcher.launch_mode import LaunchModeError

AUTH_MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
TOKEN = "token"
DISABLED = "disabled"
TOKEN_FILE_NAME = "ray_auth_token"
_DOCS = "docs/launch-scripts.md, 'Who may use the cluster'"


class RayAuthError(LaunchModeError):
    """A token is needed and missing, or RAY_AUTH_MODE is no mode; the message names the fix."""


@dataclass(frozen=True)
class ClusterAuth:
    """How a process proves it belongs to one cluster: its token (from a file, or from the
    environment variable `token_env` of this process), or nothing when the cluster checks none."""

    mode: str  # TOKEN or DISABLED
    token_file: str | None = None
    token_env: str | None = None  # RAY_AUTH_TOKEN: the user's own way of giving an external cluster's token

    @property
    def enabled(self) -> bool:
        return self.mode == TOKEN

    def token(self) -> str:
        if self.token_env:
            return os.environ.get(self.token_env, "").strip()
        try:
            return Path(self.token_file).read_text().strip() if self.token_file else ""
        except OSError as err:
            raise RayAuthError(f"cannot read the Ray token file {self.token_file}: {err.strerror or err}; fix: "
                               f"point {TOKEN_PATH_ENV} at the cluster's token file") from None

    def headers(self) -> dict[str, str]:
        """The HTTP header Ray's job server and state API check ({} when the cluster checks none)."""
        return {"Authorization": f"Bearer {self.token()}"} if self.enabled else {}

    def node_env(self, base: Mapping[str, str]) -> dict[str, str]:
        """`base` as a Ray node (and every process it starts) must see it to be one of this
        cluster's: the mode named, and in token mode the token's file named and no other token."""
        env = dict(base)
        env[AUTH_MODE_ENV] = self.mode
        if self.enabled and self.token_file:
            env.pop(TOKEN_ENV, None)  # would win over the file
            env[TOKEN_PATH_ENV] = self.token_file
        elif not self.enabled:
            env.pop(TOKEN_PATH_ENV, None)
            env.pop(TOKEN_ENV, None)
        return env

    def plan_entry(self) -> dict:
        """What the plan records: the mode and where the token is, never the token."""
        entry: dict = {"mode": self.mode}
        if self.token_file:
            entry["token_file"] = self.token_file
        if self.token_env:
            entry["token_from"] = self.token_env
        if not self.enabled:
            entry["warning"] = disabled_warning()
        return entry


def requested_mode(environ: Mapping[str, str] | None = None) -> str:
    """TOKEN unless RAY_AUTH_MODE=disabled says otherwise; any other value is refused."""
    environ = os.environ if environ is None else environ
    raw = (environ.get(AUTH_MODE_ENV) or "").strip().lower()
    if raw in ("", TOKEN):
        return TOKEN
    if raw == DISABLED:
        return DISABLED
    raise RayAuthError(f"{AUTH_MODE_ENV}={environ.get(AUTH_MODE_ENV)!r} is not a Ray auth mode; fix: leave it unset "
                       f"(every cluster requires its own token) or set {AUTH_MODE_ENV}=disabled to opt out")


def disabled_warning() -> str:
    return (f"{AUTH_MODE_ENV}=disabled: this Ray cluster checks no token, so anyone who can reach its GCS, raylet or "
            f"agent ports (Ray opens them on every interface) can run code as you, beside your checkpoints and keys; "
            f"fix: unset {AUTH_MODE_ENV} ({_DOCS})")


def own_cluster_auth(directory: str | Path, environ: Mapping[str, str] | None = None) -> ClusterAuth:
    """The auth of a cluster this launcher starts: a token file of its own under `directory`
    (written when the cluster starts), unless the user opted out."""
    if requested_mode(environ) == DISABLED:
        return ClusterAuth(DISABLED)
    return ClusterAuth(TOKEN, token_file=str(Path(directory) / TOKEN_FILE_NAME))


def write_fresh_token(auth: ClusterAuth) -> None:
    """A new random token in the auth's file, mode 0600 from its creation on (never readable by
    others, not even for a moment); an earlier file there is replaced."""
    if not auth.enabled or not auth.token_file:
        return
    path = Path(auth.token_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, secrets.token_hex(32).encode())  # 256 bits, as Ray's own generator
    finally:
        os.close(fd)


def remove_token(auth: ClusterAuth | None) -> None:
    """The cluster is gone: its token opens nothing any more, and its file goes with it."""
    if auth is not None and auth.token_file:
        Path(auth.token_file).unlink(missing_ok=True)


def joining_auth(environ: Mapping[str, str] | None = None) -> ClusterAuth:
    """A node joining a head started by this launcher (the `worker` role): the head's token, given
    the documented way (RAY_AUTH_TOKEN_PATH, a file on a shared filesystem, or RAY_AUTH_TOKEN).
    ~/.ray/auth_token is never taken: the head's token is new with each run."""
    environ = os.environ if environ is None else environ
    if requested_mode(environ) == DISABLED:
        return ClusterAuth(DISABLED)
    path = (environ.get(TOKEN_PATH_ENV) or "").strip()
    if (environ.get(TOKEN_ENV) or "").strip():
        return ClusterAuth(TOKEN, token_env=TOKEN_ENV)
    if path:
        auth = ClusterAuth(TOKEN, token_file=str(Path(path).expanduser().resolve()))
        if not auth.token():
            raise RayAuthError(f"{TOKEN_PATH_ENV}={path} is empty; fix: point it at the head's token file")
        return auth
    raise RayAuthError(
        f"the head requires its token and none was given; fix: export {TOKEN_PATH_ENV}=<the head's token file: "
        f"<output-dir>/<run-id>/{TOKEN_FILE_NAME}, on a filesystem the nodes share> (or {TOKEN_ENV}=<its contents>), "
        f"or {AUTH_MODE_ENV}=disabled if the head runs with it ({_DOCS})")


def users_auth(cluster_mode: str, environ: Mapping[str, str] | None = None,
               home: Path | None = None) -> ClusterAuth:
    """For an external cluster whose mode is `cluster_mode`: the user's token, where Ray looks
    for it (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token, first found wins)."""
    environ = os.environ if environ is None else environ
    if cluster_mode != TOKEN:
        return ClusterAuth(DISABLED)
    if (environ.get(TOKEN_ENV) or "").strip():
        return ClusterAuth(TOKEN, token_env=TOKEN_ENV)
    path = (environ.get(TOKEN_PATH_ENV) or "").strip()
    default = (home or Path.home()) / ".ray" / "auth_token"
    candidate = Path(path).expanduser() if path else default
    if candidate.is_file() and candidate.read_text().strip():
        return ClusterAuth(TOKEN, token_file=str(candidate.resolve()))
    where = f"{TOKEN_PATH_ENV}={path} is missing or empty" if path else f"none in {TOKEN_ENV}, {TOKEN_PATH_ENV} or {default}"
    raise RayAuthError(f"the Ray cluster requires a token and {where}; fix: export {TOKEN_PATH_ENV}=<the cluster's "
                       f"token file> (or {TOKEN_ENV})")


def external_disabled_warning(url: str) -> str:
    return (f"the Ray cluster at {url} checks no token: anyone who can reach its job server or GCS can run code as "
            f"you on it; fix: start its nodes with {AUTH_MODE_ENV}=token and a shared token ({_DOCS})")


# Our own HTTP clients reach a cluster by its job server URL; the launcher says which auth goes with which
# URL while the cluster is up, so a recipe's hook calling wait_for_cluster_resources(url) needs nothing more.
_KNOWN: dict[str, ClusterAuth] = {}


def remember(url: str, auth: ClusterAuth) -> None:
    _KNOWN[url.rstrip("/")] = auth


def forget(url: str) -> None:
    _KNOWN.pop(url.rstrip("/"), None)


def headers_for(url: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The auth header for the cluster at `url`: the one the launcher remembered for it, else, as
    Ray's own clients do, the token this process's environment names when RAY_AUTH_MODE=token."""
    known = _KNOWN.get(url.rstrip("/"))
    if known is not None:
        return known.headers()
    environ = os.environ if environ is None else environ
    if (environ.get(AUTH_MODE_ENV) or "").strip().lower() != TOKEN:
        return {}
    return users_auth(TOKEN, environ).headers()


def external_auth(url: str, cluster_mode: str, environ: Mapping[str, str] | None = None) -> ClusterAuth:
    """How to talk to an external cluster reporting `cluster_mode`: with the user's token when it
    checks one (a one-line error naming the fix when there is none), else with nothing, after a
    one-line warning naming the risk. Remembered for the cluster's URL (headers_for)."""
    if cluster_mode == DISABLED:
        print(f"warning: {external_disabled_warning(url)}", file=sys.stderr, flush=True)
        auth = ClusterAuth(DISABLED)
    else:
        auth = users_auth(TOKEN, environ)
    remember(url, auth)
    return auth


def how_nodes_join(auth: ClusterAuth, gcs_address: str) -> str:
    """For a multi-node head: where the other nodes find its token (the file's path, never the token)."""
    how = (f"{TOKEN_PATH_ENV}={auth.token_file} (a file on a filesystem they share; or {TOKEN_ENV} set to its "
           f"contents)" if auth.enabled else f"{AUTH_MODE_ENV}=disabled")
    return f"other nodes join {gcs_address} with {how}: docs/launch-scripts.md, multi-node"


_PROCESS_NAMES = (AUTH_MODE_ENV, TOKEN_ENV, TOKEN_PATH_ENV)


def use_in_this_process(auth: ClusterAuth) -> dict[str, str | None]:
    """For a cluster this process starts or joins with Ray's own client (`ray.init`, which reads
    only the environment): name `auth` there, and refresh what Ray cached of it (its config and
    its token, read once per process). Returns what `restore_this_process` puts back."""
    saved = {name: os.environ.get(name) for name in _PROCESS_NAMES}
    for name in _PROCESS_NAMES:
        os.environ.pop(name, None)
    os.environ.update(auth.node_env({}))
    _refresh_ray_caches()
    return saved


def restore_this_process(saved: Mapping[str, str | None]) -> None:
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _refresh_ray_caches()


def _refresh_ray_caches() -> None:
    if "ray._raylet" not in sys.modules:
        return  # read fresh when Ray is first imported
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")  # Ray's own way to make a process see a changed RAY_AUTH_MODE
    AuthenticationTokenLoader.instance().reset_cache()
