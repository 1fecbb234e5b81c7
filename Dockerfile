# ipmasq node agent image: Debian's iptables/nftables/conntrack and a Python virtual environment.
# docker build -t ipmasq/ipmasq:0.1.0 .
FROM python:3.11-slim-bookworm
COPY . /src
RUN /src/scripts/install-image.sh /src /opt/ipmasq && rm -rf /src
ENV PATH=/opt/ipmasq/bin:$PATH PYTHONDONTWRITEBYTECODE=1
ENTRYPOINT ["ipmasq"]
CMD ["agent"]
