# ipmasq node agent image: Debian's iptables/nftables/conntrack/iproute2 and ipmasq in a Python virtual environment.
#   scripts/release-image.sh REGISTRY/PATH    builds it (labels and revision set), pushes it and pins deploy/ to it
# VERSION, REVISION, SOURCE: the OCI labels (the script passes ipmasq.__version__, the commit and the repository);
# REVISION is also written into the image, where `ipmasq --version` prints it.
# BASE: any Debian bookworm image with python3 (and python3-venv); the Kubernetes lab passes one it made from
# Debian's packages (`ipmasq lab --kubernetes`), where no registry can be pulled from.
ARG BASE=python:3.11-slim-bookworm

# Build stage: the source, pip and setuptools stay here.
FROM ${BASE} AS build
ARG REVISION=""
COPY . /src
RUN /src/scripts/install-image.sh /src /opt/ipmasq "$REVISION"

# Runtime stage: the kernel tools and the virtual environment, nothing to build or install with.
FROM ${BASE}
ARG VERSION=""
ARG REVISION=""
ARG SOURCE="https://github.com/ipmasq/ipmasq"
LABEL org.opencontainers.image.title="ipmasq" \
      org.opencontainers.image.description="Pod SNAT for Kubernetes nodes: a drop-in ip-masq-agent" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}"
# iproute2: `ipmasq trace` reads the node's rules, routes and addresses with `ip -j`
RUN command -v iptables >/dev/null && command -v nft >/dev/null && command -v conntrack >/dev/null \
    && command -v ip >/dev/null \
    || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        iptables nftables conntrack iproute2 && rm -rf /var/lib/apt/lists/*); \
    python3 -m pip uninstall -q -y pip setuptools wheel 2>/dev/null; true
COPY --from=build /opt/ipmasq /opt/ipmasq
ENV PATH=/opt/ipmasq/bin:$PATH PYTHONDONTWRITEBYTECODE=1
RUN ipmasq --version && ipmasq render >/dev/null
ENTRYPOINT ["ipmasq"]
CMD ["agent"]
