"""Kubernetes pieces of a job: pure manifest builders (manifests) and the API I/O that applies them."""
