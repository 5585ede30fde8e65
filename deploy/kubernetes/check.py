"""Checks of a rendered set of manifests that the Kubernetes schemas do not make: the
ServiceMonitor (a CRD, without a bundled schema) against the part of the Prometheus Operator's
schema the manifests use; the pods' grace period against the config's shutdown settings; and,
given an onedoor binary, the config file itself with `onedoor validate` (its secrets replaced by
placeholder files).

    python check.py RENDERED.yaml WORKDIR [ONEDOOR_BIN]
    python check.py --assemble KUSTOMIZATION_DIR > ASSEMBLED.yaml

`--assemble` is for a machine without a kustomize: it writes the objects a kustomization's
`resources` and its components' list, and the ConfigMaps of its `configMapGenerator` (files and
literals; no hash suffix, patches, labels or replacements), so each can be checked on its own.
"""

import os
import re
import subprocess
import sys

import jsonschema
import yaml

# From the ServiceMonitor CRD (monitoring.coreos.com/v1), the fields these manifests write.
SERVICE_MONITOR = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {
                            "type": "object",
                            "additionalProperties": {"type": "string"},
                        }
                    },
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": {
                                "type": "string",
                                "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
                            },
                            "bearerTokenSecret": {
                                "type": "object",
                                "additionalProperties": False,
                                "required": ["key"],
                                "properties": {
                                    "name": {"type": "string"},
                                    "key": {"type": "string"},
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}

UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}


def seconds(text):
    match = re.fullmatch(r"(\d+)(ms|s|m|h)", str(text).strip())
    if not match:
        sys.exit(f"check: cannot read the duration {text!r}")
    return int(match.group(1)) * UNITS[match.group(2)]


def fail(message):
    sys.exit(f"check: {message}")


def main():
    rendered, workdir = sys.argv[1], sys.argv[2]
    binary = sys.argv[3] if len(sys.argv) > 3 else ""
    with open(rendered) as f:
        objects = [o for o in yaml.safe_load_all(f) if o]
    by_kind = {}
    for o in objects:
        by_kind.setdefault(o["kind"], []).append(o)
    for monitor in by_kind.get("ServiceMonitor", []):
        jsonschema.validate(monitor, SERVICE_MONITOR)
    configs = [c for c in by_kind.get("ConfigMap", []) if "onedoor.yaml" in c.get("data", {})]
    if len(configs) != 1 or len(by_kind.get("Deployment", [])) != 1:
        fail("expected one Deployment and one ConfigMap with onedoor.yaml")
    text = configs[0]["data"]["onedoor.yaml"]
    config = yaml.safe_load(text)
    shutdown = config.get("shutdown", {})
    drain = seconds(shutdown.get("drain_delay", "5s"))
    timeout = seconds(shutdown.get("timeout", "30s"))
    pod = by_kind["Deployment"][0]["spec"]["template"]["spec"]
    grace = pod.get("terminationGracePeriodSeconds", 30)
    # Close handshakes (5 s), the admin port (2 s) and the usage flush come after the timeout.
    if grace < drain + timeout + 10:
        fail(f"terminationGracePeriodSeconds {grace} < drain_delay {drain} + timeout {timeout} + 10")
    probes = pod["containers"][0]
    for probe, path in [("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")]:
        got = probes[probe]["httpGet"]
        if got["path"] != path or got["port"] != "admin":
            fail(f"{probe} should be GET {path} on the admin port, not {got}")
    if binary:
        validate(text, workdir, binary, by_kind)


def validate(text, workdir, binary, by_kind):
    """`onedoor validate` on the config, its secrets and environment made up."""
    secrets = os.path.join(workdir, "secrets")
    os.makedirs(secrets, exist_ok=True)
    for name in re.findall(r"file:/etc/onedoor/secrets/([\w.-]+)", text):
        with open(os.path.join(secrets, name), "w") as f:
            f.write(f"postgres://placeholder@127.0.0.1/{name}" if "postgres" in name else
                    f"redis://127.0.0.1:6379/0" if "redis" in name else "placeholder\n")
    path = os.path.join(workdir, "onedoor.yaml")
    with open(path, "w") as f:
        f.write(text.replace("/etc/onedoor/secrets/", secrets + "/"))
    env = dict(os.environ)
    for values in by_kind.get("ConfigMap", []):
        if "onedoor.yaml" not in values.get("data", {}):
            env.update(values.get("data", {}))
    result = subprocess.run([binary, "validate", "--config", path], env=env,
                            capture_output=True, text=True)
    if result.returncode != 0:
        fail(f"onedoor validate refused the config:\n{result.stdout}{result.stderr}")


def assemble(directory):
    """The objects of a kustomization without kustomize: resources, components' resources, and
    generated ConfigMaps (recursively through resource folders)."""
    with open(os.path.join(directory, "kustomization.yaml")) as f:
        kustomization = yaml.safe_load(f)
    objects = []
    for entry in kustomization.get("resources", []) + kustomization.get("components", []):
        path = os.path.join(directory, entry)
        if os.path.isdir(path):
            objects += assemble(path)
        else:
            with open(path) as f:
                objects += [o for o in yaml.safe_load_all(f) if o]
    for generator in kustomization.get("configMapGenerator", []):
        if generator.get("behavior") == "merge":
            continue
        data = dict(literal.split("=", 1) for literal in generator.get("literals", []))
        for name in generator.get("files", []):
            with open(os.path.join(directory, name)) as f:
                data[os.path.basename(name)] = f.read()
        objects.append({"apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": generator["name"]}, "data": data})
    return objects


if __name__ == "__main__":
    if sys.argv[1] == "--assemble":
        yaml.safe_dump_all(assemble(sys.argv[2]), sys.stdout, sort_keys=False)
    else:
        main()
