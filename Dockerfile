# The shareguard image: the release binary (agent, CLI and kubelet plugin in one) and
# what the agent runs: iproute2's `tc` (qdisc probing and HTB classes) and util-linux's
# `unshare` and `mount` (each MPS daemon's /dev/shm in a mount namespace of its own;
# both are in the base image). NVIDIA's libraries and MPS programs are not in it: the
# NVIDIA container toolkit injects the node driver's own (deploy/README.md, GPUs).
#
# Build the binary first (the eBPF programs need the nightly toolchain and bpf-linker,
# which `make showcase` or `make test` install), then the image from the repository:
#
#   cargo build --release --locked -p shareguard
#   docker build -t REGISTRY/shareguard:TAG .
#
# tests/cluster/images.sh builds the same content without a Docker daemon (host
# binaries and their libraries into an OCI layout); that is the image the test cluster
# runs. This file itself has not been built here: no Docker daemon was available.
FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends iproute2 \
    && rm -rf /var/lib/apt/lists/*
COPY target/release/shareguard /usr/local/bin/shareguard
ENTRYPOINT ["/usr/local/bin/shareguard"]
