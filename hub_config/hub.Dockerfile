# Hub image for hub_config/values.yaml: z2jh 4.4.0's hub image plus jupyter-tfdist's hub extra. The extra
# accepts the JupyterHub (5.5.0) and kubespawner (7.0.0) that image ships, so pip adds packages and upgrades
# none of z2jh's pins (docker/hub.lock is that resolved set; tests/test_z2jh_values.py checks it).
# scripts/build-images hub builds the same content without a container engine for the one-machine cluster.
# Build from the repository root:
#   docker build -f hub_config/hub.Dockerfile -t registry.example.org/ml/jupyter-tfdist-hub:0.1.0 .
ARG BASE=quay.io/jupyterhub/k8s-hub:4.4.0
FROM ${BASE}
USER root
COPY . /tmp/jupyter-tfdist
RUN pip install --no-cache-dir "/tmp/jupyter-tfdist[hub]" && rm -rf /tmp/jupyter-tfdist
USER ${NB_USER:-jovyan}
