# amqpbroker container image.
#
#   docker build -t amqpbroker .                      # public Python base image (default)
#   docker build --build-arg BASE_IMAGE=local/debian-py:bookworm -t amqpbroker .
#
# The image installs the wheels in ./wheelhouse (built on the host with
# `pip wheel . -w wheelhouse`), so no package index is needed during the build.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

# Runtime libraries python-qpid-proton links against (TLS, Cyrus SASL); a base
# image that already has them (the local Debian one) skips the package install.
RUN if ! ldconfig -p | grep -q 'libsasl2.so.2' || ! ldconfig -p | grep -q 'libssl.so.3'; then \
      apt-get update && apt-get install -y --no-install-recommends libssl3 libsasl2-2 libsasl2-modules \
      && rm -rf /var/lib/apt/lists/*; \
    fi

COPY wheelhouse /tmp/wheelhouse
# EXTRAS="[ha]" adds kazoo for a replicated pair (compose profile `ha`, docs/ha.md;
# EXTRAS="[cluster]" the same for the compose profile `cluster`, docs/cluster.md;
# the wheelhouse must then hold kazoo's wheel too).
ARG EXTRAS=""
RUN python3 -m venv /opt/amqpbroker \
    && /opt/amqpbroker/bin/pip install --no-cache-dir --no-index --find-links /tmp/wheelhouse "amqpbroker${EXTRAS}" \
    && rm -rf /tmp/wheelhouse \
    && (getent group amqp >/dev/null || groupadd --system --gid 10001 amqp) \
    && (getent passwd amqp >/dev/null || useradd --system --uid 10001 --gid amqp --home-dir /data --shell /usr/sbin/nologin amqp) \
    && mkdir -p /data && chown amqp:amqp /data

# Listeners on every interface: published ports (`-p 5672:5672 -p 8161:8161`) reach them.
# On 0.0.0.0 the broker offers SASL SCRAM-SHA-256 only (ANONYMOUS with
# AMQPBROKER_ALLOW_ANONYMOUS=true; PLAIN on the TLS listener), and the management API
# answers other hosts only once a user with the manage permission is configured; it
# logs how otherwise (docs/deploy.md).
ENV PATH=/opt/amqpbroker/bin:$PATH \
    AMQPBROKER_HOST=0.0.0.0 \
    AMQPBROKER_PORT=5672 \
    AMQPBROKER_MANAGEMENT__HOST=0.0.0.0 \
    AMQPBROKER_DATA_DIR=/data \
    PYTHONUNBUFFERED=1

USER amqp
VOLUME ["/data"]
EXPOSE 5672 5671 8161
# Healthy: the AMQP listener accepts, or this is the backup of an HA pair (its listener
# stays closed until it takes over; the management API says so): amqpbroker/ha/health.py.
HEALTHCHECK --interval=5s --timeout=5s --start-period=5s --retries=5 \
    CMD ["python3", "-m", "amqpbroker.ha.health"]
ENTRYPOINT ["amqpbroker"]
CMD ["serve"]
