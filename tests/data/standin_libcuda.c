/* A stand-in CUDA driver for tests of sm120patch's device queries on machines without a GPU:
 * it answers the query functions as a PCIe SM120 box does (compile-time: NDEV GPUs of compute
 * capability CC_MAJOR.CC_MINOR, MULTICAST for CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED, PEER for
 * cuDeviceCanAccessPeer) and aborts the process if anything calls a cuMulticast* function, so a
 * test also proves that none is called. Built by the tests with the system C compiler. */
#include <stdlib.h>
#include <string.h>
#include <stdio.h>

typedef int CUresult;
typedef int CUdevice;
#define OK 0
#define NO_DEVICE 100
#define INVALID_DEVICE 101

int cuInit(unsigned int flags) { (void)flags; return NDEV > 0 ? OK : NO_DEVICE; }
int cuDriverGetVersion(int *v) { *v = 13000; return OK; }
int cuDeviceGetCount(int *n) { *n = NDEV; return OK; }
int cuDeviceGet(CUdevice *d, int ordinal) { if (ordinal >= NDEV) return INVALID_DEVICE; *d = ordinal; return OK; }
int cuDeviceGetName(char *name, int len, CUdevice d) { snprintf(name, len, "Stand-in SM120 GPU %d", d); return OK; }
int cuDeviceGetAttribute(int *pi, int attr, CUdevice d) {
    (void)d;
    switch (attr) {
    case 75: *pi = CC_MAJOR; return OK;
    case 76: *pi = CC_MINOR; return OK;
    case 103: *pi = 1; return OK;   /* POSIX fd handles */
    case 128: *pi = 0; return OK;   /* fabric handles: none on PCIe */
    case 132: *pi = MULTICAST; return OK;
    default: *pi = 0; return OK;
    }
}
int cuDeviceCanAccessPeer(int *can, CUdevice a, CUdevice b) { *can = (a != b) && PEER; return OK; }
#define FORBIDDEN(name) int name(void) { fprintf(stderr, "stand-in driver: " #name " called\n"); abort(); }
FORBIDDEN(cuMulticastCreate)
FORBIDDEN(cuMulticastGetGranularity)
FORBIDDEN(cuMulticastAddDevice)
FORBIDDEN(cuMulticastBindMem)
FORBIDDEN(cuMulticastBindAddr)
FORBIDDEN(cuMulticastUnbind)
