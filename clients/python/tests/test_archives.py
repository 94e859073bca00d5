"""Session archives through the client against the real daemon: a tar in, the workspace out,
a hostile one refused with the workspace unchanged; sync and async."""

from __future__ import annotations

import asyncio
import io
import tarfile
from pathlib import Path

import pytest
from conftest import Daemon

from executor_arm_client import (
    ArchiveUploaded,
    AsyncClient,
    InvalidRequestError,
)


def _tar(members: dict[str, bytes | str | None]) -> bytes:
    """A tar: bytes are a file, a str a symlink to it, None a directory."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, what in members.items():
            info = tarfile.TarInfo(name)
            if what is None:
                info.type = tarfile.DIRTYPE
                info.mode = 0o755
                tar.addfile(info)
            elif isinstance(what, str):
                info.type = tarfile.SYMTYPE
                info.linkname = what
                tar.addfile(info)
            else:
                info.size = len(what)
                tar.addfile(info, io.BytesIO(what))
    return buf.getvalue()


def _members(data: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for m in tar.getmembers():
            if m.isdir():
                out[m.name] = "dir"
            elif m.issym():
                out[m.name] = "-> " + m.linkname
            else:
                f = tar.extractfile(m)
                assert f is not None
                out[m.name] = f.read().decode()
    return out


def test_archives_in_and_out(daemon: Daemon, tmp_path: Path) -> None:
    with daemon.client() as c:
        info = c.sessions.create("python", ttl_seconds=600)
        try:
            tar = _tar({"src": None, "src/main.py": b"print('hi')", "src/link": "main.py"})
            done = c.sessions.upload_archive(info.id, tar, path="proj")
            assert isinstance(done, ArchiveUploaded)
            assert (done.path, done.members, done.bytes) == ("proj", 3, len(tar))
            assert done.sha256.startswith("sha256:")
            result = c.sessions.exec(info.id, "exec(open('proj/src/link').read())")
            assert result.stdout == "hi\n"
            out = c.sessions.download_archive(info.id, path="proj")
            assert isinstance(out, bytes)
            want = {"src": "dir", "src/link": "-> main.py", "src/main.py": "print('hi')"}
            assert _members(out) == want
            dest = tmp_path / "ws.tar"
            written = c.sessions.download_archive(info.id, dest=dest)
            assert written == dest.stat().st_size
            assert _members(dest.read_bytes())["proj/src/main.py"] == "print('hi')"
            # From a file, and a hostile one: refused, nothing changed.
            with open(dest, "rb") as f:
                c.sessions.upload_archive(info.id, f, path="copy")
            before = c.sessions.download_archive(info.id)
            with pytest.raises(InvalidRequestError):
                c.sessions.upload_archive(info.id, _tar({"ok": b"1", "../escape": b"x"}))
            with pytest.raises(InvalidRequestError):
                c.sessions.upload_archive(info.id, _tar({"out": "/etc", "out/passwd": b"x"}))
            assert c.sessions.download_archive(info.id) == before
        finally:
            c.sessions.delete(info.id)


def test_async_archives(daemon: Daemon) -> None:
    async def main() -> None:
        async with AsyncClient(
            daemon.url,
            service_token=daemon.service_token,
            capability_token=daemon.capability_token,
        ) as arm:
            info = await arm.sessions.create("python", ttl_seconds=600)
            try:
                done = await arm.sessions.upload_archive(info.id, _tar({"a.txt": b"A"}))
                assert done.members == 1
                out = await arm.sessions.download_archive(info.id)
                assert isinstance(out, bytes) and _members(out) == {"a.txt": "A"}
                sink = io.BytesIO()
                n = await arm.sessions.download_archive(info.id, dest=sink)
                assert n == len(sink.getvalue()) and _members(sink.getvalue()) == {"a.txt": "A"}
            finally:
                await arm.sessions.delete(info.id)

    asyncio.run(main())
