# Hub image for hub_config/values.yaml: z2jh's hub image plus jupyter-tfdist's hub extra.
# Build from the repository root:
#   docker build -f hub_config/hub.Dockerfile -t registry.example.org/ml/jupyter-tfdist-hub:0.1.0 .
ARG BASE=quay.io/jupyterhub/k8s-hub:4.3.1
FROM ${BASE}
USER root
COPY . /tmp/jupyter-tfdist
RUN pip install --no-cache-dir "/tmp/jupyter-tfdist[hub]" && rm -rf /tmp/jupyter-tfdist
USER ${NB_USER:-jovyan}
