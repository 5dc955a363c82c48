# Runs inside the *target* interpreter (sm120patch never guesses paths): reports that
# interpreter's prefix and, for each distribution asked about, where it is installed (its
# .dist-info), its version, pins and installer. sm120patch reads the RECORD rows it needs
# from that .dist-info itself: the probe needs only the names, so it starts before the patch
# data is read and is done by the time the rest of sm120patch is imported.
#
# Standard library only; must run on every Python an inference server may use (3.8+). The
# distribution is found the way importlib.metadata finds it (first sys.path entry holding its
# .dist-info), but without importing importlib.metadata, which costs more than the rest of the
# probe together; importlib.metadata is the fallback for anything else (an .egg-info, a zip).
# Nor does it import json or re (each would double the probe's time, most of it on the path
# of `status`): the answer is a Python literal (repr), which sm120patch reads with
# ast.literal_eval, and names are matched with str methods.
#
# argv[1:]: the distribution names. Answers one Python literal (a dict): answer() says where.
import os
import sys


def normalize(name):
    """PEP 503: every run of -, _ and . is one -, lowercase."""
    name = name.lower().replace("_", "-").replace(".", "-")
    while "--" in name:
        name = name.replace("--", "-")
    return name


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
        # A byte that is not UTF-8 (a hand-edited METADATA) must not cost the whole answer.
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except OSError:
        return None


def metadata_name(entry):
    """(normalized name, kind) of a directory entry that is distribution metadata:
    ``<name>-<version>.dist-info`` or ``<name>[-...].egg-info``; (None, None) otherwise."""
    if entry.endswith(".dist-info"):
        name, dash, version = entry[:-len(".dist-info")].rpartition("-")
        if dash and name and version:
            return normalize(name), "dist-info"
    elif entry.endswith(".egg-info"):
        name = entry[:-len(".egg-info")].partition("-")[0]
        if name:
            return normalize(name), "egg-info"
    return None, None


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
            found, kind = metadata_name(name)
            if found == wanted:
                if kind == "dist-info":
                    return entry, os.path.join(entry, name)
                other = True
    return None, ("other" if other else None)


def describe(wanted, listings):
    site, dist_info = find_dist_info(wanted, listings)
    if dist_info is None:  # not installed: no need for importlib.metadata (slow to import)
        return None
    if dist_info != "other":
        meta = headers(read(os.path.join(dist_info, "METADATA")) or "")
        fallback = {}  # sm120patch reads RECORD from dist_info itself
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
        # No .dist-info directory sm120patch could read: ship RECORD's text (rare: a zip, an egg).
        fallback = {"record_text": dist.read_text("RECORD")}
        direct_url = dist.read_text("direct_url.json")
        installer = dist.read_text("INSTALLER")
        name, version, requires = dist.metadata["Name"], dist.version, list(dist.requires or [])
        site, dist_info = str(dist.locate_file("")), str(getattr(dist, "_path", ""))
    return dict(fallback, **{
        "name": name,
        "version": version,
        "site_dir": site,
        "dist_info": dist_info,
        "direct_url": direct_url,  # JSON text; sm120patch parses it
        "requires": requires,
        "installer": installer.strip() if installer else None,
    })


# The answer is framed, on a pipe of its own (its descriptor in SM120PATCH_PROBE_FD): whatever
# else the interpreter prints (a .pth's banner, a wrapper script's messages) goes to stdout and
# is not read, and sm120patch stops reading at the end mark, whoever else holds the pipe open
# (a wrapper's background job). Run by hand, without the variable, it prints to stdout.
BEGIN, END = "\x1esm120patch-answer\n", "\n\x1esm120patch-end\n"


def answer(text):
    fd = os.environ.get("SM120PATCH_PROBE_FD")
    if not fd:
        print(text)
        return
    data = (BEGIN + text + END).encode("utf-8", "surrogateescape")
    fd = int(fd)
    while data:
        data = data[os.write(fd, data):]
    os.close(fd)


def main():
    listings = {}
    import site

    answer(repr({
        "executable": sys.executable,
        "python_version": "%d.%d.%d" % sys.version_info[:3],
        "prefix": sys.prefix,
        "base_prefix": getattr(sys, "base_prefix", sys.prefix),
        "user_base": getattr(site, "USER_BASE", None) or "",
        "distributions": {name: describe(normalize(name), listings) for name in sys.argv[1:]},
        # where sm120patch's state of an install that is gone can be (its install location)
        "path": [entry for entry in sys.path if entry and os.path.isdir(entry)],
    }))


main()
