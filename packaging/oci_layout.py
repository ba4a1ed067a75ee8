#!/usr/bin/env python3
"""Writes an OCI image layout (image-spec 1.1) from layer tars: scripts/package.sh's image.

Usage: oci_layout.py OUT VERSION EPOCH LAYER.tar...

OUT gets `oci-layout`, `index.json` (the image tagged VERSION) and `blobs/sha256/`: each layer
gzip-compressed without a time stamp, the image config, the manifest. Everything written is a
function of the inputs, so two runs over the same tars give the same digests. The config runs
`shepherd server` as user 65532 with the image's /etc/shepherd/server.toml, and carries a
health check (`shepherd tasks`, which exits 1 when a background task failed or is stale) that
Docker and Podman (in Docker format) run.
"""

import datetime
import gzip
import hashlib
import json
import os
import shutil
import sys


def write_blob(out, data):
    """Stores `data` under its digest; returns the descriptor fields."""
    digest = hashlib.sha256(data).hexdigest()
    with open(os.path.join(out, "blobs", "sha256", digest), "wb") as f:
        f.write(data)
    return {"digest": "sha256:" + digest, "size": len(data)}


def json_bytes(value):
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def main():
    out, version, epoch, layers = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(os.path.join(out, "blobs", "sha256"))
    created = datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc)
    created = created.strftime("%Y-%m-%dT%H:%M:%SZ")
    descriptors, diff_ids = [], []
    for path in layers:
        with open(path, "rb") as f:
            tar = f.read()
        diff_ids.append("sha256:" + hashlib.sha256(tar).hexdigest())
        blob = write_blob(out, gzip.compress(tar, compresslevel=9, mtime=0))
        descriptors.append(
            {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **blob}
        )
    labels = {
        "org.opencontainers.image.title": "shepherd",
        "org.opencontainers.image.description": "Shepherd bare-metal fleet manager: server and loops",
        "org.opencontainers.image.version": version,
        "org.opencontainers.image.licenses": "Apache-2.0",
        "org.opencontainers.image.created": created,
    }
    config = {
        "created": created,
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "User": "65532:65532",
            "Entrypoint": ["/usr/bin/shepherd"],
            "Cmd": ["server", "--config", "/etc/shepherd/server.toml"],
            "Env": [
                "PATH=/usr/bin:/bin",
                "SHEPHERD_LOG_FORMAT=json",
            ],
            "WorkingDir": "/var/lib/shepherd",
            "ExposedPorts": {"4443/tcp": {}},
            "Volumes": {"/var/lib/shepherd": {}},
            "StopSignal": "SIGTERM",
            "Labels": labels,
            "Healthcheck": {
                "Test": ["CMD", "/usr/bin/shepherd", "tasks", "--at", "http://127.0.0.1:9465"],
                "Interval": 30 * 10**9,
                "Timeout": 5 * 10**9,
                "StartPeriod": 30 * 10**9,
                "Retries": 3,
            },
        },
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
        "history": [{"created": created, "created_by": "scripts/package.sh"} for _ in layers],
    }
    config_blob = write_blob(out, json_bytes(config))
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **config_blob},
        "layers": descriptors,
        "annotations": labels,
    }
    manifest_blob = write_blob(out, json_bytes(manifest))
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                **manifest_blob,
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {"org.opencontainers.image.ref.name": version},
            }
        ],
    }
    with open(os.path.join(out, "index.json"), "wb") as f:
        f.write(json_bytes(index))
    with open(os.path.join(out, "oci-layout"), "wb") as f:
        f.write(json_bytes({"imageLayoutVersion": "1.0.0"}))
    compressed = sum(d["size"] for d in descriptors)
    print(f"oci_layout.py: {out}: {len(layers)} layers, {compressed} bytes compressed")


if __name__ == "__main__":
    main()
