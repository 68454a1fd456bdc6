"""The hub's admin role where users' servers share the hub's web origin.

Without `JupyterHub.subdomain_host`, every server is served from the hub's own origin, and a user's server
runs whatever its user puts there (a lab extension in their home, their own jupyter config). An admin who
opens it (the admin panel's "access server", a link the user sends) runs that user's script on the hub's
origin, where it reads the hub's pages and calls the hub's API as the admin: a token for anyone, every
server. JupyterHub says so itself: a user must never serve HTML to another user on the hub's domain.
JupyterHub's default admin role opens every server (`access:servers`); on a hub without subdomains ours
does not. Admins still start, stop and inspect servers (`admin:servers`), read the GPU page and share a
server on purpose (`shares`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["ADMIN_ROLE", "SERVER_ACCESS", "confine_admins", "same_origin_admin_role"]

ADMIN_ROLE = "admin"
SERVER_ACCESS = "access:servers"


def same_origin_admin_role() -> dict[str, Any]:
    """JupyterHub's own admin role (this version's), less opening users' servers."""
    from jupyterhub.roles import get_default_roles

    role = next(r for r in get_default_roles() if r["name"] == ADMIN_ROLE)
    scopes = [s for s in role["scopes"] if s.split("!", 1)[0] != SERVER_ACCESS]
    return {
        "name": ADMIN_ROLE,
        "description": role.get("description", "") + " (not users' servers: they share the hub's origin)",
        "scopes": scopes,
    }


def confine_admins(c: Any) -> bool:
    """Redefine the admin role in config `c` unless servers have their own origin (subdomain_host) or the
    config already defines an admin role (the admin's own choice). True when it did."""
    hub = c.JupyterHub
    if "subdomain_host" in hub and hub.subdomain_host:
        return False
    roles = list(hub.load_roles) if "load_roles" in hub else []
    if any(r.get("name") == ADMIN_ROLE for r in roles):
        return False
    hub.load_roles = [*roles, same_origin_admin_role()]
    return True
