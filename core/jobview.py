"""Moved to `tfdist.job.view` (the job protocol's package); this path stays for code that imports it."""

from .job.view import (  # noqa: F401
    LIVE_TASK_STATES,
    LOG_KEEP,
    METRICS_KEEP,
    SENTENCES,
    TERMINAL,
    JobView,
    Reason,
    check_view,
    final_task_state,
    reason_for,
    state_word,
    summary_fields,
)
