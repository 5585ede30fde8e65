# syntax=docker/dockerfile:1
# The onedoor image: the release binary on a distroless base (no shell, no package manager),
# running as an unprivileged user. Build from the repository root:
#
#   docker build -t onedoor:$(git describe --tags --always) --build-arg VERSION=$(git describe --tags --always) .
#
# Ports: 8080 (clients), 9090 (admin: /healthz, /readyz, /metrics, /admin/*). The config is read
# from /etc/onedoor/onedoor.yaml (ONEDOOR_CONFIG); see docs/deploy.md.

ARG RUST_VERSION=1.95

FROM rust:${RUST_VERSION}-bookworm AS build
WORKDIR /src
# The manifests first, with empty crates, so the dependencies build into a layer of their own
# that a change of onedoor's own code does not invalidate.
COPY Cargo.toml Cargo.lock ./
# Build settings (the bundled SQLite's flags) as the repository's own builds use them.
COPY .cargo .cargo
COPY crates/config/Cargo.toml crates/config/Cargo.toml
COPY crates/state/Cargo.toml crates/state/Cargo.toml
COPY crates/gateway/Cargo.toml crates/gateway/Cargo.toml
COPY crates/mock/Cargo.toml crates/mock/Cargo.toml
COPY crates/onedoor/Cargo.toml crates/onedoor/Cargo.toml
COPY crates/usage/Cargo.toml crates/usage/Cargo.toml
RUN for crate in config state gateway mock usage; do \
      mkdir -p crates/$crate/src && echo '' > crates/$crate/src/lib.rs; \
    done \
 && mkdir -p crates/onedoor/src && echo 'fn main() {}' > crates/onedoor/src/main.rs \
 && mkdir -p crates/gateway/benches && echo 'fn main() {}' > crates/gateway/benches/tokens.rs \
 && cargo build --locked --release -p onedoor
COPY crates crates
# COPY keeps the files' own times, which may be older than the placeholders' builds: touched,
# so cargo rebuilds onedoor's crates (and only them).
RUN find crates -name '*.rs' -exec touch {} + \
 && cargo build --locked --release -p onedoor \
 && install -D -m 0755 target/release/onedoor /out/onedoor \
 && mkdir -p /out/var/lib/onedoor

# Static glibc userland (libc, libgcc, ca-certificates, /etc/passwd with `nonroot`, uid 65532).
FROM gcr.io/distroless/cc-debian12:nonroot
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="onedoor" \
      org.opencontainers.image.description="One door to many model endpoints: an LLM gateway." \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /out/onedoor /usr/local/bin/onedoor
# The working directory holds the SQLite usage store and usage journals when the config says
# nothing else; mount a volume here (or set usage.journal_dir) to keep them across restarts.
COPY --from=build --chown=65532:65532 /out/var/lib/onedoor /var/lib/onedoor
WORKDIR /var/lib/onedoor
USER 65532:65532
ENV ONEDOOR_CONFIG=/etc/onedoor/onedoor.yaml
EXPOSE 8080 9090
# No HEALTHCHECK: the image has no shell or HTTP client to run one, and Kubernetes ignores it.
# Probe the admin port instead: liveness GET /healthz, readiness GET /readyz (503 while draining).
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/onedoor"]
CMD ["serve"]
