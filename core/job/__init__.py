"""The job protocol: pure records, vocabulary and policies shared by the kernel, the supervisor and the
pods (no I/O).

- `vocab`: job and task states, reasons, failure kinds (enums whose values are the wire's strings).
"""
