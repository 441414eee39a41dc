"""cuBLASLt through ctypes: few-row GEMMs `out[M, N] = x[M, K] @ w[N, K]^T` (bf16/fp16 in and out, fp32 accumulate)
with an algorithm chosen by timing cuBLASLt's candidates instead of taking its heuristic's first pick.

Why: on the 8B verify (M = 49) cuBLAS's pick for q/k/v and o reaches only ~0.7 of copy bandwidth (96 and 64 tiles on
132 SMs); `torch.nn.functional.linear` exposes one algorithm per shape and torch's TunableOp has no cuBLASLt backend
on CUDA. cuBLASLt's heuristic returns a ranked list (other tiles, split-K with an in-kernel or separate reduction,
other cluster shapes); this module lists them (`LtLinear`), runs any of them, and `tune_lt` times each over a
forward's matrices. Matmul calls are stream-ordered and use a workspace allocated once per device, so they are
captured into CUDA graphs like any kernel. Measured on the 8B shapes at 49 rows (BENCHMARKS.md, "cuBLASLt's other
algorithms"): the faster bit-equal candidates are worth ~0.13 ms a verify; q/k/v and o have none much better.
`LtLinear.search` goes past the heuristic's list: any configuration cuBLASLt's algorithms support (tile, split-K,
cluster shape, stages, custom option) that `cublasLtMatmulAlgoCheck` accepts, for `bench/lt_gemm.py --search`.

The library is the one torch already loaded (found in /proc/self/maps after a first matmul), so both share one
cuBLASLt instance. Layout (column-major, as cuBLASLt sees row-major tensors): A = w as K x N (ld = w.stride(0)),
op(A) = T; B = x as K x M; D = out as N x M (leading dimensions K, K, N: contiguous tensors). Status codes other than 0
raise with the call's name.
"""

from __future__ import annotations

import ctypes
import os
import random
from dataclasses import dataclass

import torch

# the tuners' timing: best us a call of one CUDA graph replayed (None where a launch fails)
from draftsmith.decode.kernels import _time_graph

_COMPUTE_32F = 68  # cublasComputeType_t CUBLAS_COMPUTE_32F
_R_32F, _R_16F, _R_16BF = 0, 2, 14  # cudaDataType_t
_DESC_TRANSA, _DESC_TRANSB = 3, 4  # cublasLtMatmulDescAttributes_t
_OP_N, _OP_T = 0, 1
_PREF_MAX_WORKSPACE_BYTES = 1  # cublasLtMatmulPreferenceAttributes_t
# cublasLtMatmulAlgoConfigAttributes_t: uint32 values, but inner shape and cluster shape are uint16 (the report reads
# each size first; `search_algos` sets them)
_CONFIG_ATTRS = {
    "id": 0,
    "tile": 1,
    "splitk": 2,
    "reduction": 3,
    "swizzle": 4,
    "custom": 5,
    "stages": 6,
    "inner": 7,
    "cluster": 8,
}
_CONFIG_U16 = {"inner", "cluster"}
# cublasLtMatmulAlgoCapAttributes_t
_CAP_SPLITK_SUPPORT, _CAP_REDUCTION_MASK, _CAP_SWIZZLING, _CAP_TILE_IDS, _CAP_CUSTOM_MAX, _CAP_STAGES_IDS = (
    0,
    1,
    2,
    6,
    7,
    13,
)


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [
        ("algo", _Algo),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves_count", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


_LIB: ctypes.CDLL | None = None
_HANDLE: ctypes.c_void_p | None = None


def _library_path() -> str:
    """libcublasLt as torch mapped it (one matmul first so that torch has loaded it)."""
    a = torch.zeros(8, 8, device="cuda", dtype=torch.bfloat16)
    torch.nn.functional.linear(a, a)
    torch.cuda.synchronize()
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1]
            if "libcublasLt" in os.path.basename(path):
                return path
    raise RuntimeError("cublaslt: torch has not loaded libcublasLt (no matmul backend on this device?)")


