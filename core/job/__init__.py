"""The job protocol: pure records, vocabulary and policies shared by the kernel, the supervisor and the
pods (no I/O).

- `vocab`: job and task states, reasons, failure kinds, strategies (enums whose values are the wire's
  strings).
- `events`: the event records and their wire codec (one JSON object per line); `Reader` for untrusted
  streams. `tfdist.events` and `tfdist.runtime.events` re-export it (job images run those paths).
- `view`: `JobView`, the fold of a job's events; its fields are the one shape of a snapshot and, where
  marked, of the job's summary (`tfdist.jobrecords.JobSummary`, hence the panel's TypeScript types).
- `detach`: detached jobs' retention, results-once and their sentences, for both backends.
- `signing`: the notebook <-> agent request and response signatures (`tfdist.kube.signing` re-exports it).
- `restart`: the restart policy read by the supervisor and the manifests.
"""
