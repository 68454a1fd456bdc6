"""JupyterHub config for the embedded single-machine hub, for running `jupyterhub -f` yourself.

`tfdist-local-hub` (scripts/run-hub) writes an equivalent config on every start; use this file when you
manage the hub process yourself (e.g. under systemd with ``Delegate=yes`` for cgroup v2 memory limits).
Settings from the environment, read through `tfdist.settings.HubSettings` (docs/configuration.md):

  TFDIST_HUB_PASSWORD    users' shared password (required, at least 8 characters)
  TFDIST_HUB_STATE_DIR   database, cookie secret and users' folders (default ~/.local/share/tfdist-hub)
  TFDIST_HUB_PORT        port on 127.0.0.1 (default 8000)
  TFDIST_PROFILES        profiles YAML (default: the packaged single-machine profiles)
"""

from pathlib import Path

from tfdist.settings import HubSettings, SettingsError
from tfdist.spawner.localhub import configure

c = get_config()  # noqa: F821 - provided by JupyterHub when it loads this file

hub_settings = HubSettings()
if not hub_settings.password:
    raise SystemExit(
        "local_hub_config.py: set TFDIST_HUB_PASSWORD (or use tfdist-local-hub, which makes one)"
    )
try:
    port = hub_settings.port
except SettingsError as e:  # a sentence naming the variable, not a traceback
    raise SystemExit(f"local_hub_config.py: {e}") from None

configure(
    c,
    state_dir=hub_settings.state_base(),
    port=port,
    profiles=hub_settings.profiles,
    examples=str(Path(__file__).resolve().parent.parent / "examples"),
    user_password=hub_settings.password,
)