def _lib() -> ctypes.CDLL:
    global _LIB, _HANDLE
    if _LIB is None:
        lib = ctypes.CDLL(_library_path())
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        for name, args in {
            "cublasLtCreate": [ctypes.POINTER(vp)],
            "cublasLtMatmulDescCreate": [ctypes.POINTER(vp), ctypes.c_int, ctypes.c_int],
            "cublasLtMatmulDescSetAttribute": [vp, ctypes.c_int, vp, sz],
            "cublasLtMatrixLayoutCreate": [
                ctypes.POINTER(vp),
                ctypes.c_int,
                ctypes.c_uint64,
                ctypes.c_uint64,
                ctypes.c_int64,
            ],
            "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(vp)],
            "cublasLtMatmulPreferenceSetAttribute": [vp, ctypes.c_int, vp, sz],
            "cublasLtMatmulAlgoGetHeuristic": [
                vp,
                vp,
                vp,
                vp,
                vp,
                vp,
                vp,
                ctypes.c_int,
                ctypes.POINTER(_Heuristic),
                ctypes.POINTER(ctypes.c_int),
            ],
            "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, ctypes.POINTER(_Algo), vp, sz, vp],
            "cublasLtMatmulAlgoConfigGetAttribute": [ctypes.POINTER(_Algo), ctypes.c_int, vp, sz, ctypes.POINTER(sz)],
            "cublasLtMatmulAlgoConfigSetAttribute": [ctypes.POINTER(_Algo), ctypes.c_int, vp, sz],
            "cublasLtMatmulAlgoCapGetAttribute": [ctypes.POINTER(_Algo), ctypes.c_int, vp, sz, ctypes.POINTER(sz)],
            "cublasLtMatmulAlgoCheck": [vp, vp, vp, vp, vp, vp, ctypes.POINTER(_Algo), ctypes.POINTER(_Heuristic)],
        }.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        handle = vp()
        _check(lib.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
        _LIB, _HANDLE = lib, handle
    return _LIB


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cublaslt: {what} returned status {status}")


_WORKSPACES: dict[tuple, torch.Tensor] = {}


def _workspace(nbytes: int) -> torch.Tensor:
    """One cuBLASLt workspace per device and size, shared by every descriptor (calls on one stream are serial)."""
    key = (torch.cuda.current_device(), nbytes)
    if key not in _WORKSPACES:
        _WORKSPACES[key] = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return _WORKSPACES[key]


def _dtype_code(dtype: torch.dtype) -> int:
    codes = {torch.bfloat16: _R_16BF, torch.float16: _R_16F, torch.float32: _R_32F}
    if dtype not in codes:
        raise ValueError(f"cublaslt: unsupported dtype {dtype}")
    return codes[dtype]


@dataclass(frozen=True)
class AlgoInfo:
    index: int  # rank in the heuristic's list (then the searched ones, `LtLinear.search`)
    workspace: int
    waves: float
    config: dict
    searched: bool = False

    def label(self) -> str:
        c = self.config
        extra = "".join(f" {k}{c[k]}" for k in ("reduction", "custom", "cluster", "swizzle") if c.get(k))
        return (
            f"#{self.index}{'s' if self.searched else ''} id{c.get('id')} tile{c.get('tile')} sk{c.get('splitk')} "
            f"st{c.get('stages')}{extra} w{self.waves:.2f}"
        )


class LtLinear:
    """`out = x @ w^T` for one shape (M, N, K) and dtype, contiguous x, w and out; `algos`: cuBLASLt's heuristic's
    candidates (up to `max_algos`, ranked), any of which `__call__` runs by index."""

    def __init__(
        self,
        m: int,
        n: int,
        k: int,
        dtype: torch.dtype = torch.bfloat16,
        *,
        workspace_bytes: int = 32 << 20,
        max_algos: int = 64,
    ):
        lib = _lib()
        self.m, self.n, self.k, self.dtype = m, n, k, dtype
        code = _dtype_code(dtype)
        vp = ctypes.c_void_p
        self._desc = vp()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self._desc), _COMPUTE_32F, _R_32F), "MatmulDescCreate")
        for attr, val in ((_DESC_TRANSA, _OP_T), (_DESC_TRANSB, _OP_N)):
            v = ctypes.c_int32(val)
            _check(lib.cublasLtMatmulDescSetAttribute(self._desc, attr, ctypes.byref(v), 4), "MatmulDescSetAttribute")
        self._a, self._b, self._d = vp(), vp(), vp()
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self._a), code, k, n, k), "MatrixLayoutCreate(A)")
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self._b), code, k, m, k), "MatrixLayoutCreate(B)")
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self._d), code, n, m, n), "MatrixLayoutCreate(D)")
        pref = vp()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "MatmulPreferenceCreate")
        ws = ctypes.c_uint64(workspace_bytes)
        _check(
            lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), 8),
            "MatmulPreferenceSetAttribute",
        )
        results = (_Heuristic * max_algos)()
        count = ctypes.c_int(0)
        _check(
            lib.cublasLtMatmulAlgoGetHeuristic(
                _HANDLE, self._desc, self._a, self._b, self._d, self._d, pref, max_algos, results, ctypes.byref(count)
            ),
            "MatmulAlgoGetHeuristic",
        )
        self._algos = [results[i].algo for i in range(count.value) if results[i].state == 0]
        self.algos = [
            AlgoInfo(i, results[i].workspace_size, results[i].waves_count, _config(lib, results[i].algo))
            for i in range(count.value)
            if results[i].state == 0
        ]
        if not self._algos:
            raise RuntimeError(f"cublaslt: no algorithm for M={m} N={n} K={k} {dtype}")
        self.n_heuristic = len(self._algos)
        self.workspace_bytes = workspace_bytes
        self.workspace = _workspace(workspace_bytes)
        self._alpha, self._beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def __call__(
        self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, algo: int = 0
    ) -> torch.Tensor:
        if out is None:
            out = torch.empty(self.m, self.n, dtype=self.dtype, device=x.device)
        _check(
            _lib().cublasLtMatmul(
                _HANDLE,
                self._desc,
                ctypes.byref(self._alpha),
                w.data_ptr(),
                self._a,
                x.data_ptr(),
                self._b,
                ctypes.byref(self._beta),
                out.data_ptr(),
                self._d,
                out.data_ptr(),
                self._d,
                ctypes.byref(self._algos[algo]),
                self.workspace.data_ptr(),
                self.workspace.numel(),
                torch.cuda.current_stream().cuda_stream,
            ),
            "Matmul",
        )
        return out

    def search(self, splits=(1, 2, 3, 4, 6, 8), clusters=range(0, 64), budget: int = 200_000) -> int:
        """Append to `algos` the valid configurations near the heuristic's candidates that it did not list: for the
        first candidate of each algorithm id, every (tile, split-K with each reduction scheme, cluster shape) the
        algorithm supports, its stages and custom option kept, in a fixed shuffled order (a budget samples them
        evenly, and every run lists the same); then, for every candidate, each single change of its stages, custom
        option or CTA swizzle. Validity is `cublasLtMatmulAlgoCheck`'s, its workspace within ours. At most `budget`
        checks (`search_checks` counts them), three quarters of them for the products. Returns how many were added.
        `bench/lt_gemm.py --search` times them; `tune_lt(search=True)` (KernelConfig.lt_search) takes the bit-equal
        ones as candidates."""
        lib = _lib()
        seen = {bytes(a) for a in self._algos}
        found: list[tuple[_Algo, _Heuristic]] = []
        checks = 0

        def check(algo: _Algo) -> None:
            nonlocal checks
            checks += 1
            key = bytes(algo)
            if key in seen:
                return
            seen.add(key)
            res = _Heuristic()
            st = lib.cublasLtMatmulAlgoCheck(
                _HANDLE, self._desc, self._a, self._b, self._d, self._d, ctypes.byref(algo), ctypes.byref(res)
            )
            if st == 0 and res.state == 0 and res.workspace_size <= self.workspace_bytes:
                found.append((_Algo.from_buffer_copy(algo), res))

        ids_done = set()
        for seed in list(self._algos):
            caps, cfg = _caps(lib, seed), _config(lib, seed)
            if cfg.get("id") not in ids_done:
                ids_done.add(cfg.get("id"))
                schemes = [(1, 0)] + [
                    (k, r) for k in splits if k > 1 and caps["splitk"] for r in (1, 2, 4) if caps["reductions"] & r
                ]
                combos = [
                    (t, k, r, c) for t in caps["tiles"] or [cfg.get("tile", 0)] for k, r in schemes for c in clusters
                ]
                # a budget smaller than the product samples all of it evenly (a fixed seed: the same list each run)
                random.Random(0).shuffle(combos)
                for tile, k, red, cl in combos:
                    if checks >= budget * 3 // 4:  # (a quarter kept for the single changes below)
                        break
                    a = _Algo.from_buffer_copy(seed)
                    if all(_set(lib, a, n, v) for n, v in (("tile", tile), ("splitk", k), ("reduction", red),
                                                             ("cluster", cl))):  # fmt: skip
                        check(a)
            singles = [("stages", v) for v in caps["stages"]]
            singles += [("custom", v) for v in range(min(caps["custom_max"], 255) + 1)]
            singles += [("swizzle", 1 - cfg.get("swizzle", 0))] if caps["swizzling"] else []
            for name, value in singles:
                a = _Algo.from_buffer_copy(seed)
                if checks < budget and _set(lib, a, name, value):
                    check(a)
        base = len(self._algos)
        for i, (algo, res) in enumerate(found):
            self._algos.append(algo)
            self.algos.append(AlgoInfo(base + i, res.workspace_size, res.waves_count, _config(lib, algo), True))
        self.search_checks = checks
        return len(found)


