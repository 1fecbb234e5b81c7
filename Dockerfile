# ipmasq node agent image: Debian's iptables/nftables/conntrack and ipmasq in a Python virtual environment.
#   docker build -t ipmasq/ipmasq:0.1.0 .
# BASE: any Debian bookworm image with python3 (and python3-venv); the Kubernetes lab passes one it made from
# Debian's packages (`ipmasq lab --kubernetes`), where no registry can be pulled from.
ARG BASE=python:3.11-slim-bookworm

# Build stage: the source, pip and setuptools stay here.
FROM ${BASE} AS build
COPY . /src
RUN /src/scripts/install-image.sh /src /opt/ipmasq

# Runtime stage: the kernel tools and the virtual environment, nothing to build or install with.
FROM ${BASE}
RUN command -v iptables >/dev/null && command -v nft >/dev/null && command -v conntrack >/dev/null \
    || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        iptables nftables conntrack && rm -rf /var/lib/apt/lists/*); \
    python3 -m pip uninstall -q -y pip setuptools wheel 2>/dev/null; true
COPY --from=build /opt/ipmasq /opt/ipmasq
ENV PATH=/opt/ipmasq/bin:$PATH PYTHONDONTWRITEBYTECODE=1
RUN ipmasq --version && ipmasq render >/dev/null
ENTRYPOINT ["ipmasq"]
CMD ["agent"]
