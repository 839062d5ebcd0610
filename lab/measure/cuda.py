"""What an NVIDIA GPU's driver reports that JAX's device object does not: the L2 cache and the
shared memory of one streaming multiprocessor, read through the CUDA driver API
(`cuDeviceGetAttribute` in libcuda, which every machine with an NVIDIA driver has).
Anything that cannot be read (no driver, another vendor, a call that fails) is left out."""

import ctypes

# CUdevice_attribute values, from cuda.h
ATTRIBUTES = {
    "l2_bytes": 38,  # CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE
    "shared_memory_per_sm_bytes": 81,  # CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR
    "sm_count": 16,  # CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
}


def _driver():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def driver_attributes(ordinal: int = 0, lib=None) -> dict[str, int]:
    """{name: value} of ATTRIBUTES for the GPU of this CUDA `ordinal` (the order the process
    sees its GPUs in, as JAX numbers them); {} where the driver is absent or refuses."""
    lib = lib if lib is not None else _driver()
    if lib is None:
        return {}
    try:
        if lib.cuInit(0) != 0:
            return {}
        dev = ctypes.c_int()
        if lib.cuDeviceGet(ctypes.byref(dev), int(ordinal)) != 0:
            return {}
        out = {}
        for name, attr in ATTRIBUTES.items():
            value = ctypes.c_int()
            if lib.cuDeviceGetAttribute(ctypes.byref(value), attr, dev) == 0 and value.value > 0:
                out[name] = int(value.value)
        return out
    except (AttributeError, OSError, ctypes.ArgumentError):
        return {}
