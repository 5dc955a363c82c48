# sm120patch tuned-limits (an opt-in patch: `sm120patch apply --with tuned-limits`; `sm120patch revert`
# removes it). On SM120 the server takes its fusion limits from the profile `sm120patch bench --tune`
# measured on this box (one-shot up to A bytes per rank, two-shot up to B, unfused beyond) instead of
# the limits upstream tuned on NVLink B200s. A profile never stops the server: without one, or with
# one that is unreadable, malformed, made on another box, for other releases or another TP size, the
# server decides exactly as it does with sm120patch's other patches, and says why in one log line.
# Standard library only, imported inside the functions; Python 3.8 syntax. Nothing here raises into
# the server, and what runs on every forward is a dict look-up: the decision is made once per
# process and kept.

_SM120PATCH_PROFILE_FORMAT = 1
_SM120PATCH_PROFILE_DEFAULT = "/etc/sm120patch/tuned-limits.json"
# The NCCL settings that change the unfused path's speed (and so where fusion stops winning).
# SGLang and vLLM set NCCL_CUMEM_ENABLE and NCCL_NVLS_ENABLE themselves: not part of the box.
_SM120PATCH_NCCL_KEYS = ("NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL", "NCCL_SHM_DISABLE", "NCCL_ALGO", "NCCL_PROTO",
                         "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "NCCL_BUFFSIZE", "NCCL_P2P_USE_CUDA_MEMCPY")
_SM120PATCH_ITEMSIZE = {"bf16": 2, "fp16": 2}
# FlashInfer's one-shot rule (comm/trtllm_ar.py _use_oneshot_heuristics, the same 0.6.4-0.7.4): one-shot
# while tokens * hidden * 2 * world * itemsize is at most this many MiB.
_SM120PATCH_ONESHOT_RULE_MIB = {2: 512, 4: 64, 8: 42}
_SM120PATCH_SEEN = {}  # TP size (SGLang) or "vllm" -> the limits in force, or None: decided once per process
_SM120PATCH_DEVICE = {}  # "sm120" -> whether this process's GPU is one, asked once
_SM120PATCH_TOKENS = {}  # SGLang: the release's cap -> the cap in force in this process (decided at first use)


def _sm120patch_profile_path():
    import os

    return os.environ.get("SM120PATCH_TUNED_LIMITS") or _SM120PATCH_PROFILE_DEFAULT


def _sm120patch_box(sys_root="/sys", proc_root="/proc"):
    """This machine's GPUs and the PCIe paths between them, read from sysfs and the NVIDIA driver's
    /proc files (no subprocess, no CUDA call: every rank reads the same, at any time). Each NVIDIA
    display or 3D controller: bus id, device id, model, NUMA node, the chain of PCIe bridges above
    it (what `nvidia-smi topo -m` summarises), the link's maximum speed and width."""
    import os

    def read(path):
        try:
            with open(path) as handle:
                return handle.read().strip()
        except OSError:
            return None

    models = {}
    gpus_dir = os.path.join(proc_root, "driver", "nvidia", "gpus")
    try:
        entries = sorted(os.listdir(gpus_dir))
    except OSError:
        entries = []
    for entry in entries:
        for line in (read(os.path.join(gpus_dir, entry, "information")) or "").splitlines():
            if line.startswith("Model:"):
                models[entry.lower()] = line.split(":", 1)[1].strip()
    devices_dir = os.path.join(sys_root, "bus", "pci", "devices")
    try:
        buses = sorted(os.listdir(devices_dir))
    except OSError:
        buses = []
    gpus = []
    root = os.path.realpath(os.path.join(sys_root, "devices"))
    for bus in buses:
        where = os.path.join(devices_dir, bus)
        if read(os.path.join(where, "vendor")) != "0x10de" or not (read(os.path.join(where, "class")) or "").startswith("0x03"):
            continue
        path = os.path.relpath(os.path.realpath(where), root)
        gpus.append({"bus_id": bus.lower(), "device": read(os.path.join(where, "device")),
                     "model": models.get(bus.lower()), "numa_node": read(os.path.join(where, "numa_node")),
                     "pcie_path": path, "max_link_speed": read(os.path.join(where, "max_link_speed")),
                     "max_link_width": read(os.path.join(where, "max_link_width"))})
    # "NVRM version: NVIDIA UNIX [Open ]Kernel Module [for ]x86_64  580.95.05  Release Build ...": the
    # first word of the first line that is a dotted number.
    first = (read(os.path.join(proc_root, "driver", "nvidia", "version")) or "").split("\n")[0]
    numbers = [w for w in first.split() if w.replace(".", "").isdigit() and "." in w]
    return {"gpus": gpus, "driver": numbers[0] if numbers else None}


def _sm120patch_nccl_env(environ=None):
    import os

    environ = os.environ if environ is None else environ
    return {key: environ[key] for key in _SM120PATCH_NCCL_KEYS if key in environ}


def _sm120patch_versions(names):
    """The installed release of each distribution named (None where it is not installed)."""
    try:
        from importlib import metadata
    except ImportError:  # Python < 3.8 has no importlib.metadata: no release can be checked
        return dict.fromkeys(names)
    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except Exception:  # noqa: BLE001 - not installed, or metadata unreadable
            found[name] = None
    return found


def _sm120patch_check_document(document):
    """'' when ``document`` is a profile this code can honour, else what is wrong with it."""
    if not isinstance(document, dict) or document.get("kind") != "sm120patch tuned limits":
        return "not an sm120patch tuned-limits profile"
    form = document.get("format")
    if not isinstance(form, int) or isinstance(form, bool):
        return "no format number"
    if form > _SM120PATCH_PROFILE_FORMAT:
        return "format %d, written by a newer sm120patch (this patch reads format %d)" % (form, _SM120PATCH_PROFILE_FORMAT)
    if form < 1 or not isinstance(document.get("box"), dict) or not isinstance(document.get("entries"), dict):
        return "no box or entries"
    for tp, entry in document["entries"].items():
        if not (isinstance(tp, str) and tp.isdigit() and isinstance(entry, dict)):
            return "entry %r is not a TP size" % (tp,)
        numbers = [entry.get(key) for key in ("oneshot_max_bytes", "fused_max_bytes", "hidden")]
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in numbers):
            return "TP%s: the limits are not whole numbers of bytes" % tp
        if numbers[0] > numbers[1] or numbers[2] == 0:
            return "TP%s: one-shot limit above the fused limit, or no hidden size" % tp
        if entry.get("dtype") not in _SM120PATCH_ITEMSIZE or not isinstance(entry.get("software"), dict):
            return "TP%s: no dtype or releases" % tp
    return ""


