"""Silent-data-corruption check: seeded matmuls on every datapath, hashed on the device.

Runs in the diagnostics child process (it imports torch). For each device and each case
(datapath × shape) it generates the inputs on the device from a seed, multiplies, hashes the output
in one pass (``hashing.digest``) and keeps only the 16-hex-digit digest. The digests are then judged
against the golden store, against the other devices (majority vote) and, for suspects, against
re-runs on the same device (``compare.py`` holds that pure logic).

``inject`` flips bits in the output before hashing (self-test): single bit, the same bit in two
words (the pair a weighted sum can miss), a whole 32-bit word, a whole 16×16 warp tile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import importlib.metadata
import platform
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gpuhealth.diag import hashing
from gpuhealth.diag.compare import (
    Basis,
    CaseInfo,
    DeviceRef,
    Persistence,
    classify,
    find_suspects,
    golden_disagreement_finding,
    majority,
    self_inconsistency_finding,
    suspect_finding,
)
from gpuhealth.diag.golden import GoldenStore, key_id
from gpuhealth.model import Finding

HASH_VERSION = "fmix32-sum-xor-v1"
# Bump when the shapes, the input generation or the matmul call change: goldens of an older case
# definition must not be compared with (the key would otherwise match and every GPU would "fail").
CASES_VERSION = "2"
DEFAULT_SEED = 20261126


class Datapath(enum.StrEnum):
    BF16 = "bf16"
    FP16 = "fp16"
    TF32 = "tf32"
    FP32 = "fp32"
    FP64 = "fp64"
    FP8 = "fp8_e4m3"


class FaultKind(enum.StrEnum):
    SINGLE_BIT = "single_bit"
    PAIRED_BITS = "paired_bits"  # the same bit in two different words
    WORD = "word"  # all 32 bits of one word
    WARP_TILE = "warp_tile"  # every element of a 16×16 output tile


@dataclass(frozen=True, slots=True)
class Case:
    datapath: Datapath
    shape: str  # "square" or "large_k"
    m: int
    n: int
    k: int

    @property
    def case_id(self) -> str:
        return f"{self.datapath.value}/{self.shape}/{self.m}x{self.n}x{self.k}"

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k

    def info(self) -> CaseInfo:
        return CaseInfo(self.case_id, self.datapath.value, self.shape, (self.m, self.n, self.k))


# Shapes are the same at every level so that golden digests are comparable across levels.
# CUDA: large enough to fill the GPU (bf16 8192³ ≈ 1.4 ms on an H200), well under 1 s in total.
_CUDA_SHAPES: dict[Datapath, tuple[tuple[int, int, int], tuple[int, int, int]]] = {
    Datapath.BF16: ((8192, 8192, 8192), (2048, 2048, 65536)),
    Datapath.FP16: ((8192, 8192, 8192), (2048, 2048, 65536)),
    Datapath.FP8: ((8192, 8192, 8192), (2048, 2048, 65536)),
    Datapath.TF32: ((8192, 8192, 8192), (2048, 2048, 65536)),
    Datapath.FP32: ((4096, 4096, 4096), (1024, 1024, 65536)),
    Datapath.FP64: ((4096, 4096, 4096), (1024, 1024, 65536)),
}
_CPU_SHAPES = ((192, 192, 192), (32, 32, 4096))


def datapaths_for(device: torch.device) -> tuple[list[Datapath], dict[Datapath, str]]:
    """(datapaths this device has, datapath → why it is skipped)."""
    if device.type != "cuda":
        return ([Datapath.BF16, Datapath.FP16, Datapath.FP32, Datapath.FP64],
                {Datapath.TF32: "tf32 is a CUDA tensor-core mode", Datapath.FP8: "fp8 matmul needs a CUDA GPU"})
    major, minor = torch.cuda.get_device_capability(device)
    have = [Datapath.FP16, Datapath.FP32, Datapath.FP64]
    skipped: dict[Datapath, str] = {}
    if major >= 8:
        have[1:1] = [Datapath.TF32]
        have.insert(0, Datapath.BF16)
    else:
        skipped[Datapath.BF16] = skipped[Datapath.TF32] = f"needs compute capability 8.0 (have {major}.{minor})"
    if (major, minor) >= (8, 9) and hasattr(torch, "_scaled_mm"):
        have.append(Datapath.FP8)
    else:
        skipped[Datapath.FP8] = f"torch._scaled_mm needs compute capability 8.9 (have {major}.{minor})"
    return have, skipped


def plan_cases(device: torch.device, datapaths: Sequence[Datapath] | None = None) -> list[Case]:
    have, _ = datapaths_for(device)
    chosen = [d for d in have if datapaths is None or d in datapaths]
    cases: list[Case] = []
    for dp in chosen:
        shapes = _CUDA_SHAPES[dp] if device.type == "cuda" else _CPU_SHAPES
        for name, (m, n, k) in zip(("square", "large_k"), shapes, strict=True):
            cases.append(Case(dp, name, m, n, k))
    return cases


@contextlib.contextmanager
def math_mode(datapath: Datapath) -> Iterator[None]:
    """Pin the matmul flags that change results; restore them after."""
    matmul = torch.backends.cuda.matmul
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        saved = matmul.allow_tf32
        matmul.allow_tf32 = datapath is Datapath.TF32
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            matmul.allow_tf32 = saved


def math_flags() -> dict[str, Any]:
    m = torch.backends.cuda.matmul
    return {
        "allow_bf16_reduced_precision_reduction": bool(m.allow_bf16_reduced_precision_reduction),
        "allow_fp16_reduced_precision_reduction": bool(m.allow_fp16_reduced_precision_reduction),
        "cublas_workspace_config": __import__("os").environ.get("CUBLAS_WORKSPACE_CONFIG", ""),
        "blas_library": str(getattr(torch.backends.cuda, "preferred_blas_library", lambda: "")()),
    }


def _package_version(*names: str) -> str:
    for name in names:
        try:
            return f"{name}=={importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "bundled"


def _driver_version() -> str:
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return "unknown"
    for token in text.split():
        if token.count(".") >= 1 and token.replace(".", "").isdigit():
            return token
    return "unknown"


def environment_key(device: torch.device, seed: int) -> dict[str, Any]:
    """Everything that may legitimately change the bits of a matmul on this device."""
    key: dict[str, Any] = {"hash": HASH_VERSION, "cases": CASES_VERSION, "seed": seed, "torch": torch.__version__}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        key.update({
            "device": props.name, "sm_count": props.multi_processor_count,
            "capability": f"{props.major}.{props.minor}", "driver": _driver_version(),
            "cuda": torch.version.cuda, "cublas": _package_version("nvidia-cublas-cu12", "nvidia-cublas-cu13",
                                                                   "nvidia-cublas"),
            "flags": math_flags(),
        })
    else:
        key.update({"device": "cpu", "cpu": platform.processor() or platform.machine(),
                    "threads": torch.get_num_threads(), "mkldnn": torch.backends.mkldnn.is_available()})
    return key


def _inputs(case: Case, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device)
    # One seed per case, derived deterministically (Python's hash() is salted per process).
    gen.manual_seed((seed * 1_000_003 + sum(map(ord, case.case_id)) * 7919) % (2**63))
    base = torch.float64 if case.datapath is Datapath.FP64 else torch.float32
    a = torch.randn(case.m, case.k, generator=gen, device=device, dtype=base)
    if case.datapath is Datapath.FP8:
        b = torch.randn(case.n, case.k, generator=gen, device=device, dtype=base)  # (n, k): column-major B
        return a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    b = torch.randn(case.k, case.n, generator=gen, device=device, dtype=base)  # row-major, as users call it
    dtype = {Datapath.BF16: torch.bfloat16, Datapath.FP16: torch.float16}.get(case.datapath, base)
    return a.to(dtype), b.to(dtype)


def matmul(case: Case, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The product the digest covers: exactly the call a user makes (``torch.matmul`` on a row-major
    (k, n) B), so the check runs the kernels jobs run at their speed. fp8: ``b`` is (n, k) and
    ``b.t()`` the column-major B that ``torch._scaled_mm`` requires."""
    if case.datapath is Datapath.FP8:
        one = _unit_scale(a.device)
        return torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    return torch.matmul(a, b)