def _set(lib: ctypes.CDLL, algo: _Algo, name: str, value: int) -> bool:
    """Set one config attribute (uint16 or uint32 as cuBLASLt declares it); False where cuBLASLt refuses it."""
    buf = ctypes.c_uint16(value) if name in _CONFIG_U16 else ctypes.c_uint32(value)
    return (
        lib.cublasLtMatmulAlgoConfigSetAttribute(
            ctypes.byref(algo), _CONFIG_ATTRS[name], ctypes.byref(buf), ctypes.sizeof(buf)
        )
        == 0
    )


def _cap_array(lib: ctypes.CDLL, algo: _Algo, attr: int) -> list[int]:
    """A uint32-array capability (tiles, stages): its size first, then the values."""
    size = ctypes.c_size_t(0)
    if lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, None, 0, ctypes.byref(size)) != 0:
        return []
    count = size.value // 4
    if count == 0:
        return []
    buf, written = (ctypes.c_uint32 * count)(), ctypes.c_size_t(0)
    if lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, buf, size.value, ctypes.byref(written)) != 0:
        return []
    return [int(v) for v in buf[: written.value // 4]]


def _cap_int(lib: ctypes.CDLL, algo: _Algo, attr: int) -> int:
    buf, written = ctypes.c_uint32(0), ctypes.c_size_t(0)
    if lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, ctypes.byref(buf), 4, ctypes.byref(written)):
        return 0
    return int(buf.value)


def _caps(lib: ctypes.CDLL, algo: _Algo) -> dict:
    return {
        "tiles": _cap_array(lib, algo, _CAP_TILE_IDS),
        "stages": _cap_array(lib, algo, _CAP_STAGES_IDS),
        "splitk": _cap_int(lib, algo, _CAP_SPLITK_SUPPORT),
        "reductions": _cap_int(lib, algo, _CAP_REDUCTION_MASK),
        "swizzling": _cap_int(lib, algo, _CAP_SWIZZLING),
        "custom_max": _cap_int(lib, algo, _CAP_CUSTOM_MAX),
    }


def _config(lib: ctypes.CDLL, algo: _Algo) -> dict:
    """The algorithm's config attributes (asked for their size first: a mismatched size is an error)."""
    out = {}
    for name, attr in _CONFIG_ATTRS.items():
        size = ctypes.c_size_t(0)
        if lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, None, 0, ctypes.byref(size)) != 0:
            continue
        buf, written = ctypes.c_uint64(0), ctypes.c_size_t(0)
        if (
            0 < size.value <= 8
            and lib.cublasLtMatmulAlgoConfigGetAttribute(
                ctypes.byref(algo), attr, ctypes.byref(buf), size.value, ctypes.byref(written)
            )
            == 0
        ):
            out[name] = int(buf.value)
    return out


