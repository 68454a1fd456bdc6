"""`tfdist-local-hub`: JupyterHub on one machine with the tfdist GPU form (the README's main command).

Why: a team sharing one multi-GPU machine needs a hub without Kubernetes. This starts JupyterHub on
127.0.0.1 with TfdistLocalSpawner, generates a password and prints it, and opens each user's server on the
example notebook.

Authentication: JupyterHub's SharedPasswordAuthenticator (built in since 5.3, no extra package, no PAM
and no system accounts): anyone with the printed password logs in under any user name they pick, and
only the user `admin` logs in with the admin password. That matches the trust model of one shared team
machine (servers run as the hub's Unix user anyway); for anything wider use a real identity provider
(e.g. oauthenticator) through your own jupyterhub_config.py calling `configure()`.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from tfdist.settings import HubSettings

__all__ = [
    "configure",
    "default_profiles_path",
    "find_proxy_command",
    "free_port",
    "login_templates_path",
    "main",
]


def default_profiles_path() -> str:
    """The packaged single-machine profiles (hub_config/ holds the Kubernetes ones)."""
    return str(resources.files("tfdist.spawner") / "data" / "profiles-local.yaml")


#: how long the proxy waits for a server's answer (the spawn progress stream lasts the whole start)
PROXY_TIMEOUT_S = 600


def login_templates_path() -> str:
    """JupyterHub page templates of the local hub (a login page that says where the password is)."""
    return str(resources.files("tfdist.spawner") / "templates" / "hub")


def free_port(ip: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return int(s.getsockname()[1])


def find_proxy_command() -> list[str]:
    """configurable-http-proxy: the Python port in this environment, else the Node one on PATH."""
    here = Path(sys.executable).parent / "configurable-http-proxy"
    if here.exists():
        return [str(here)]
    found = shutil.which("configurable-http-proxy")
    if found:
        return [found]
    raise SystemExit(
        "tfdist-local-hub: configurable-http-proxy was not found. Install it with "
        "'pip install configurable-http-proxy' (or 'npm install -g configurable-http-proxy')."
    )


def configure(
    c: Any,
    *,
    state_dir: str,
    ip: str = "127.0.0.1",
    port: int = 8000,
    hub_port: int | None = None,
    proxy_api_port: int | None = None,
    profiles: str | None = None,
    examples: str | None = None,
    example_notebook: str = "digits.ipynb",
    user_password: str,
    admin_password: str | None = None,
    gpu_admin: bool = False,
    gpu_admin_port: int | None = None,
) -> None:
    """Fill a JupyterHub config object for the embedded hub (also used by hub_config/local_hub_config.py)."""
    from tfdist.spawner.local import TfdistLocalSpawner
    from tfdist.spawner.profiles import load_profiles_or_exit

    state = Path(state_dir)
    (state / "users").mkdir(parents=True, exist_ok=True)
    os.chmod(state, 0o700)
    profiles = profiles or default_profiles_path()
    load_profiles_or_exit(profiles)  # a broken file stops the hub here, naming file, key and reason

    c.JupyterHub.ip = ip
    c.JupyterHub.port = port
    c.JupyterHub.hub_ip = "127.0.0.1"
    c.JupyterHub.hub_port = hub_port or free_port()
    c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{proxy_api_port or free_port()}"
    # The Python proxy answers a request only once the server behind it has finished it, and gives up after
    # tornado's default 20 s: the spawn page's progress stream of a server that takes longer to start (a busy
    # machine) would fail and leave the user on "Your server is starting up" for good.
    c.ConfigurableHTTPProxy.command = [*find_proxy_command(), "--proxy-timeout", str(PROXY_TIMEOUT_S * 1000)]
    c.ConfigurableHTTPProxy.pid_file = str(state / "proxy.pid")
    c.JupyterHub.db_url = f"sqlite:///{state / 'jupyterhub.sqlite'}"
    c.JupyterHub.cookie_secret_file = str(state / "jupyterhub_cookie_secret")
    c.JupyterHub.allow_named_servers = True
    c.JupyterHub.named_server_limit_per_user = 4
    c.JupyterHub.cleanup_servers = True

    c.JupyterHub.authenticator_class = "shared-password"
    c.SharedPasswordAuthenticator.user_password = user_password
    if admin_password:
        c.SharedPasswordAuthenticator.admin_password = admin_password
        c.Authenticator.admin_users = {"admin"}
    c.Authenticator.allow_all = True
    # JupyterHub's own login page, extended with where the printed password is (templates/hub/login.html)
    c.JupyterHub.template_paths = [login_templates_path()]

    c.JupyterHub.spawner_class = TfdistLocalSpawner
    c.TfdistLocalSpawner.profiles_file = profiles
    c.TfdistLocalSpawner.home_dir_template = str(state / "users" / "{username}")
    if examples and Path(examples).is_dir():
        c.TfdistLocalSpawner.example_dir = str(Path(examples).resolve())
        c.TfdistLocalSpawner.example_notebook = example_notebook
    c.Spawner.start_timeout = 120
    c.Spawner.http_timeout = 90
    if gpu_admin:  # GPU-idle culling (gpu_admin: in the profiles), admin page, metrics: tfdist.hubadmin
        from tfdist.hubadmin.hubconfig import enable_gpu_admin

        shown = "127.0.0.1" if ip in ("0.0.0.0", "", "127.0.0.1") else ip
        enable_gpu_admin(
            c,
            profiles=profiles,
            public_url=f"http://{shown}:{port}",
            port=gpu_admin_port or free_port(),
            local_gpus=True,
        )


def _skip_slow_optional_imports() -> None:
    """Start the hub seconds sooner: jsonschema (through jupyter_events) imports rfc3987_syntax, when it is
    installed, only to check the "iri" string format, and that import builds a parser grammar: 1.5 s on an
    idle machine, 10 s and more on a busy one, about half of the hub's start. jsonschema treats it as
    optional (ImportError -> that format goes unchecked), and no hub or event schema uses it."""
    sys.modules.setdefault("rfc3987_syntax", None)  # type: ignore[arg-type]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tfdist-local-hub", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--ip", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)"
    )
    hub = HubSettings()
    p.add_argument("--port", type=int, default=hub.port)
    p.add_argument(
        "--state-dir",
        default=hub.state_base(),
        help="database, cookie secret and users' folders",
    )
    p.add_argument(
        "--profiles", default=None, help="profiles YAML (default: the packaged single-machine one)"
    )
    p.add_argument("--examples", default=None, help="folder copied into each user's folder as 'examples'")
    p.add_argument("--notebook", default="digits.ipynb", help="notebook in --examples each server opens")
    p.add_argument(
        "--no-gpu-admin",
        action="store_true",
        help="do not run the GPU admin service (GPU-idle culling, /services/tfdist-gpu-admin/, metrics)",
    )
    p.add_argument(
        "--password",
        default=hub.password,
        help="users' shared password (default: generated and printed; at least 8 characters)",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    password = args.password or secrets.token_urlsafe(12)
    if len(password) < 8:
        raise SystemExit("tfdist-local-hub: the password must be at least 8 characters")
    admin_password = secrets.token_urlsafe(32)
    state = Path(args.state_dir).expanduser().resolve()
    state.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(state, 0o700)  # before anything secret is written into it
    settings = {
        "state_dir": str(state),
        "ip": args.ip,
        "port": args.port,
        "profiles": str(Path(args.profiles).resolve()) if args.profiles else None,
        "examples": str(Path(args.examples).resolve()) if args.examples else None,
        "example_notebook": args.notebook,
        "user_password": password,
        "admin_password": admin_password,
    }
    cfg = state / "jupyterhub_config.py"
    text = (
        "# generated by tfdist-local-hub on every start; edit the command line instead\n"
        "from tfdist.spawner.localhub import configure\n"
        f"configure(c, **{json.dumps(settings, indent=2)}".replace(": null", ": None")
        + f", gpu_admin={not args.no_gpu_admin!r})\n"
    )
    fd = os.open(
        cfg, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600
    )  # holds the passwords: 0600 from the start
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(cfg, 0o600)
    shown = "localhost" if args.ip == "127.0.0.1" else args.ip
    print(
        "\n"
        f"  tfdist local hub: http://{shown}:{args.port}/\n"
        f"  log in with any user name and the password   {password}\n"
        f"  (admin panel: user 'admin', password          {admin_password})\n"
        f"  state: {state}\n",
        flush=True,
    )
    _skip_slow_optional_imports()
    from jupyterhub.app import JupyterHub

    os.chdir(state)
    JupyterHub.launch_instance(["-f", str(cfg)])


if __name__ == "__main__":  # pragma: no cover
    main()