@functools.cache
def _unit_scale(device: torch.device) -> torch.Tensor:
    """The fp8 scale 1.0, made once per device (a fresh one per call is a fill kernel and a host gap)."""
    return torch.ones((), dtype=torch.float32, device=device)


def _word_view(out: torch.Tensor) -> torch.Tensor:
    return out.reshape(-1).view(torch.uint8).view(torch.int32)


def _int_view(out: torch.Tensor) -> torch.Tensor:
    kind = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[out.element_size()]
    return out.view(kind)


def _as_int32(bit: int) -> int:
    """Bit ``bit`` of a 32-bit word as a signed int32 value (bit 31 is negative)."""
    v = 1 << bit
    return v - (1 << 32) if v >= 1 << 31 else v


def inject_fault(out: torch.Tensor, kind: FaultKind, rng_seed: int) -> Callable[[], None]:
    """Corrupt ``out`` in place; returns a function that undoes exactly that corruption."""
    gen = torch.Generator().manual_seed(rng_seed)
    words = _word_view(out)
    nw = words.numel()

    def pick(n: int) -> int:
        return int(torch.randint(0, n, (1,), generator=gen))

    if kind is FaultKind.SINGLE_BIT:
        i, bit = pick(nw), pick(32)
        mask = _as_int32(bit)
        words[i] ^= mask

        def undo_bit() -> None:
            words[i] ^= mask

        return undo_bit
    if kind is FaultKind.PAIRED_BITS:
        i, bit = pick(nw), pick(32)
        j = (i + 1 + pick(nw - 1)) % nw
        mask = _as_int32(bit)
        words[i] ^= mask
        words[j] ^= mask

        def undo_pair() -> None:
            words[i] ^= mask
            words[j] ^= mask

        return undo_pair
    if kind is FaultKind.WORD:
        i = pick(nw)
        words[i] ^= -1

        def undo_word() -> None:
            words[i] ^= -1

        return undo_word
    # A 16×16 tile of the 2-D output (one warp's MMA fragment), every element's bits scrambled.
    ints = _int_view(out)
    rows, cols = ints.shape
    r0, c0 = pick(max(1, rows - 15)), pick(max(1, cols - 15))
    tile = ints[r0 : r0 + 16, c0 : c0 + 16]
    bits = 8 * out.element_size()
    pattern = torch.randint(1, 2 ** min(bits - 1, 62), tile.shape, generator=gen, dtype=torch.int64)
    pattern = pattern.to(device=out.device, dtype=ints.dtype)
    tile ^= pattern

    def undo_tile() -> None:
        tile.bitwise_xor_(pattern)

    return undo_tile


