#!/usr/bin/env python3
"""Lays out a tiny PEP 503 "simple" package index for the egress session tests: one pure-Python
wheel built here, and the index pages that name it; with REGISTRY also a tiny npm registry of one
package. hosts.py serves the directory.

  package.py OUTDIR NAME VERSION VALUE [REGISTRY]

OUTDIR/simple/NAME/index.html links OUTDIR/files/NAME-VERSION-py3-none-any.whl (with its sha256),
whose NAME/__init__.py sets VALUE = "<VALUE>".

REGISTRY is the registry's URL as npm is given it (ending in /npm/): OUTDIR/npm/NAME/index.html is
the package's document (JSON, whatever its file name) naming REGISTRY/NAME/-/NAME-VERSION.tgz with
its sha1 and sha512, a tarball whose index.js exports VALUE.
"""
import base64
import gzip
import hashlib
import io
import json
import os
import sys
import tarfile
import zipfile

outdir, name, version, value = sys.argv[1:5]
registry = sys.argv[5] if len(sys.argv) > 5 else None


def digest(data):
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


dist = f"{name}-{version}.dist-info"
files = {
    f"{name}/__init__.py": f'VALUE = "{value}"\n'.encode(),
    f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
    f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: executor-arm-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
record = "".join(f"{path},{digest(data)},{len(data)}\n" for path, data in files.items())
record += f"{dist}/RECORD,,\n"
files[f"{dist}/RECORD"] = record.encode()

wheel = f"{name}-{version}-py3-none-any.whl"
os.makedirs(f"{outdir}/files", exist_ok=True)
os.makedirs(f"{outdir}/simple/{name}", exist_ok=True)
with zipfile.ZipFile(f"{outdir}/files/{wheel}", "w", zipfile.ZIP_DEFLATED) as z:
    for path, data in files.items():
        z.writestr(path, data)
with open(f"{outdir}/files/{wheel}", "rb") as f:
    sha = hashlib.sha256(f.read()).hexdigest()
with open(f"{outdir}/simple/index.html", "w") as f:
    f.write(f'<!DOCTYPE html><html><body><a href="{name}/">{name}</a></body></html>\n')
with open(f"{outdir}/simple/{name}/index.html", "w") as f:
    f.write(
        f'<!DOCTYPE html><html><body><a href="../../files/{wheel}#sha256={sha}">{wheel}</a></body></html>\n'
    )

if registry:
    tgz = io.BytesIO()
    with gzip.GzipFile(fileobj=tgz, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as t:
        for path, data in {
            "package/package.json": json.dumps({"name": name, "version": version, "main": "index.js"}).encode(),
            "package/index.js": f"exports.VALUE = {json.dumps(value)};\n".encode(),
        }.items():
            info = tarfile.TarInfo(path)
            info.size, info.mode = len(data), 0o644
            t.addfile(info, io.BytesIO(data))
    data = tgz.getvalue()
    tarball = f"{name}-{version}.tgz"
    os.makedirs(f"{outdir}/npm/{name}/-", exist_ok=True)
    with open(f"{outdir}/npm/{name}/-/{tarball}", "wb") as f:
        f.write(data)
    integrity = "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()
    doc = {
        "name": name,
        "dist-tags": {"latest": version},
        "versions": {
            version: {
                "name": name,
                "version": version,
                "main": "index.js",
                "dist": {
                    "tarball": f"{registry}{name}/-/{tarball}",
                    "shasum": hashlib.sha1(data).hexdigest(),
                    "integrity": integrity,
                },
            }
        },
    }
    with open(f"{outdir}/npm/{name}/index.html", "w") as f:
        json.dump(doc, f)
