"""Moved to `tfdist.job.signing` (the agent's protocol is the job protocol's). This path stays: job images
of any version import it (the pods' agent and entry points)."""

from ..job.signing import *  # noqa: F403
