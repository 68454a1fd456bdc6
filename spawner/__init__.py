"""The GPU spawn form: profiles, validation and the embedded/Kubernetes spawners."""
