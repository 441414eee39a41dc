"""The CUDA driver API as the experimental CUDA kernels use it (`cluster_gemm`): their shipped PTX
(`csrc/*.ptx`, made by `scripts/build_cuda_kernels.sh`) assembled for sm_90a by triton's bundled ptxas (cached by the
PTX's hash; the driver's JIT when there is no ptxas), loaded into torch's primary context, and launched with
`cuLaunchKernelEx` on torch's current stream — cluster dimensions and programmatic dependent launch are launch
attributes there, and a CUDA graph captures the launch like any kernel's."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class LaunchAttr(ctypes.Structure):
    """CUlaunchAttribute."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint32 * 16)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""

    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_mem_bytes", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(LaunchAttr)),
        ("num_attrs", ctypes.c_uint),
    ]


_LIB: ctypes.CDLL | None = None
_FUNCS: dict[tuple[int, str, str], ctypes.c_void_p] = {}  # (device, ptx path, function) -> CUfunction


def lib() -> ctypes.CDLL:
    global _LIB
    if _LIB is None:
        _LIB = ctypes.CDLL("libcuda.so.1")
    return _LIB


def check(status: int, what: str, who: str = "cuda") -> None:
    if status != 0:
        name = ctypes.c_char_p()
        lib().cuGetErrorName(status, ctypes.byref(name))
        raise RuntimeError(f"{who}: {what} failed: {name.value.decode() if name.value else status}")


def ptxas() -> str | None:
    try:
        import triton.backends.nvidia as nv

        p = Path(nv.__file__).parent / "bin" / "ptxas"
        if p.exists():
            return str(p)
    except ImportError:
        pass
    return shutil.which("ptxas")


def image(ptx_path: Path) -> bytes:
    """The kernels of a PTX file for sm_90a: a cubin assembled by ptxas (cached by the PTX's hash), or the PTX itself
    for the driver to compile when no ptxas is found."""
    ptx = ptx_path.read_bytes()
    exe = ptxas()
    if exe is None:
        return ptx + b"\0"
    cache = Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith")) / "cuda"
    cubin = cache / f"{ptx_path.stem}-{hashlib.sha256(ptx).hexdigest()[:16]}.cubin"
    if not cubin.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            out = Path(tmp) / "k.cubin"
            r = subprocess.run(
                [exe, "-arch=sm_90a", "-O3", str(ptx_path), "-o", str(out)], capture_output=True, text=True
            )
            if r.returncode != 0:
                raise RuntimeError(f"{ptx_path.stem}: ptxas failed on {ptx_path}: {r.stderr.strip().splitlines()[-1:]}")
            os.replace(out, cubin)  # atomic: a concurrent build writes the same bytes
    return cubin.read_bytes()


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def functions(device: torch.device, ptx_path: Path, smem: dict[str, int], who: str) -> dict[str, ctypes.c_void_p]:
    """The named kernels of a PTX file on `device`, each allowed `smem[name]` bytes of dynamic shared memory (loaded
    once a device and file)."""
    idx = device_index(device)
    keys = {name: (idx, str(ptx_path), name) for name in smem}
    if all(k in _FUNCS for k in keys.values()):
        return {name: _FUNCS[k] for name, k in keys.items()}
    cu = lib()
    torch.cuda.init()
    with torch.cuda.device(idx):
        torch.empty(1, device=device)  # the primary context current on this thread
        ctx = ctypes.c_void_p()
        check(cu.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent", who)
        if not ctx.value:
            dev = ctypes.c_int()
            check(cu.cuDeviceGet(ctypes.byref(dev), idx), "cuDeviceGet", who)
            check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain", who)
            check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent", who)
        mod = ctypes.c_void_p()
        check(cu.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(image(ptx_path))), "cuModuleLoadData", who)
        for name, nbytes in smem.items():
            f = ctypes.c_void_p()
            check(cu.cuModuleGetFunction(ctypes.byref(f), mod, name.encode()), f"cuModuleGetFunction({name})", who)
            check(
                cu.cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes),
                "cuFuncSetAttribute",
                who,
            )
            _FUNCS[keys[name]] = f
    return {name: _FUNCS[k] for name, k in keys.items()}


def launch_config(grid, block: int, smem: int, cluster: tuple[int, int, int], pdl: bool, stream=None):
    """A CUlaunchConfig (and the attributes it points to: keep both alive until the launch) for torch's current
    stream, or `stream` (0: none, for occupancy queries)."""
    attrs = (LaunchAttr * 2)()
    attrs[0].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attrs[0].value[0], attrs[0].value[1], attrs[0].value[2] = cluster
    attrs[1].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attrs[1].value[0] = 1 if pdl else 0
    cfg = LaunchConfig()
    cfg.grid[:] = tuple(grid)
    cfg.block[:] = (block, 1, 1)
    cfg.shared_mem_bytes = smem
    cfg.stream = stream
    cfg.attrs = attrs
    cfg.num_attrs = 2
    return cfg, attrs


def launch(fn, grid, block: int, smem: int, cluster, pdl: bool, args: list, device: torch.device, who: str) -> None:
    """fn<<<grid, block, smem>>>(*args) on torch's current stream of `device`, `cluster` CTAs a cluster, PDL on or
    off. `args`: ctypes values (passed by address, as cuLaunchKernelEx takes them), or an int: the address of a
    parameter's bytes already (a by-value struct such as a CUtensorMap)."""
    cfg, _attrs = launch_config(grid, block, smem, cluster, pdl, torch.cuda.current_stream(device).cuda_stream)
    params = (ctypes.c_void_p * len(args))(*[a if isinstance(a, int) else ctypes.addressof(a) for a in args])
    check(lib().cuLaunchKernelEx(ctypes.byref(cfg), fn, params, None), "cuLaunchKernelEx", who)
