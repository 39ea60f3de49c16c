# nvproxy as the front door of a compose deployment (compose.yml).
#
#   docker build -t nvproxy .
#
# The daemon runs as the unprivileged user "nvproxy" from the virtualenv
# /opt/nvproxy (the same path deploy/nvproxy.service uses), reads
# /etc/nvproxy/nvproxy.toml and keeps its state in /var/lib/nvproxy (a named
# volume in compose.yml).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN useradd --system --uid 10001 --user-group --no-create-home \
        --home-dir /var/lib/nvproxy --shell /usr/sbin/nologin nvproxy \
    && install -d -o nvproxy -g nvproxy -m 0750 /var/lib/nvproxy \
    && install -d -m 0755 /etc/nvproxy

COPY pyproject.toml README.rst /src/
COPY nvproxy /src/nvproxy
COPY twisted /src/twisted
RUN python -m venv /opt/nvproxy \
    && /opt/nvproxy/bin/pip install /src \
    && rm -rf /src

ENV PATH=/opt/nvproxy/bin:$PATH
USER nvproxy
WORKDIR /var/lib/nvproxy
EXPOSE 8000 8010

CMD ["twistd", "-n", "--pidfile=", "nvproxy", "--config", "/etc/nvproxy/nvproxy.toml"]
