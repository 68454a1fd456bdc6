"""A PS or worker task: a TensorFlow gRPC server configured by TF_CONFIG, nothing else.

The same entry point runs as a local process and in a Kubernetes pod. It exits when its supervisor
(local) or the coordinator's end (Kubernetes: the pod is deleted) says so; it never outlives the job.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
    from tfdist.taskenv import ensure_threads

    ensure_threads()  # before TensorFlow reads them
    cfg = json.loads(os.environ["TF_CONFIG"])
    task = cfg["task"]
    # No Python SIGTERM handler: server.join() blocks in C++, so only the default action ends it at once.
    from tfdist.runtime.importing import collector_paused

    with collector_paused():
        import tensorflow as tf

    server = tf.distribute.Server(
        tf.train.ClusterSpec(cfg["cluster"]),
        job_name=task["type"],
        task_index=task["index"],
        protocol="grpc",
        start=True,
    )
    print(f"tfdist: {task['type']}-{task['index']} serving at {server.target}", flush=True)
    server.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
