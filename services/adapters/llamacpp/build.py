"""Whether the installed llama.cpp build uses this CPU's vector units, and the switches that build it for them.

The PyPI wheel of xllamacpp is built for AVX2 so it runs anywhere. On a CPU with AVX-512 VNNI the same model read
prompts 1.5x faster and decoded four requests together 1.4x faster when built for it, though two whole LoCoMo
conversations memorized no faster (66.3 and 70.0 minutes against 65.1; docs/benchmarks.md, "The engine built for
the CPU"); the log says once, at load, which units go unused and how to build for them:
``scripts/native-engine``, which takes its CMake switches from this module's one table
(``build.main`` prints them).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Unit:
    flag: str  # as /proc/cpuinfo names it
    switch: str  # llama.cpp's CMake option that builds for it
    shown: str  # as llama.cpp's system info names it when built for it
    told: int = 0  # > 0: worth telling a user it goes unused, the most rewarding first


# AMX is not here (stays off): its kernels crashed while loading the model on the Xeon we measured (a virtual
# machine, 5 December), and VNNI gives most of the gain.
UNITS = (
    Unit("avx", "GGML_AVX", "AVX"),
    Unit("avx2", "GGML_AVX2", "AVX2"),
    Unit("fma", "GGML_FMA", "FMA"),
    Unit("f16c", "GGML_F16C", "F16C"),
    Unit("bmi2", "GGML_BMI2", "BMI2"),
    Unit("avx_vnni", "GGML_AVX_VNNI", "AVX_VNNI", told=3),
    Unit("avx512f", "GGML_AVX512", "AVX512", told=2),
    Unit("avx512vbmi", "GGML_AVX512_VBMI", "AVX512_VBMI"),
    Unit("avx512_vnni", "GGML_AVX512_VNNI", "AVX512_VNNI", told=1),
    Unit("avx512_bf16", "GGML_AVX512_BF16", "AVX512_BF16"),
)


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first processor's flags; empty where the file is missing or has none (not Linux, not x86)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def built_units(system_info: str) -> frozenset[str]:
    """The units llama.cpp's system info says it was built for ("CPU : AVX = 1 | AVX2 = 1 | ...")."""
    found = set()
    for part in system_info.replace("CPU :", "|").split("|"):
        name, _, value = part.partition("=")
        if value.strip() == "1":
            found.add(name.strip())
    return frozenset(found)


def unused_units(system_info: str, flags: frozenset[str]) -> list[str]:
    """The vector extensions this CPU has and the build does not use, most rewarding first."""
    built = built_units(system_info)
    told = sorted((u for u in UNITS if u.told), key=lambda u: u.told)
    return [u.flag for u in told if u.flag in flags and u.shown not in built]


def cmake_switches(flags: frozenset[str]) -> list[str]:
    """llama.cpp's CMake options for an x86-64 CPU with these flags: each unit on where the CPU has it."""
    return ["-DGGML_NATIVE=OFF"] + [f"-D{u.switch}={'ON' if u.flag in flags else 'OFF'}" for u in UNITS]


def main() -> None:
    """Print this CPU's switches (``scripts/native-engine`` reads them)."""
    print(" ".join(cmake_switches(cpu_flags())))
