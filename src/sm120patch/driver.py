"""What the CUDA driver says about this machine's GPUs, read by queries only: compute
capability, multicast support (``CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED``), the memory handle
types the fusion workspaces share buffers by, and peer-to-peer access between each pair.

Nothing here creates a context, allocates, or calls a ``cuMulticast*`` function, not even
``cuMulticastGetGranularity``: on a host whose GPUs are shared, a multicast call can take them out
of service, and a query answers the question as well. The driver is reached through ctypes
(``libcuda.so.1``, found the way the server's own process finds it), so this works from
sm120patch's interpreter whatever the serving environment holds."""

from __future__ import annotations

import ctypes
from types import MappingProxyType
from typing import Mapping, NamedTuple

LIBCUDA = "libcuda.so.1"
# cuda.h (CUDA 12.x and 13.0): CUdevice_attribute values.
ATTR_CC_MAJOR = 75
ATTR_CC_MINOR = 76
ATTR_POSIX_FD_HANDLES = 103  # CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
ATTR_FABRIC_HANDLES = 128  # CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED
ATTR_MULTICAST = 132  # CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED
CUDA_SUCCESS = 0
ERRORS = {34: "CUDA_ERROR_STUB_LIBRARY (the toolkit's stub, not a driver)", 100: "CUDA_ERROR_NO_DEVICE",
          999: "CUDA_ERROR_UNKNOWN", 3: "CUDA_ERROR_NOT_INITIALIZED", 35: "CUDA_ERROR_INSUFFICIENT_DRIVER"}


class Device(NamedTuple):
    index: int
    name: str
    capability: tuple[int, int]
    multicast: bool
    posix_fd_handles: bool
    fabric_handles: bool

    @property
    def sm(self) -> str:
        return f"{self.capability[0]}.{self.capability[1]}"


class DriverFacts(NamedTuple):
    """``devices`` empty and ``error`` set: no driver, or it answered no device."""

    devices: tuple[Device, ...] = ()
    peer_access: Mapping[tuple[int, int], bool] = MappingProxyType({})  # every ordered pair i != j
    version: int | None = None  # cuDriverGetVersion: 13000 for CUDA 13.0
    error: str | None = None
    # Where the driver answered nothing: the compute capabilities nvidia-smi reported (doctor
    # fills it in), so that the chain still knows which GPUs it is about.
    smi_capabilities: tuple[tuple[int, int], ...] = ()

    @property
    def capabilities(self) -> tuple[tuple[int, int], ...]:
        return tuple(d.capability for d in self.devices) or self.smi_capabilities

    @property
    def multicast(self) -> bool | None:
        """Whether every GPU reports multicast; None without a GPU."""
        return all(d.multicast for d in self.devices) if self.devices else None

    @property
    def peers_ok(self) -> bool | None:
        """Whether every pair of GPUs can reach each other's memory (what the IPC workspaces need)."""
        if len(self.devices) < 2:
            return None
        return all(self.peer_access.values())

    @property
    def version_text(self) -> str | None:
        return None if self.version is None else f"{self.version // 1000}.{self.version % 1000 // 10}"


def _error(code: int) -> str:
    return ERRORS.get(code, f"CUDA error {code}")


def query(library: str = LIBCUDA) -> DriverFacts:
    """Every GPU the driver sees, with what the fusion workspaces depend on. Never raises: a
    machine without a driver is a fact like any other."""
    try:
        cuda = ctypes.CDLL(library)
    except OSError:
        return DriverFacts(error=f"no CUDA driver ({library} not found)")
    try:
        if (rc := cuda.cuInit(0)) != CUDA_SUCCESS:
            return DriverFacts(error=f"the CUDA driver answered cuInit with {_error(rc)}")
        version = ctypes.c_int(0)
        driver_version = version.value if cuda.cuDriverGetVersion(ctypes.byref(version)) == CUDA_SUCCESS else None
        count = ctypes.c_int(0)
        if (rc := cuda.cuDeviceGetCount(ctypes.byref(count))) != CUDA_SUCCESS:
            return DriverFacts(version=driver_version, error=f"cuDeviceGetCount: {_error(rc)}")
        devices, handles = [], []
        for ordinal in range(count.value):
            handle = ctypes.c_int(0)
            if cuda.cuDeviceGet(ctypes.byref(handle), ordinal) != CUDA_SUCCESS:
                continue
            handles.append(handle.value)

            def attribute(attr: int) -> int:
                value = ctypes.c_int(0)
                return value.value if cuda.cuDeviceGetAttribute(ctypes.byref(value), attr, handle.value) == CUDA_SUCCESS else 0

            name = ctypes.create_string_buffer(256)
            cuda.cuDeviceGetName(name, 256, handle.value)
            devices.append(Device(ordinal, name.value.decode(errors="replace"),
                                  (attribute(ATTR_CC_MAJOR), attribute(ATTR_CC_MINOR)),
                                  multicast=attribute(ATTR_MULTICAST) == 1,
                                  posix_fd_handles=attribute(ATTR_POSIX_FD_HANDLES) == 1,
                                  fabric_handles=attribute(ATTR_FABRIC_HANDLES) == 1))
        peers = {}
        for i, a in enumerate(handles):
            for j, b in enumerate(handles):
                if i != j:
                    can = ctypes.c_int(0)
                    peers[(i, j)] = cuda.cuDeviceCanAccessPeer(ctypes.byref(can), a, b) == CUDA_SUCCESS and can.value == 1
        return DriverFacts(tuple(devices), peers, driver_version,
                           error=None if devices else "the CUDA driver sees no GPU")
    except AttributeError as exc:  # a library of that name without the driver API
        return DriverFacts(error=f"{library} is not a CUDA driver ({exc})")
