"""What the hub says at start where users' servers share its web origin.

Without `JupyterHub.subdomain_host`, every server is served from the hub's own origin, and a user's server
runs whatever its user puts there (a lab extension in their home, their own jupyter config). An admin who
opens it (the admin panel's "access server", a link the user sends) runs that user's script on the hub's
origin, where it can read the hub's pages and call the hub's API as the admin. JupyterHub's admin role
opens every server and its scopes cannot be changed; taking admins out of it breaks authenticators that
read `admin_users` (the shared-password one among them). Subdomains are the fix JupyterHub documents; a
hub without them says so in its log at every start, and docs/security.md keeps it as a known limit.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SHARED_ORIGIN", "shared_origin_warning"]

SHARED_ORIGIN = (
    "tfdist: users' servers share the hub's origin (no JupyterHub.subdomain_host): an admin who opens a "
    "user's server (the admin panel's 'access server', a link) runs that user's code in their browser as "
    "the admin. Set hub.config.JupyterHub.subdomain_host (docs/admins.md), or do not open users' servers."
)


def shared_origin_warning(c: Any) -> str | None:
    """The warning for config `c`, or None where servers have their own origin."""
    hub = c.JupyterHub
    if "subdomain_host" in hub and hub.subdomain_host:
        return None
    return SHARED_ORIGIN
