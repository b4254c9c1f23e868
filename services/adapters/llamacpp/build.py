"""Whether the installed llama.cpp build uses this CPU's vector units.

The PyPI wheel of xllamacpp is built for AVX2 so it runs anywhere. On a CPU with AVX-512 VNNI the same model read
prompts 1.5x faster and decoded four requests together 1.4x faster when built for it, though two whole LoCoMo
conversations memorized no faster (docs/benchmarks.md, "The engine built for the CPU"); the log says once, at load,
which units go unused and how to build for them: ``scripts/native-engine``.
"""

from __future__ import annotations

from pathlib import Path

#: CPU flag (/proc/cpuinfo) -> what llama.cpp's system info says when built for it; the first is what pays most
_UNITS = {"avx512_vnni": "AVX512_VNNI = 1", "avx512f": "AVX512 = 1", "avx_vnni": "AVX_VNNI = 1"}


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first processor's flags; empty where the file is missing or has none (not Linux, not x86)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def unused_units(system_info: str, flags: frozenset[str]) -> list[str]:
    """The vector extensions this CPU has and the build does not use, most rewarding first."""
    return [flag for flag, built in _UNITS.items() if flag in flags and built not in system_info]