def _sm120patch_judge(document, world_size, box, nccl_env, versions):
    """(entry, '') when the profile holds for this box at this TP size, else (None, why not).
    ``versions``: the installed release of each distribution the entry names."""
    problem = _sm120patch_check_document(document)
    if problem:
        return None, "malformed profile: " + problem
    if document["box"] != box:
        return None, "made on another box (its GPUs, their PCIe paths or the driver differ)"
    entry = document["entries"].get(str(world_size))
    if entry is None:
        tuned = ", ".join("TP" + tp for tp in sorted(document["entries"], key=int)) or "none"
        return None, "no limits for TP%d (tuned: %s)" % (world_size, tuned)
    for name, version in sorted(entry["software"].items()):
        if versions.get(name) != version:
            return None, "tuned with %s %s, here %s" % (name, version, versions.get(name) or "not installed")
    if entry.get("nccl_env", {}) != nccl_env:
        return None, "tuned with NCCL settings %s, here %s" % (entry.get("nccl_env") or "none", nccl_env or "none")
    return entry, ""


def _sm120patch_untrusted(path, st):
    """'' when the file ``path`` (its status ``st``) and every directory above it can be written by
    no one but root and this process's user, else which one can (sshd's StrictModes rule: a
    profile a root-run server reads decides what runs on its GPUs). A directory others may write
    is accepted only with the sticky bit (/tmp): there no one else can rename what we own."""
    import os
    import stat

    trusted = (0, os.geteuid())
    if st.st_uid not in trusted or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "%s can be written by others than root and this server's user (owner uid %d, mode %o)" % (
            path, st.st_uid, stat.S_IMODE(st.st_mode))
    seen = set()
    for start in (os.path.dirname(os.path.abspath(path)), os.path.dirname(os.path.realpath(path))):
        where = start
        while where not in seen:
            seen.add(where)
            up = os.stat(where)
            loose = up.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not up.st_mode & stat.S_ISVTX
            if up.st_uid not in trusted or loose:
                return "its directory %s can be written by others than root and this server's user (owner uid %d, mode %o)" % (
                    where, up.st_uid, stat.S_IMODE(up.st_mode))
            where = os.path.dirname(where)
    return ""


