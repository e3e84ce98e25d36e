# Stand-in for redis:7.4-alpine, made from Debian's redis-server (bookworm: Redis 7.0) by
# deploy/standin/build.sh, configured as the official image is: the `redis` user (uid 999), /data as
# working directory and volume, port 6379, its entrypoint (deploy/standin/redis-entrypoint.sh: drops root,
# owns /data, umask 0077) and protected mode off by default (the official image compiles it off; here the
# entrypoint passes `--protected-mode no` unless a config file or the command line sets it).
ARG BASE=meshserve-standin/debian:bookworm-slim
FROM ${BASE}
RUN groupadd --system --gid 999 redis \
    && useradd --system --uid 999 --gid redis --home-dir /var/lib/redis --shell /usr/sbin/nologin redis \
    && printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d \
    && apt-get update \
    && apt-get install -y --no-install-recommends redis-server redis-tools \
    && rm -f /usr/sbin/policy-rc.d && rm -rf /var/lib/apt/lists/* \
    && mkdir /data && chown redis:redis /data
COPY redis-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
VOLUME /data
WORKDIR /data
EXPOSE 6379
LABEL org.meshserve.standin="redis:7.4-alpine from Debian bookworm's redis-server"
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["redis-server"]