# ---------------------------------------------------------------- the verify's matmuls through tuned algorithms
# One descriptor set per (M, N, K, dtype, device), built on first use: the heuristic's list for a shape is the same
# within a process, so an algorithm is named by its index in it (`KernelConfig.lt_tuned` holds the index).
_DESCRIPTORS: dict[tuple, LtLinear] = {}


# With `search`, the heuristic's list then the searched configurations (`LtLinear.search` at TUNE_SEARCH_BUDGET
# checks: the same list in every process with the same library, so an index still names one configuration).
TUNE_SEARCH_BUDGET = 20_000


def lt_for(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, search: bool = False) -> LtLinear:
    key = (m, n, k, dtype, device.index, bool(search))
    if key not in _DESCRIPTORS:
        with torch.cuda.device(device):
            lt = LtLinear(m, n, k, dtype)
            if search:
                lt.search(budget=TUNE_SEARCH_BUDGET)
            _DESCRIPTORS[key] = lt
    return _DESCRIPTORS[key]


def _contiguous_2d(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(1) == 1 and t.stride(0) == t.shape[1]


@torch.library.custom_op("draftsmith::lt_linear", mutates_args=())
def lt_linear(x: torch.Tensor, w: torch.Tensor, algo: int, search: bool = False) -> torch.Tensor:
    """F.linear(x, w) (no bias) through cuBLASLt's algorithm `algo` for x's shape (`tune_lt` chose it among those
    whose output equals F.linear's bit for bit; with `search`, an index into the searched list); F.linear itself
    for strided inputs."""
    if not (_contiguous_2d(x) and _contiguous_2d(w)):
        return torch.nn.functional.linear(x, w)
    return lt_for(x.shape[0], w.shape[0], w.shape[1], x.dtype, x.device, search)(x, w, algo=algo)


@lt_linear.register_fake
def _(x, w, algo, search=False):
    return x.new_empty(x.shape[0], w.shape[0])


def tune_lt(
    kinds: dict[str, list[torch.Tensor]], widths, min_gain: float = 0.01, search: bool = False, max_timed: int = 200
) -> list[dict]:
    """For each width M and weight kind (its matrices, one per layer: timed in turn, so each call reads its weights
    from HBM as a forward does), time F.linear and every cuBLASLt candidate whose output on a random x equals
    F.linear's bit for bit (the verify must compute what the torch path computes; split-K candidates, which sum in
    another order, are not). With `search`, the candidates include `LtLinear.search`'s configurations (at most
    `max_timed` bit-equal ones timed, spread over the list). Returns one row per (M, kind): `algo` the fastest
    candidate's index when it beats F.linear by `min_gain` or more, else None (the torch path keeps F.linear)."""
    rows = []
    for m in sorted(set(int(w) for w in widths)):
        for kind, mats in kinds.items():
            w0 = mats[0]
            n, k = w0.shape
            x = torch.randn(m, k, device=w0.device, dtype=w0.dtype)
            out = torch.empty(m, n, device=w0.device, dtype=w0.dtype)
            ref = torch.nn.functional.linear(x, w0)

            def run_torch():
                for w in mats:
                    torch.mm(x, w.t(), out=out)

            t_torch, _ = _time_graph(run_torch, len(mats), 10)
            lt = lt_for(m, n, k, w0.dtype, w0.device, search)
            best, best_us, equal = None, float("inf"), []
            for i in range(len(lt.algos)):
                try:
                    if torch.equal(lt(x, w0, algo=i), ref):
                        equal.append(i)
                except RuntimeError:
                    continue
            same = len(equal)
            for i in equal[:: max(1, -(-same // max_timed))]:

                def run_lt(i=i):
                    for w in mats:
                        lt(x, w, out, algo=i)

                us, _ = _time_graph(run_lt, len(mats), 10)
                if us is not None and us < best_us:
                    best, best_us = i, us
            if best is None or best_us > t_torch * (1 - min_gain):  # not enough faster: F.linear stays
                best, best_us = None, t_torch
            rows.append({"rows": m, "kind": kind, "n": n, "k": k, "torch_us": round(t_torch, 2),
                         "algo": best, "us": round(best_us, 2), "candidates": len(lt.algos), "bit_equal": same,
                         "label": lt.algos[best].label() if best is not None else "F.linear"})  # fmt: skip
    return rows
