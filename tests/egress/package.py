#!/usr/bin/env python3
"""Lays out a tiny PEP 503 "simple" package index for the egress session tests: one pure-Python
wheel built here, and the index pages that name it. hosts.py serves the directory.

  package.py OUTDIR NAME VERSION VALUE

OUTDIR/simple/NAME/index.html links OUTDIR/files/NAME-VERSION-py3-none-any.whl (with its sha256),
whose NAME/__init__.py sets VALUE = "<VALUE>".
"""
import base64
import hashlib
import os
import sys
import zipfile

outdir, name, version, value = sys.argv[1:5]


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
