"""Moved to `tfdist.job.events` (the job protocol's records and wire codec). This path stays: job images
of any version import it, and an older image must keep working with a newer kernel."""

from .job.events import *  # noqa: F403
