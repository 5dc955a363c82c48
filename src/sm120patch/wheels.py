"""Real upstream wheels: fetched (``pip download --no-deps``) into a cache shared by the
manifest builder, the demo and the tests, and read (a file, with the hash the wheel's own
RECORD gives it)."""

from __future__ import annotations

import io
import os
import stat
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator


from sm120patch.environment import parse_record_hash
from sm120patch.errors import PatchDataError, Sm120PatchError
from sm120patch.fileio import KINDS
from sm120patch.progress import say

if TYPE_CHECKING:
    import zipfile

    from packaging.version import Version


def _utils():
    """packaging.utils, imported when a wheel is first looked at: it imports packaging.tags
    (about 9 ms), which `status` never needs."""
    import packaging.utils

    return packaging.utils


def default_cache() -> Path:
    override = os.environ.get("SM120PATCH_WHEEL_CACHE")
    if override:
        return Path(override)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "sm120patch" / "wheels"


def cached_wheel(distribution: str, version: str, cache: Path) -> Path | None:
    for path in sorted(cache.glob("*.whl")):
        try:
            name, wheel_version, _, _ = _utils().parse_wheel_filename(path.name)
        except ValueError:
            continue
        if name == _utils().canonicalize_name(distribution) and str(wheel_version) == version:
            return path
    return None


def find_wheel(distribution: str, version: str, wheel_dir: Path | None = None, *, download: bool = False) -> Path | None:
    """The release's wheel from ``wheel_dir`` (an offline server's copy), else from the cache,
    else (``download``) fetched into the cache; None when it cannot be had."""
    for directory in ([wheel_dir] if wheel_dir else []) + [default_cache()]:
        if directory.is_dir():
            found = cached_wheel(distribution, version, directory)
            if found:
                return found
    if not download:
        return None
    try:
        return fetch_wheel(distribution, version)
    except Sm120PatchError:
        return None