def _sm120patch_load(path):
    """(document, '') or (None, why it cannot be read or is not to be trusted)."""
    import json
    import os
    import stat

    if not os.path.isabs(path):  # it would resolve against the server's working directory
        return None, "SM120PATCH_TUNED_LIMITS is a relative path (%s): give the profile's absolute path" % path
    try:
        # Non-blocking, then fstat on what was opened: a FIFO put there (or renamed over the
        # file between a check and an open) opens at once and is refused unread.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        return None, "no profile at %s" % path
    except OSError as exc:
        return None, "cannot read %s (%s)" % (path, exc.__class__.__name__)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, "cannot read %s (not a regular file)" % path
        untrusted = _sm120patch_untrusted(path, st)
        if untrusted:
            return None, "not trusted: " + untrusted
        chunks, left = [], 1 << 22
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return json.loads(b"".join(chunks).decode("utf-8")), ""
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested past the parser's depth
        return None, "cannot read %s (%s)" % (path, exc.__class__.__name__)
    finally:
        os.close(fd)


def _sm120patch_is_sm120():
    """Whether this process's GPU is an SM120 one (asked of torch once, then kept)."""
    if "sm120" not in _SM120PATCH_DEVICE:
        try:
            import torch

            _SM120PATCH_DEVICE["sm120"] = torch.cuda.get_device_capability()[0] == 12
        except Exception:  # noqa: BLE001 - no CUDA here: no tuned limits
            _SM120PATCH_DEVICE["sm120"] = False
    return _SM120PATCH_DEVICE["sm120"]


def _sm120patch_decide(world_size, check_device):
    """(entry, why): the profile's limits for ``world_size`` when they hold here, else None and
    why not. ``check_device``: ask torch whether this is an SM120 GPU (SGLang, at its first
    forward; vLLM's rows are SM120's own, read at import, before CUDA may be touched)."""
    if check_device and not _sm120patch_is_sm120():
        return None, "not an SM120 GPU"
    try:
        document, why = _sm120patch_load(_sm120patch_profile_path())
        if document is None:
            return None, why
        problem = _sm120patch_check_document(document)
        if problem:
            return None, "malformed profile: " + problem
        named = document["entries"].get(str(world_size), {})
        versions = _sm120patch_versions(sorted(str(n) for n in named.get("software", {})))
        return _sm120patch_judge(document, world_size, _sm120patch_box(), _sm120patch_nccl_env(), versions)
    except Exception as exc:  # noqa: BLE001 - a profile never stops the server
        return None, "the profile could not be judged (%s: %s)" % (exc.__class__.__name__, exc)


