"""Checks the Dockerfile without building it (building pulls base images from a registry CI
cannot reach): parsed with the official BuildKit parser (the `dockerfile` package), it must be
multi-stage, copy the manifest of every workspace member (so the dependency layer builds), run
as a non-root user, and carry the workspace's version as its default version label.

    python dockerfile_check.py [DOCKERFILE]
"""

import sys
import tomllib

import dockerfile


def fail(message):
    sys.exit(f"dockerfile check: {message}")


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "Dockerfile"
    commands = dockerfile.parse_file(path)
    with open("Cargo.toml", "rb") as f:
        workspace = tomllib.load(f)["workspace"]
    stages = [i for i, c in enumerate(commands) if c.cmd == "FROM"]
    if len(stages) < 2:
        fail("expected a build stage and a runtime stage")
    build, runtime = commands[stages[0]:stages[-1]], commands[stages[-1]:]
    copied = {c.value[0] for c in build if c.cmd == "COPY"}
    for member in workspace["members"]:
        if f"{member}/Cargo.toml" not in copied:
            fail(f"the build stage does not copy {member}/Cargo.toml")
    users = [c.value[0] for c in runtime if c.cmd == "USER"]
    if not users or users[-1].split(":")[0] in ("0", "root"):
        fail("the runtime stage must run as a non-root USER")
    defaults = dict(c.value[0].split("=", 1) for c in runtime if c.cmd == "ARG" and "=" in c.value[0])
    labels = [c.value for c in runtime if c.cmd == "LABEL"]
    pairs = {v[i]: v[i + 1] for v in labels for i in range(0, len(v) - 1, 2)}
    if pairs.get("org.opencontainers.image.version") != '"${VERSION}"':
        fail("the runtime stage needs LABEL org.opencontainers.image.version=\"${VERSION}\"")
    if defaults.get("VERSION") != workspace["package"]["version"]:
        fail(f"ARG VERSION={defaults.get('VERSION')} is not the workspace version {workspace['package']['version']}")
    entry = [c.value for c in runtime if c.cmd == "ENTRYPOINT"]
    if not entry or not entry[-1][0].endswith("/onedoor"):
        fail("the runtime stage's ENTRYPOINT should be the onedoor binary")
    print(f"dockerfile check: {path}: {len(stages)} stages, user {users[-1]}, version {defaults['VERSION']}")


if __name__ == "__main__":
    main()