def fetch_wheel(distribution: str, version: str, cache: Path | None = None) -> Path:
    """The wheel of ``distribution==version``, downloaded once into ``cache``."""
    cache = cache or default_cache()
    found = cached_wheel(distribution, version, cache)
    if found:
        return found
    cache.mkdir(parents=True, exist_ok=True)
    import shutil
    import tempfile

    # Into a directory of its own, then renamed into the cache: a second run (or test worker)
    # fetching the same release never sees a half-written wheel, and a killed one leaves none.
    staging = Path(tempfile.mkdtemp(prefix=".download-", dir=cache))

    say(f"downloading the {distribution} {version} wheel from the package index into {cache} (once) ...")
    started = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
             "--dest", str(staging), f"{distribution}=={version}"],
            capture_output=True,
            text=True,
        )
        downloaded = cached_wheel(distribution, version, staging)
        if downloaded is not None:
            os.replace(downloaded, cache / downloaded.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    found = cached_wheel(distribution, version, cache)
    if proc.returncode != 0 or not found:
        detail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise Sm120PatchError(f"could not download {distribution}=={version}: {detail}")
    say(f"downloaded {found.name} ({found.stat().st_size / 1e6:.1f} MB in {time.monotonic() - started:.0f} s)")
    return found


# The most sm120patch reads of one member of a wheel, decompressed: a RECORD, a METADATA, a file a
# patch set names. The largest of these in any release read so far is under 1 MiB (FlashInfer
# 0.7.0's RECORD); a member over this is no release's, and read whole it could be a zip bomb (a
# few MB that inflate to gigabytes: a MemoryError, or the machine's memory).
MEMBER_LIMIT = 64 << 20


def read_member(archive: zipfile.ZipFile, name: str) -> bytes:
    """Member ``name`` of a wheel (KeyError where it has none), read in chunks: refused in one
    line when its declared size is over :data:`MEMBER_LIMIT`, or when it inflates to more than
    it declares (a forged header), before more than that is held in memory."""
    info = archive.getinfo(name)
    wheel = archive.filename
    if info.file_size > MEMBER_LIMIT:
        raise PatchDataError(f"{wheel}: {name} inflates to {info.file_size:,} bytes ({info.compress_size:,} in the "
                             f"archive), more than the {MEMBER_LIMIT >> 20} MiB sm120patch reads of one file: not a "
                             "release's wheel", hint="use the release's own wheel (`pip download --no-deps` of it)")
    chunks, size = [], 0
    with archive.open(info) as member:
        while chunk := member.read(1 << 20):
            size += len(chunk)
            if size > info.file_size:
                raise PatchDataError(f"{wheel}: {name} inflates to more than the {info.file_size:,} bytes its header "
                                     "declares: a damaged or forged wheel",
                                     hint="use the release's own wheel (`pip download --no-deps` of it)")
            chunks.append(chunk)
    return b"".join(chunks)


def wheel_file(wheel: Path, relpath: str) -> tuple[bytes, str | None]:
    """One file of a wheel and the hash the wheel's own RECORD gives it."""
    archive, record = read_wheel(wheel)
    with archive, damaged(wheel):
        try:
            return read_member(archive, relpath), record.get(relpath)
        except KeyError:
            raise PatchDataError(f"{wheel.name} has no {relpath}") from None


@contextmanager
def damaged(wheel: Path) -> Iterator[None]:
    """A truncated or corrupt wheel (a cut download, a damaged copy), found when it is opened or
    when a member is read (a bad CRC, a broken deflate stream): one line, never a traceback."""
    import zipfile
    import zlib

    try:
        yield
    except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
        raise PatchDataError(f"{wheel}: not a readable wheel ({exc or type(exc).__name__}): truncated or damaged",
                             hint="download it again (`pip download --no-deps` of that release)") from None


def read_wheel(wheel: Path) -> tuple[zipfile.ZipFile, dict[str, str | None]]:
    import zipfile

    try:
        mode = os.stat(wheel).st_mode
    except OSError as exc:
        raise PatchDataError(f"{wheel}: {exc.strerror}") from None
    if not stat.S_ISREG(mode):  # a FIFO would block the read forever; a wheel is a regular (zip) file
        raise PatchDataError(f"{wheel} is {KINDS.get(stat.S_IFMT(mode), 'not a regular file')}, not a wheel file")
    with damaged(wheel):
        archive = zipfile.ZipFile(wheel)
        try:
            records = [n for n in archive.namelist() if n.endswith(".dist-info/RECORD") and n.count("/") == 1]
            if len(records) != 1:
                raise PatchDataError(f"{wheel.name}: expected one .dist-info/RECORD, found {len(records)}")
            import csv  # here: status imports this module and never reads a wheel

            rows = csv.reader(io.StringIO(read_member(archive, records[0]).decode("utf-8", errors="replace")))
            return archive, {row[0]: parse_record_hash(row[1]) if len(row) > 1 and row[1] else None
                             for row in rows if row}
        except BaseException:
            archive.close()
            raise


def release_of(archive: zipfile.ZipFile, wheel: Path) -> tuple[str, Version]:
    """The distribution and release a wheel's own METADATA names (Name:, Version:): what its
    bytes are, whatever its file is called."""
    from email.parser import HeaderParser

    from packaging.version import InvalidVersion, Version

    dist_info = next(n.split("/")[0] for n in archive.namelist() if n.endswith(".dist-info/RECORD") and n.count("/") == 1)
    with damaged(wheel):
        try:
            text = read_member(archive, f"{dist_info}/METADATA").decode("utf-8", errors="replace")
        except KeyError:
            raise PatchDataError(f"{wheel.name} has no {dist_info}/METADATA") from None
    headers = HeaderParser().parsestr(text, headersonly=True)
    name, raw = headers.get("Name"), headers.get("Version")
    if not name or not raw:
        raise PatchDataError(f"{wheel.name}: {dist_info}/METADATA has no {'Name' if not name else 'Version'}: field")
    try:
        return _utils().canonicalize_name(name), Version(raw.strip())
    except InvalidVersion:
        raise PatchDataError(f"{wheel.name}: {dist_info}/METADATA has Version: {raw.strip()!r}, not a version") from None


def check_release(archive: zipfile.ZipFile, wheel: Path) -> tuple[str, Version]:
    """The wheel's release from its METADATA, refused when its file name says another one (a
    wheel renamed to a release it is not: a manifest would pin that release to other bytes)."""
    name, version = release_of(archive, wheel)
    try:
        named, named_version, _, _ = _utils().parse_wheel_filename(wheel.name)
    except ValueError:
        raise PatchDataError(f"{wheel.name}: not a wheel file name (name-version-tags.whl)") from None
    if (named, named_version) != (name, version):
        raise PatchDataError(f"{wheel}: its METADATA says {name} {version}, its file name {named} {named_version}: "
                             "a renamed wheel is not that release",
                             hint=f"use the wheel of {named} {named_version} itself")
    return name, version