def _sm120patch_said(entry, why, world_size):
    """The one line the server logs about the profile."""
    if entry is None:
        return "sm120patch tuned limits not used (%s): the release's own fusion limits hold" % why
    return ("sm120patch tuned limits in force at TP%d: fused up to %d bytes, one-shot up to %d bytes (profile %s, tuned %s)"
            % (world_size, entry["fused_max_bytes"], entry["oneshot_max_bytes"], _sm120patch_profile_path(),
               entry.get("created", "at an unknown time")))


def _sm120patch_tuned_limits(world_size):
    """SGLang: the limits this process fuses by at ``world_size``, or None (the release's own rule).
    Decided once per process and TP size, with one log line either way."""
    if world_size not in _SM120PATCH_SEEN:
        import logging

        entry, why = _sm120patch_decide(world_size, True)
        logging.getLogger(__name__).info(_sm120patch_said(entry, why, world_size))
        _SM120PATCH_SEEN[world_size] = entry
    return _SM120PATCH_SEEN[world_size]


def _sm120patch_fused_max_tokens(release_max):
    """SGLang's fusion predicate: the largest batch (tokens) to fuse. On SM120, with a profile that
    holds for this server's TP size, the profile's fused limit in tokens of the served model's
    hidden size (``_sm120patch_sglang_served``, which each release's patch defines as that
    release reads it), never past the release's cap; else the release's cap. Decided at the first
    call (the server is set up by its first forward) and kept: every later call is a look-up."""
    limit = _SM120PATCH_TOKENS.get(release_max)
    if limit is None:
        limit = _SM120PATCH_TOKENS[release_max] = _sm120patch_first_cap(release_max)
    return limit