@dataclass(slots=True)
class CaseResult:
    case: Case
    digest: str
    matmul_ms: float
    hash_ms: float
    gen_ms: float = 0.0  # generating the inputs on the device
    injected: dict[str, str] = field(default_factory=dict)  # fault kind → digest with the fault

    def to_dict(self) -> dict[str, Any]:
        tflops = self.case.flops / (self.matmul_ms * 1e-3) / 1e12 if self.matmul_ms > 0 else None
        out: dict[str, Any] = {
            "case": self.case.case_id, "datapath": self.case.datapath.value, "shape": self.case.shape,
            "m": self.case.m, "n": self.case.n, "k": self.case.k, "digest": self.digest,
            "matmul_ms": round(self.matmul_ms, 4), "hash_ms": round(self.hash_ms, 4),
            "gen_ms": round(self.gen_ms, 4),
            "tflops": None if tflops is None else round(tflops, 1),
        }
        if self.injected:
            out["injected"] = dict(self.injected)
        return out


class _Timer:
    """Device-event timing on CUDA, host clock on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        if self.cuda:
            end.synchronize()
            return float(start.elapsed_time(end))
        return (end - start) * 1e3


def run_case(case: Case, device: torch.device, seed: int, *,
             faults: Sequence[FaultKind] = (), corrupt: FaultKind | None = None) -> CaseResult:
    """One case on one device. ``faults``: self-test, digests of the output with each fault
    (undone after). ``corrupt``: leave a fault in before the one digest (simulates a bad GPU)."""
    timer = _Timer(device)
    with math_mode(case.datapath):
        tg = timer.mark()
        a, b = _inputs(case, device, seed)
        t0 = timer.mark()
        out = matmul(case, a, b)
        t1 = timer.mark()
    del a, b
    if corrupt is not None:
        inject_fault(out, corrupt, rng_seed=seed)
    t2 = timer.mark()
    digest = hashing.digest(out)  # .item()/.tolist() inside: the only device→host copy
    t3 = timer.mark()
    result = CaseResult(case, digest, timer.elapsed_ms(t0, t1), timer.elapsed_ms(t2, t3), timer.elapsed_ms(tg, t0))
    for n, kind in enumerate(faults):
        undo = inject_fault(out, kind, rng_seed=seed + 101 * (n + 1))
        result.injected[kind.value] = hashing.digest(out)
        undo()
    if faults and hashing.digest(out) != digest:
        raise RuntimeError("fault injection did not undo cleanly")  # the self-test itself is broken
    return result


@dataclass(slots=True)
class DeviceSpec:
    ref: DeviceRef
    device: torch.device
    corrupt: FaultKind | None = None  # test hook: a device that corrupts every result
    corrupt_runs: int | None = None  # ... only for its first N runs (a transient fault)


@dataclass(slots=True)
class SdcReport:
    key: dict[str, Any]
    key_id: str
    devices: list[dict[str, Any]]
    findings: list[Finding]
    golden: dict[str, Any]
    skipped: dict[str, str]
    selftest: dict[str, Any] | None = None
    hash_impl: str = "torch"  # "triton" when the fused kernel ran (CUDA with triton installed)
    reference: dict[str, Any] = field(default_factory=dict)  # what the digests were compared with (``reference_of``)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "key": self.key, "key_id": self.key_id, "devices": self.devices,
            "findings": [f.to_dict() for f in self.findings], "golden": self.golden,
            "skipped_datapaths": self.skipped,
            "hash_impl": self.hash_impl, "reference": self.reference,
        }
        if self.selftest is not None:
            out["selftest"] = self.selftest
        return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(slots=True)
class DeviceRun:
    """What one device measured: its document, its digest per case, the findings it makes alone
    (a case that gave different digests across repeats) and the self-test's injected faults."""

    ref: DeviceRef
    doc: dict[str, Any]
    digests: dict[str, str]
    findings: list[Finding]
    injected: dict[str, dict[str, int]]  # fault kind → {"injected": n, "detected": n}

    def to_wire(self) -> dict[str, Any]:
        """Plain data, for gathering device runs from other processes (one rank per GPU)."""
        return {"ref": dataclasses.asdict(self.ref), "doc": self.doc, "digests": self.digests,
                "findings": [f.to_dict() for f in self.findings], "injected": self.injected}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> DeviceRun:
        return cls(DeviceRef(**d["ref"]), dict(d["doc"]), dict(d["digests"]),
                   [Finding.from_dict(f) for f in d["findings"]], {k: dict(v) for k, v in d["injected"].items()})


