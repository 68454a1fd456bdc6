# The image of %%tfdist job pods on Kubernetes (coordinator, PS and workers): the same package as the
# notebook, with TensorFlow (CUDA build) and tf-keras pinned to the same minor version.
# Build and push it yourself, then let the hub know: TfdistKubeSpawner.worker_image (TFDIST_WORKER_IMAGE).
#   docker build -f docker/job.Dockerfile -t registry.example.org/tfdist-job:0.1.0 .
# Not built in this repository's CI (no container engine there); the code it runs is tested locally
# (tests/test_pod_runtime.py runs tfdist.runtime.podmain as processes).
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 TF_USE_LEGACY_KERAS=1 GRPC_FAIL_FAST=use_caller TF_CPP_MIN_LOG_LEVEL=2
RUN pip install --no-cache-dir "tensorflow[and-cuda]==2.21.0" "tf-keras==2.21.0" cloudpickle psutil \
        nvidia-ml-py pydantic pyyaml traitlets
COPY . /src
RUN pip install --no-cache-dir --no-deps /src && rm -rf /src
RUN useradd --create-home --uid 1000 tfdist
USER 1000
EXPOSE 2222 8470
ENTRYPOINT ["python", "-m", "tfdist.runtime.podmain"]
