# The image of %%tfdist job pods on Kubernetes (coordinator, PS and workers), for users with a registry.
# scripts/build-images builds the same content without a container engine (Debian bookworm minbase +
# python3, docker/job.lock installed --no-deps, the project wheel) for the one-machine cluster
# (scripts/cluster) and writes it as an OCI archive you can push (skopeo copy oci-archive:... docker://...).
#   docker build -f docker/job.Dockerfile -t registry.example.org/tfdist-job:0.1.0 .
# Then let the hub know: TfdistKubeSpawner.worker_image (TFDIST_WORKER_IMAGE).
# docker/job.lock pins tensorflow-cpu; for GPU nodes replace that line by tensorflow[and-cuda]==2.21.0 (and
# drop --no-deps for it: the CUDA wheels are its dependencies).
FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-pip ca-certificates tini \
    && rm -rf /var/lib/apt/lists/* && useradd --create-home --uid 1000 --user-group tfdist
COPY docker/job.lock /tmp/job.lock
RUN pip3 install --break-system-packages --no-cache-dir --no-deps --only-binary=:all: -r /tmp/job.lock \
    && rm -rf /usr/local/lib/python3.11/dist-packages/tensorflow/include /tmp/job.lock
COPY . /src
RUN pip3 install --break-system-packages --no-cache-dir --no-deps /src && rm -rf /src
ENV PYTHONUNBUFFERED=1 TF_USE_LEGACY_KERAS=1 GRPC_FAIL_FAST=use_caller TF_CPP_MIN_LOG_LEVEL=2 HOME=/home/tfdist
WORKDIR /home/tfdist
USER 1000
EXPOSE 2222 8470
ENTRYPOINT ["python3", "-m", "tfdist.runtime.podmain"]
