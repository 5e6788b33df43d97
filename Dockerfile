# syntax=docker/dockerfile:1

# Build stage: the release binary, with the versions pinned by Cargo.lock.
FROM rust:1.95-bookworm AS builder
WORKDIR /src
# The whole workspace: the bloomgate package at the root, crates/bloomgate-core beside
# it, and migrations/, which the core crate embeds.
COPY . .
# The registry and target caches survive between builds; the binary is stripped on its
# way out of the cache mount (its symbols and line tables stay in the build cache), so
# that the next stage can see it and the image carries the code only.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked \
    && strip --strip-all --output-file=/usr/local/bin/bloomgate target/release/bloomgate

# Runtime stage: Debian 12 slim at a point release, an unprivileged user, no
# configuration and no secret. The configuration is mounted at
# /etc/bloomgate/config.toml; the admin token comes from BLOOMGATE__ADMIN__TOKEN or a
# secret file named by BLOOMGATE__ADMIN__TOKEN_FILE (docs/deploy.md).
FROM debian:12.11-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 bloomgate \
    && useradd --system --uid 10001 --gid bloomgate --home-dir /var/lib/bloomgate \
        --no-create-home --shell /usr/sbin/nologin bloomgate \
    && install -d -o bloomgate -g bloomgate -m 0750 /var/lib/bloomgate \
    && install -d -m 0755 /etc/bloomgate
COPY --from=builder /usr/local/bin/bloomgate /usr/local/bin/bloomgate
COPY deploy/docker/healthcheck /usr/local/bin/bloomgate-healthcheck
# An example only, beside the path the mounted configuration takes.
COPY config.compose.toml /etc/bloomgate/config.example.toml
# By number, so that an orchestrator can tell it is not root without reading /etc/passwd.
USER 10001:10001
# Relative paths in the configuration (snapshot_path, the access log) land here, on a
# volume the unprivileged user owns: snapshots survive a new container.
WORKDIR /var/lib/bloomgate
VOLUME ["/var/lib/bloomgate"]
# 8080: data plane. 9090: admin plane (/metrics, /healthz, /readyz, admin API).
EXPOSE 8080 9090
# Healthy once every filter is loaded; until then requests fail open and this check
# fails. The check reads admin.listen from the mounted configuration (or
# BLOOMGATE__ADMIN__LISTEN), so it follows the admin plane wherever it listens.
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["bloomgate-healthcheck", "/etc/bloomgate/config.toml", "/readyz"]
ENTRYPOINT ["bloomgate"]
CMD ["serve", "--config", "/etc/bloomgate/config.toml"]
