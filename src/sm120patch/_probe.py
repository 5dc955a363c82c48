# Runs inside the *target* interpreter (sm120patch never guesses paths): reports that
# interpreter's prefix and, for each distribution name in argv, what importlib.metadata
# says about it. Standard library only; must run on every Python an inference server may
# use (3.8+). Prints one JSON document on stdout.
import csv
import io
import json
import site
import sys

try:
    from importlib import metadata
except ImportError:  # pragma: no cover - Python < 3.8
    print(json.dumps({"error": "Python %s is too old (3.8+ needed)" % sys.version.split()[0]}))
    sys.exit(0)


def describe(name):
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None
    record_text = dist.read_text("RECORD")
    record = []
    if record_text:
        for row in csv.reader(io.StringIO(record_text)):
            if row:
                record.append((row + ["", ""])[:3])
    direct_url = dist.read_text("direct_url.json")
    return {
        "name": dist.metadata["Name"],
        "version": dist.version,
        "location": str(dist.locate_file("")),
        "metadata_dir": str(getattr(dist, "_path", "")),
        "record": record,
        "direct_url": json.loads(direct_url) if direct_url else None,
        "requires": dist.requires or [],
    }


print(
    json.dumps(
        {
            "executable": sys.executable,
            "python_version": "%d.%d.%d" % sys.version_info[:3],
            "prefix": sys.prefix,
            "user_base": getattr(site, "USER_BASE", None) or "",
            "distributions": {name: describe(name) for name in sys.argv[1:]},
        }
    )
)