RunOne = Callable[["DeviceSpec", Case, bool], CaseResult]


def case_runner(seed: int, faults: Sequence[FaultKind]) -> RunOne:
    """``one(spec, case, with_faults)``: one run of a case on a device, honouring the device's test
    hook (``corrupt`` for its first ``corrupt_runs`` runs)."""
    run_count: dict[str, int] = {}

    def one(spec: DeviceSpec, case: Case, with_faults: bool = False) -> CaseResult:
        n = run_count.get(spec.ref.key, 0)
        run_count[spec.ref.key] = n + 1
        bad = spec.corrupt if spec.corrupt_runs is None or n < spec.corrupt_runs else None
        with torch.cuda.device(spec.device) if spec.device.type == "cuda" else contextlib.nullcontext():
            return run_case(case, spec.device, seed, faults=faults if with_faults else (), corrupt=bad)

    return one


def measure_device(spec: DeviceSpec, cases: Sequence[Case], one: RunOne, *, seed: int, repeats: int,
                   selftest: bool, faults: Sequence[FaultKind]) -> DeviceRun:
    """Every case on one device (``repeats`` times; the self-test's faults on the first run)."""
    # One-time host work is not GPU time: compiling the hash kernel (~2 s the first time in a
    # process) and cuBLAS loading each matmul kernel on first use (~0.1 s per square case on an
    # H200, measured inside the events while the GPU idles; modules load per device). Do it before
    # the clock starts, on every GPU, and report it apart as setup_seconds.
    t_setup = time.perf_counter()
    with torch.cuda.device(spec.device) if spec.device.type == "cuda" else contextlib.nullcontext():
        hashing.digest(torch.zeros(64, dtype=torch.int32, device=spec.device))
        if spec.device.type == "cuda":
            for case in cases:
                with math_mode(case.datapath):
                    a, b = _inputs(case, spec.device, seed)
                    matmul(case, a, b)
                del a, b
    _sync(spec.device)
    setup_s = time.perf_counter() - t_setup
    t_start = time.perf_counter()
    gpu_ms = 0.0
    results: list[dict[str, Any]] = []
    digests: dict[str, str] = {}
    findings: list[Finding] = []
    injected: dict[str, dict[str, int]] = {k.value: {"injected": 0, "detected": 0} for k in faults}
    for case in cases:
        runs = [one(spec, case, selftest)]
        runs += [one(spec, case, False) for _ in range(repeats - 1)]
        gpu_ms += sum(r.gen_ms + r.matmul_ms + r.hash_ms for r in runs)
        doc = runs[0].to_dict()
        if repeats > 1:
            doc["repeat_digests"] = [r.digest for r in runs]
            if len({r.digest for r in runs}) > 1:
                findings.append(self_inconsistency_finding(spec.ref, case.info(), [r.digest for r in runs]))
        for kind, bad_digest in runs[0].injected.items():
            injected[kind]["injected"] += 1
            injected[kind]["detected"] += int(bad_digest != runs[0].digest)
        results.append(doc)
        digests[case.case_id] = runs[0].digest
    _sync(spec.device)
    device_doc = {
        "device": spec.ref.key, "uuid": spec.ref.uuid, "index": spec.ref.index, "name": spec.ref.name,
        "cases": results, "gpu_seconds": round(gpu_ms / 1e3, 4),
        "wall_seconds": round(time.perf_counter() - t_start, 3), "setup_seconds": round(setup_s, 3),
    }
    return DeviceRun(spec.ref, device_doc, digests, findings, injected)


