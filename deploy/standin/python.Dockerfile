# Stand-in for python:3.11-slim-bookworm, made from Debian's packages alone (deploy/standin/build.sh):
# Debian bookworm's Python 3.11 (cp311, like the official image's) with pip, `python` and `pip` on PATH,
# and pip allowed to install into the system Python (into /usr/local, as in the official image).
ARG BASE=meshserve-standin/debian:bookworm-slim
FROM ${BASE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3-pip python3-venv python-is-python3 \
    && rm -f /usr/lib/python3.11/EXTERNALLY-MANAGED \
    && ln -sf pip3 /usr/bin/pip \
    && rm -rf /var/lib/apt/lists/*
ENV LANG=C.UTF-8 \
    PYTHON_VERSION=3.11
LABEL org.meshserve.standin="python:3.11-slim-bookworm from Debian bookworm's python3.11"
CMD ["python3"]
