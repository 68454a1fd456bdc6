"""`python -m tfdist.hubadmin`: the managed hub service (JupyterHub starts it with its token and URLs).

A bad ``gpu_admin`` section stops it with file, key and reason; the hub config checks the same file first
(`load_profiles_or_exit`), so in practice the hub itself refuses to start.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
from urllib.parse import urlparse

from tfdist.settings import AdminSettings
from tfdist.spawner.profiles import load_profiles_or_exit

from .app import make_app
from .report import MAX_BODY_BYTES
from .service import GpuAdminState


def _machine_gpus() -> list[str] | None:
    """Embedded hub: this machine's GPUs as the hub's allocator sees them (NVML, CUDA_VISIBLE_DEVICES)."""
    if not AdminSettings().local_gpus:
        return None
    from tfdist.gpus import visible_gpus

    return [g.name for g in visible_gpus()]


async def _main() -> None:
    logging.basicConfig(
        level=logging.INFO, format="[%(levelname)1.1s %(asctime)s tfdist-gpu-admin] %(message)s"
    )
    admin = AdminSettings()
    cfg = load_profiles_or_exit(admin.profiles)
    culling = cfg.gpu_admin.culling
    period = admin.period_s or (culling.check_interval_s if culling else 30.0)
    state = GpuAdminState(
        api_url=os.environ["JUPYTERHUB_API_URL"],
        api_token=os.environ["JUPYTERHUB_API_TOKEN"],
        culling=culling,
        profile_models={k: m.display_name for k, m in cfg.gpu_models.items()},
        machine_gpus=_machine_gpus(),
        period=period,
    )
    prefix = os.environ.get("JUPYTERHUB_SERVICE_PREFIX", "/services/tfdist-gpu-admin/")
    url = urlparse(os.environ.get("JUPYTERHUB_SERVICE_URL", "http://127.0.0.1:10101"))
    make_app(state, prefix).listen(
        url.port or 80,
        admin.bind or url.hostname or "",
        max_body_size=4 * MAX_BODY_BYTES,  # up to here a too-big report gets a 400 with the reason
    )
    logging.getLogger("tfdist.hubadmin").info(
        "GPU admin service on %s%s; culling %s; servers report every %gs",
        url.geturl(),
        prefix,
        "on" if culling else "off (no gpu_admin.culling in the profiles)",
        period,
    )
    await state.run_forever(period)


def _die_with_hub() -> None:
    """A hub killed outright (SIGKILL, OOM) cannot stop its services: end with it, not as an orphan."""
    hub = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != hub:  # the hub went before the prctl took effect
        sys.exit(0)


def main() -> None:
    # The hub stops its services with SIGINT, then after 30 s SIGTERM. A hub started as `cmd &` from a script
    # has SIGINT ignored, which Python (and so this service) inherits: take both back explicitly.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    _die_with_hub()
    try:
        asyncio.run(_main())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