Rerun = Callable[[Sequence[Any]], dict[tuple[str, str], list[str]]]


def run_sdc(
    specs: Sequence[DeviceSpec],
    *,
    seed: int = DEFAULT_SEED,
    golden_dir: str | Path | None = None,
    repeats: int = 1,
    reruns: int = 2,
    record_golden: bool = False,
    selftest: bool = False,
    node: str = "node",
    datapaths: Sequence[Datapath] | None = None,
) -> SdcReport:
    """Run every case on every device, then judge: golden → peers → re-runs → findings."""
    if not specs:
        raise ValueError("no devices to test")
    first = specs[0].device
    cases = plan_cases(first, datapaths)
    faults = list(FaultKind) if selftest else []
    one = case_runner(seed, faults)
    runs = [measure_device(spec, cases, one, seed=seed, repeats=repeats, selftest=selftest, faults=faults)
            for spec in specs]
    by_key = {s.ref.key: s for s in specs}
    case_by_id = {c.case_id: c for c in cases}

    def rerun(suspects: Sequence[Any]) -> dict[tuple[str, str], list[str]]:
        return {(s.device, s.case_id): [one(by_key[s.device], case_by_id[s.case_id], False).digest
                                        for _ in range(reruns)] for s in suspects}

    return judge_sdc(runs, cases, first, seed=seed, golden_dir=golden_dir, rerun=rerun, reruns=reruns,
                     record_golden=record_golden, selftest=selftest, node=node, datapaths=datapaths)


def judge_sdc(
    runs: Sequence[DeviceRun],
    cases: Sequence[Case],
    first: torch.device,
    *,
    seed: int,
    golden_dir: str | Path | None,
    rerun: Rerun,
    reruns: int,
    record_golden: bool = False,
    selftest: bool = False,
    node: str = "node",
    datapaths: Sequence[Datapath] | None = None,
) -> SdcReport:
    """The judgement over every device's run: golden → peers → re-runs (``rerun``: suspects → their
    re-run digests, however the devices are reached) → findings; the golden recorded when unanimous."""
    key = environment_key(first, seed)
    store = GoldenStore(golden_dir) if golden_dir is not None else None
    golden = store.load(key) if store is not None else None
    _, skipped_dp = datapaths_for(first)
    skipped = {d.value: why for d, why in skipped_dp.items()}
    findings: list[Finding] = [f for r in runs for f in r.findings]
    per_device: dict[str, dict[str, str]] = {r.ref.key: r.digests for r in runs}
    device_docs = [r.doc for r in runs]
    refs = {r.ref.key: r.ref for r in runs}
    case_by_id = {c.case_id: c for c in cases}
    selftest_doc: dict[str, Any] = {}
    for r in runs:
        for kind, counts in r.injected.items():
            acc = selftest_doc.setdefault(kind, {"injected": 0, "detected": 0})
            acc["injected"] += counts["injected"]
            acc["detected"] += counts["detected"]

    suspects, golden_disagrees = find_suspects(per_device, golden)
    rerun_digests = rerun(suspects) if reruns and suspects else {}
    for suspect in suspects:
        ref = refs[suspect.device]
        case = case_by_id[suspect.case_id]
        again = rerun_digests.get((suspect.device, suspect.case_id), [])
        if suspect.basis is Basis.UNDECIDED and reruns:
            # No majority the first time (e.g. two of three devices wrong at once): vote again on
            # every device's latest answer; a device that was right all along is cleared.
            latest = [rerun_digests.get((dev, case.case_id), [per[case.case_id]])[-1]
                      for dev, per in per_device.items()]
            second = majority(latest)
            if second is not None:
                if suspect.observed == second and all(d == second for d in again):
                    continue
                suspect = dataclasses.replace(suspect, expected=second, basis=Basis.PEERS)
        persistence = classify(suspect.observed, suspect.expected, again)
        findings.append(suspect_finding(suspect, ref, case.info(), persistence, again))
    kid = key_id(key)
    if golden_disagrees:
        findings.append(golden_disagreement_finding(node, golden_disagrees, kid))

    golden_doc: dict[str, Any] = {"status": "absent" if golden is None else "compared", "key_id": kid}
    if store is not None and not findings:
        unanimous = {c: per_device[runs[0].ref.key][c] for c in case_by_id}
        if record_golden or (golden is None and len(runs) >= 2):
            missing = {c: d for c, d in unanimous.items() if golden is None or c not in golden}
            if missing or record_golden:
                path = store.record(key, unanimous, source=f"{node}:{len(runs)} devices agreed")
                golden_doc.update(status="recorded", path=str(path), cases=len(unanimous))

    selftest_result = None
    if selftest:
        selftest_result = _selftest_findings(selftest_doc, [r.ref for r in runs], cases, per_device, device_docs)
    impl = "triton" if first.type == "cuda" and hashing.triton_available() else "torch"
    runs_per_case = min((len(c.get("repeat_digests") or [c["digest"]]) for d in device_docs for c in d["cases"]),
                        default=1)
    reference = reference_of(golden is not None, len(runs), runs_per_case)
    return SdcReport(key, kid, device_docs, findings, golden_doc, skipped, selftest_result, impl, reference)


