# The notebook (single-user server) image for TfdistKubeSpawner, for users with a registry: the job image's
# content plus jupyterhub-singleuser, JupyterLab and the kernel's packages (docker/notebook.lock), and the
# project wheel with its lab extension. scripts/build-images notebook builds the same content without a
# container engine.
#   docker build -f docker/notebook.Dockerfile -t registry.example.org/tfdist-notebook:0.1.0 .
FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-pip ca-certificates tini \
    && rm -rf /var/lib/apt/lists/* && useradd --create-home --uid 1000 --user-group tfdist
COPY docker/job.lock docker/notebook.lock /tmp/
RUN pip3 install --break-system-packages --no-cache-dir --no-deps --only-binary=:all: -r /tmp/job.lock \
    && pip3 install --break-system-packages --no-cache-dir --no-deps --only-binary=:all: -r /tmp/notebook.lock \
    && rm -rf /usr/local/lib/python3.11/dist-packages/tensorflow/include /tmp/*.lock
COPY . /src
RUN pip3 install --break-system-packages --no-cache-dir --no-deps /src && rm -rf /src
ENV PYTHONUNBUFFERED=1 TF_USE_LEGACY_KERAS=1 GRPC_FAIL_FAST=use_caller TF_CPP_MIN_LOG_LEVEL=2 \
    HOME=/home/tfdist SHELL=/bin/bash
WORKDIR /home/tfdist
USER 1000
EXPOSE 8888
ENTRYPOINT ["tini", "-g", "--"]
CMD ["jupyterhub-singleuser"]
