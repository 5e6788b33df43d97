# syntax=docker/dockerfile:1

# Build stage: the release binary, with the versions pinned by Cargo.lock.
FROM rust:1.95-bookworm AS builder
WORKDIR /src
COPY . .
# The registry and target caches survive between builds; the binary is copied out of the
# cache mount so that the next stage can see it.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked \
    && cp target/release/bloomgate /usr/local/bin/bloomgate

# Runtime stage: Debian slim, curl for the health check, an unprivileged user.
FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates curl \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --no-create-home --shell /usr/sbin/nologin bloomgate
COPY --from=builder /usr/local/bin/bloomgate /usr/local/bin/bloomgate
COPY config.compose.toml /etc/bloomgate/config.toml
USER bloomgate
# 8080: data plane. 9090: admin plane (/metrics, /readyz, admin API).
EXPOSE 8080 9090
# Healthy once every filter is loaded; until then requests fail open and this check fails.
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD curl -fsS http://127.0.0.1:9090/readyz || exit 1
ENTRYPOINT ["bloomgate"]
CMD ["serve", "--config", "/etc/bloomgate/config.toml"]
