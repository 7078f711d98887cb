"""TVM's runtime without its compiler, for the TVM backend: the FFI (``tvm_ffi``) and
``libtvm_runtime`` (module loading, the Relax VM, the CPU thread pool).

``import tvm`` imports the compiler's whole Python side (Relax, TIR, TVMScript, the backends)
and costs seconds before any work; an llvm artifact needs none of it. GPU artifacts still
import it (:func:`device`): its backends load the device runtime library
(``libtvm_runtime_cuda.so`` for sm90; an sm90 library holds sm_90a machine code, which that
runtime hands to the CUDA driver as it is).

``tvm_ffi`` imports torch and ml_dtypes when they are installed, only to map their dtype
objects, and they take most of its import time (bench/RESULTS.md). The runtime uses neither, so
unless the process imported them before, they are hidden while ``tvm_ffi`` loads. What that
costs a process that imports them later: tvm_ffi takes no torch or ml_dtypes dtype object as a
dtype (``tvm_ffi.dtype(torch.float32)``, ``numpy.dtype(ml_dtypes.bfloat16)`` as a function
argument) and skips its torch DLPack fast path; torch tensors still pass to TVM through DLPack,
dtypes by name ("bfloat16") still work, and ``tvm.runtime.Tensor.numpy()`` still returns
ml_dtypes arrays.
"""

from __future__ import annotations

import ctypes
import importlib.util
import sys
from pathlib import Path

import numpy as np


def _import_ffi():
    hidden = [name for name in ("torch", "ml_dtypes") if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # `import name` raises ImportError, which tvm_ffi takes as "not installed"
    try:
        import tvm_ffi
    finally:
        for name in hidden:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]
    return tvm_ffi


tvm_ffi = sys.modules.get("tvm_ffi") or _import_ffi()
# What the artifact library and the VM need registered (RTLD_GLOBAL: the library links against
# it); `import tvm` loads the same file first where the compiler is in use.
_TVM_PACKAGE = importlib.util.find_spec("tvm")
tvm_ffi.libinfo.load_lib_ctypes("tvm", "tvm_runtime", "RTLD_GLOBAL",
                                extra_lib_paths=[Path(_TVM_PACKAGE.submodule_search_locations[0]) / "lib"])

CPU = tvm_ffi.device("cpu", 0)
POOLED_ALLOCATOR = 2  # the VM's allocator kinds: 1 naive, 2 pooled (tvm.runtime.vm.VirtualMachine)
_alloc = tvm_ffi.get_global_func("runtime.TVMTensorAllocWithScope")
_copy = tvm_ffi.get_global_func("runtime.TVMTensorCopyFromTo")
_copy_to_bytes = tvm_ffi.get_global_func("runtime.TVMTensorCopyToBytes")
Shape = tvm_ffi.Shape


def device(info):
    """This host's device for target ``info``, or None; a GPU's through ``import tvm``
    (targets.TargetInfo.device, and see above)."""
    return CPU if info.kind == "cpu" else info.device()


def on_host(dev) -> bool:
    return dev.dlpack_device_type() == CPU.dlpack_device_type()


def load_vm(library: Path, dev):
    """The Relax VM over the artifact's compiled library, its allocators pooled on ``dev``
    and, for a GPU, on the CPU too (the VM runs shape computations there)."""
    vm = tvm_ffi.load_module(str(library))["vm_load_executable"]()
    devices = [dev] if on_host(dev) else [dev, CPU]
    vm["vm_initialization"](*(v for d in devices for v in (d.dlpack_device_type(), d.index, POOLED_ALLOCATOR)))
    return vm


_clear_pools = tvm_ffi.get_global_func("vm.builtin.memory_manager.clear")
_libc = ctypes.CDLL(None)


def release_cached_memory() -> None:
    """Give back what the VMs' pooled allocators keep for reuse: the pools keep every freed
    buffer for a later one of the same (page-rounded) size, so steps of ever new shapes (prompt
    lengths, contexts) grow them without bound; and glibc keeps the freed pages in its heap
    unless asked to return them (``malloc_trim``; other C libraries lack it and keep theirs).
    Buffers in use (the weights, the pool, the streams kept for the next draft) are not touched;
    the next step allocates its buffers afresh (bench/RESULTS.md: the soak's RSS)."""
    _clear_pools()
    trim = getattr(_libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


def from_numpy(a: np.ndarray):
    """A C-contiguous, 64-byte aligned host array as a CPU tensor, zero-copy. The versioned
    capsule: numpy exports read-only (mapped) arrays only through it."""
    return tvm_ffi.from_dlpack(a.__dlpack__(max_version=(1, 0)), require_alignment=64, require_contiguous=True)


def to_device(a: np.ndarray, dev):
    """A copy of host array ``a`` (read-only ones included) on device ``dev``."""
    a = np.ascontiguousarray(a)
    out = _alloc(Shape(a.shape), tvm_ffi.dtype(str(a.dtype)), dev, None)
    _copy(tvm_ffi.from_dlpack(a.__dlpack__(max_version=(1, 0))), out)
    return out


def to_numpy(tensor) -> np.ndarray:
    """A host copy of a tensor of a numpy dtype, on any device."""
    out = np.empty(tuple(tensor.shape), np.dtype(str(tensor.dtype)))
    _copy_to_bytes(tensor, out.ctypes.data_as(ctypes.c_void_p), out.nbytes)
    return out
