"""What runs inside a job: task servers, the coordinator and the local supervisor."""
