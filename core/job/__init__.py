"""The job protocol: pure records, vocabulary and policies shared by the kernel, the supervisor and the pods (no I/O)."""