def _sm120patch_first_cap(release_max):
    """``_sm120patch_fused_max_tokens``'s decision, made once. Never raises: whatever goes wrong, the
    release's cap holds and the one log line says why."""
    import logging

    try:
        if not _sm120patch_is_sm120():  # another GPU: not ours to tune, and nothing to say
            return release_max
        fusing, world_size, hidden = _sm120patch_sglang_served()
        if not fusing:  # the server fuses nothing: no profile is read, no line is logged
            return release_max
        entry = _sm120patch_tuned_limits(world_size)
        if entry is None:
            return release_max
        if not (isinstance(hidden, int) and hidden > 0):
            raise ValueError("the served model's hidden size is not known (%r)" % (hidden,))
        return min(release_max, entry["fused_max_bytes"] // (hidden * _SM120PATCH_ITEMSIZE[entry["dtype"]]))
    except Exception as exc:  # noqa: BLE001 - a profile never stops the server
        # Stand down for the whole process, the fused call's one-shot choice too, so that the one
        # line logged stays true: the release decides everything.
        _SM120PATCH_DEVICE["sm120"] = False
        logging.getLogger(__name__).info(_sm120patch_said(
            None, "the profile could not be applied (%s: %s)" % (exc.__class__.__name__, exc), 0))
        return release_max


def _sm120patch_use_oneshot(use_oneshot, token_num, message_bytes, world_size):
    """SGLang: the fused call's one-shot choice. A caller's explicit choice stands; on SM120 with a
    profile that holds, the profile's one-shot limit on the real message (two-shot needs more
    tokens than ranks: FlashInfer asserts otherwise); else None, FlashInfer's rule."""
    if use_oneshot is not None or not _sm120patch_is_sm120():
        return use_oneshot
    try:
        entry = _sm120patch_tuned_limits(world_size)
        if entry is None or world_size not in _SM120PATCH_ONESHOT_RULE_MIB:
            return None
        # Never one-shot where FlashInfer's own rule would not: the workspace is sized by that rule.
        rule = message_bytes * 2 * world_size <= _SM120PATCH_ONESHOT_RULE_MIB[world_size] * 1024 * 1024
        return (message_bytes <= entry["oneshot_max_bytes"] and rule) or token_num <= world_size
    except Exception:  # noqa: BLE001 - a profile never stops the server: FlashInfer's rule decides
        return None


def _sm120patch_tuned_rows(fused_table, oneshot_table):
    """vLLM, at import: narrow the SM120 rows of its two fusion tables (max sizes in MB per world
    size) in place to what the profile measured on this box, TP size by TP size: each only ever
    shrinks, and a TP size where fusion never won (a fused limit of 0) leaves the fused row, so
    the pass stays off there. Without an SM120 row (no ``fusion-table``) there is nothing to
    narrow; without a profile that holds the rows stay as the other patches made them. One log
    line per process, naming the TP sizes it is in force at and why not at the others."""
    import logging

    if "vllm" in _SM120PATCH_SEEN:
        return
    _SM120PATCH_SEEN["vllm"] = {}
    try:
        line = _sm120patch_narrow(fused_table, oneshot_table)
    except Exception as exc:  # noqa: BLE001 - a profile never stops the server
        line = _sm120patch_said(None, "the profile could not be applied (%s: %s)" % (exc.__class__.__name__, exc), 0)
    logging.getLogger(__name__).info(line)


def _sm120patch_narrow(fused_table, oneshot_table):
    """``_sm120patch_tuned_rows``'s work; its one log line. The tables change only when all is judged."""
    fused, oneshot = fused_table.get(120), oneshot_table.get(120)
    if not isinstance(fused, dict) or not fused:
        return _sm120patch_said(None, "vLLM has no SM120 fusion row to narrow (`sm120patch apply --with fusion-table` "
                                      "adds one); the fusion pass stays off on SM120", 0)
    decided = {tp: _sm120patch_decide(tp, False) for tp in sorted(fused)}
    used = {tp: entry for tp, (entry, _) in decided.items() if entry is not None}
    if not used:
        return _sm120patch_said(None, "; ".join(sorted({why for _, why in decided.values()})), 0)
    mib = 1024.0 * 1024.0
    parts, new_fused, new_oneshot = [], {}, {}
    for tp, entry in sorted(used.items()):
        limit = min(fused[tp], entry["fused_max_bytes"] / mib)
        if limit <= 0:  # vLLM then leaves the pass off at this TP size (and says it is not supported)
            new_fused[tp] = None
            parts.append("at TP%d: fusion never won on this box, the fusion pass stays off" % tp)
            continue
        new_fused[tp] = limit
        one = limit
        if isinstance(oneshot, dict):
            one = new_oneshot[tp] = min(oneshot.get(tp, limit), entry["oneshot_max_bytes"] / mib, limit)
        parts.append("at TP%d: fused up to %d bytes, one-shot up to %d bytes" % (tp, int(limit * mib), int(one * mib)))
    # Everything judged and computed: only now do vLLM's tables change.
    for tp, limit in new_fused.items():
        if limit is None:
            del fused[tp]
        else:
            fused[tp] = limit
    if new_oneshot:
        oneshot.update(new_oneshot)
    _SM120PATCH_SEEN["vllm"] = used
    entry = next(iter(used.values()))
    line = "sm120patch tuned limits in force %s (profile %s, tuned %s)" % (
        "; ".join(parts), _sm120patch_profile_path(), entry.get("created", "at an unknown time"))
    others = ["TP%d (%s)" % (tp, why) for tp, (found, why) in sorted(decided.items()) if found is None]
    if others:
        line += "; not in force at " + ", ".join(others) + ": there the rows stay as they were"
    return line


def _sm120patch_oneshot_floor(use_oneshot, token_num, world_size, capability):
    """vLLM's fused call: its one-shot choice, except that on SM120 at a TP size the profile narrowed
    a batch of no more tokens than ranks is one-shot (FlashInfer's two-shot asserts more tokens
    than ranks; a tuned one-shot limit below TP x hidden x itemsize bytes would ask for it)."""
    narrowed = _SM120PATCH_SEEN.get("vllm", {})
    if use_oneshot is False and capability == 120 and token_num <= world_size and world_size in narrowed:
        return True
    return use_oneshot
