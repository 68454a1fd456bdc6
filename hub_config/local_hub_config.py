"""JupyterHub config for the embedded single-machine hub, for running `jupyterhub -f` yourself.

`tfdist-local-hub` (scripts/run-hub) writes an equivalent config on every start; use this file when you
manage the hub process yourself (e.g. under systemd with ``Delegate=yes`` for cgroup v2 memory limits).
Settings from the environment:

  TFDIST_HUB_PASSWORD    users' shared password (required, at least 8 characters)
  TFDIST_HUB_STATE_DIR   database, cookie secret and users' folders (default ~/.local/share/tfdist-hub)
  TFDIST_HUB_PORT        port on 127.0.0.1 (default 8000)
  TFDIST_PROFILES        profiles YAML (default: the packaged single-machine profiles)
"""

import os
from pathlib import Path

from tfdist.spawner.localhub import configure

c = get_config()  # noqa: F821 - provided by JupyterHub when it loads this file

password = os.environ.get("TFDIST_HUB_PASSWORD")
if not password:
    raise SystemExit(
        "local_hub_config.py: set TFDIST_HUB_PASSWORD (or use tfdist-local-hub, which makes one)"
    )

configure(
    c,
    state_dir=os.environ.get("TFDIST_HUB_STATE_DIR") or str(Path.home() / ".local/share/tfdist-hub"),
    port=int(os.environ.get("TFDIST_HUB_PORT", "8000")),
    profiles=os.environ.get("TFDIST_PROFILES") or None,
    examples=str(Path(__file__).resolve().parent.parent / "examples"),
    user_password=password,
)
