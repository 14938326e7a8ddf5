"""Native CPU kernels: C sources compiled on first use, loaded through ctypes.

They are an optional fast path. Every kernel has a plain-torch counterpart that gives the same
results, and the plain-torch path is used when there is no C compiler, when
``TANDEM_NATIVE_KERNELS=0`` is set, or when the tensors do not fit the kernel (for example not
float32, or not on the CPU).
"""

from cluster.engine.kernels.build import NativeKernelError, load_library, native_kernels_enabled

__all__ = ["NativeKernelError", "load_library", "native_kernels_enabled"]
