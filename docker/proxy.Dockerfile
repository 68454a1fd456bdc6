# The configurable-http-proxy image of hub_config/values.yaml on the one-machine cluster (z2jh's
# proxy.chp.image; quay.io cannot be reached there). scripts/build-images proxy builds the same content
# without a container engine: Debian bookworm minbase + Debian's node-configurable-http-proxy (4.5) + tini,
# run as nobody as z2jh's chart runs it. On a real cluster keep z2jh's own quay.io image instead.
#   docker build -f docker/proxy.Dockerfile -t registry.example.org/ml/configurable-http-proxy:4.5 .
FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends node-configurable-http-proxy ca-certificates tini \
    && rm -rf /var/lib/apt/lists/*
USER 65534
EXPOSE 8000 8001
ENTRYPOINT ["tini", "--"]
CMD ["configurable-http-proxy"]