# What a run's digests were compared with. Only a golden or a peer is outside the GPU: a GPU that computes the
# same wrong result every time agrees with itself, so "self" and "none" are no verdict on SDC (docs/diagnostics.md).
CROSS_CHECKED = frozenset({"golden", "peers", "golden+peers"})


def reference_of(have_golden: bool, devices: int, runs: int) -> dict[str, Any]:
    """``{"basis", "cross_checked", "compared"}``: the basis is ``golden``, ``peers``, ``golden+peers``, ``self``
    (one device, its repeated runs compared with each other) or ``none`` (one device, one run: nothing compared);
    ``compared`` says it in words."""
    peers = devices >= 2
    if have_golden or peers:
        basis = "golden+peers" if have_golden and peers else ("golden" if have_golden else "peers")
        parts = (["the golden digests"] if have_golden else []) + ([f"{devices} devices with each other"] if peers
                                                                      else [])
        compared = " and ".join(parts)
    elif runs >= 2:
        basis, compared = "self", f"the device with itself only ({runs} runs of each case)"
    else:
        basis, compared = "none", "nothing (one device, one run of each case, no golden digests)"
    return {"basis": basis, "cross_checked": basis in CROSS_CHECKED, "compared": compared}


def _selftest_findings(counts: dict[str, Any], refs: Sequence[DeviceRef], cases: Sequence[Case],
                       per_device: Mapping[str, Mapping[str, str]],
                       device_docs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Feed each injected digest through the same judgement as a real run (the clean digest as the
    golden) and check that it yields an ``sdc.mismatch`` naming the GPU, datapath and shape."""
    named = total = 0
    examples: list[dict[str, Any]] = []
    for ref, doc in zip(refs, device_docs, strict=True):
        for case_doc, case in zip(doc["cases"], cases, strict=True):
            clean = per_device[ref.key][case.case_id]
            for kind, bad in case_doc.get("injected", {}).items():
                total += 1
                suspects, _ = find_suspects({ref.key: {case.case_id: bad}}, {case.case_id: clean})
                for s in suspects:
                    f = suspect_finding(s, ref, case.info(), Persistence.TRANSIENT, [clean], injected=True)
                    ok = (f.code == "sdc.mismatch" and f.entity.id == ref.uuid
                          and f.evidence["datapath"] == case.datapath.value and f.evidence["shape"] == case.shape)
                    named += int(ok)
                    if len(examples) < 2:
                        examples.append({"fault": kind, **f.to_dict()})
    injected = sum(v["injected"] for v in counts.values())
    detected = sum(v["detected"] for v in counts.values())
    return {"faults": counts, "injected": injected, "detected": detected,
            "passed": injected > 0 and detected == injected and named == total,
            "findings_named": named, "example_findings": examples}
