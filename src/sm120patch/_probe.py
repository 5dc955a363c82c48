# Runs inside the *target* interpreter (sm120patch never guesses paths): reports that
# interpreter's prefix and, for each distribution asked about, where it is installed, its
# version, and the RECORD rows of the files sm120patch cares about (not the whole RECORD:
# FlashInfer's has over 2,000 rows, and status only needs a handful).
#
# Standard library only; must run on every Python an inference server may use (3.8+). The
# distribution is found the way importlib.metadata finds it (first sys.path entry holding its
# .dist-info), but without importing importlib.metadata, which costs more than the rest of the
# probe together; importlib.metadata is the fallback for anything else (an .egg-info, a zip).
#
# argv[1]: JSON {"<name>": {"files": [relpath, ...], "suffixes": [suffix, ...]}, ...}
# Prints one JSON document on stdout.
import csv
import json
import os
import re
import sys

_DIST_INFO = re.compile(r"^(?P<name>.+)-(?P<version>[^-]+)\.dist-info$")
_OTHER_METADATA = re.compile(r"^(?P<name>[^-]+)(-.*)?\.egg-info$")


def normalize(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def headers(text):
    """The METADATA header fields sm120patch reads (RFC 822 style: they end at the first empty
    line; a line that starts with whitespace continues the previous field, e.g. a License)."""
    fields = {"Name": None, "Version": None, "Requires-Dist": []}
    for line in text.splitlines():
        if line == "":
            break
        if line[:1] in (" ", "\t"):
            continue
        key, _, value = line.partition(":")
        if key == "Requires-Dist":
            fields[key].append(value.strip())
        elif key in fields and fields[key] is None:
            fields[key] = value.strip()
    return fields


def read(path):
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError:
        return None


def find_dist_info(wanted, listings):
    """(site dir, .dist-info path); (None, None) when not installed; (None, "other") when only
    importlib.metadata can tell (an .egg-info, a zip on sys.path)."""
    other = False
    for entry in sys.path:
        entry = entry or os.getcwd()
        if entry not in listings:
            try:
                listings[entry] = os.listdir(entry) if os.path.isdir(entry) else None
            except OSError:
                listings[entry] = []
        if listings[entry] is None:  # a zip or egg file on sys.path
            other = other or os.path.isfile(entry)
            continue
        for name in listings[entry]:
            match = _DIST_INFO.match(name)
            if match and normalize(match.group("name")) == wanted:
                return entry, os.path.join(entry, name)
            match = _OTHER_METADATA.match(name)
            if match and normalize(match.group("name")) == wanted:
                other = True
    return None, ("other" if other else None)


def describe(wanted, want, listings):
    site, dist_info = find_dist_info(wanted, listings)
    if dist_info is None:  # not installed: no need for importlib.metadata (slow to import)
        return None
    if dist_info != "other":
        meta = headers(read(os.path.join(dist_info, "METADATA")) or "")
        record_text = read(os.path.join(dist_info, "RECORD"))
        direct_url = read(os.path.join(dist_info, "direct_url.json"))
        installer = read(os.path.join(dist_info, "INSTALLER"))
        name, version, requires = meta["Name"], meta["Version"], meta["Requires-Dist"]
    else:
        try:
            from importlib import metadata
        except ImportError:
            return None
        try:
            dist = metadata.distribution(wanted)
        except metadata.PackageNotFoundError:
            return None
        record_text, direct_url = dist.read_text("RECORD"), dist.read_text("direct_url.json")
        installer = dist.read_text("INSTALLER")
        name, version, requires = dist.metadata["Name"], dist.version, dist.requires or []
        site, dist_info = str(dist.locate_file("")), str(getattr(dist, "_path", ""))
    files, suffixes = set(want.get("files", ())), tuple(want.get("suffixes", ()))
    record = []
    if record_text:
        for row in csv.reader(record_text.splitlines()):
            if row and (row[0] in files or (suffixes and row[0].endswith(suffixes))):
                record.append((row + ["", ""])[:3])
    return {
        "name": name,
        "version": version,
        "site_dir": site,
        "dist_info": dist_info,
        "has_record": record_text is not None,
        "record": record,
        "direct_url": json.loads(direct_url) if direct_url else None,
        "requires": requires,
        "installer": installer.strip() if installer else None,
    }


def main():
    request = json.loads(sys.argv[1])
    listings = {}
    import site

    print(json.dumps({
        "executable": sys.executable,
        "python_version": "%d.%d.%d" % sys.version_info[:3],
        "prefix": sys.prefix,
        "user_base": getattr(site, "USER_BASE", None) or "",
        "distributions": {name: describe(normalize(name), want, listings) for name, want in request.items()},
    }))


main()
