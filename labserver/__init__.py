"""The Jupyter server side of the lab panel: REST routes under `{base_url}/tfdist/api/`.

Kept apart from `tfdist` itself so that the kernel never imports tornado or jupyter_server;
`tfdist._jupyter_server_extension_points` only names this module.
"""

from __future__ import annotations

from typing import Any

from .handlers import setup_route_handlers
from .shutdown import release_workers_at_exit

LAB_EXTENSION_NAME = "jupyter-tfdist"


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    """Where the prebuilt lab extension lies inside the installed package (for `jupyter labextension`)."""
    return [{"src": "labextension", "dest": LAB_EXTENSION_NAME}]


def _load_jupyter_server_extension(serverapp: Any) -> None:
    """Mount the routes and make the one sampler this server shares between all tabs; let the server exit
    when stopped mid-request (labserver.shutdown)."""
    setup_route_handlers(serverapp)
    release_workers_at_exit()
    serverapp.log.info("tfdist: jobs panel routes mounted under %s", "tfdist/api/")


async def _start_jupyter_server_extension(serverapp: Any) -> None:
    """With the event loop running: push GPU activity to the hub's GPU admin service (labserver.reporter)."""
    from .activity import start_reporting

    start_reporting(serverapp.web_app)


load_jupyter_server_extension = _load_jupyter_server_extension  # the pre-2.0 name
