"""The check that tells a user the installed llama.cpp build leaves this CPU's vector units unused."""

from __future__ import annotations

from pathlib import Path

from services.adapters.llamacpp.build import built_units, cmake_switches, cpu_flags, unused_units

WHEEL = "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | LLAMAFILE = 1 |"
NATIVE = (
    "CPU : SSE3 = 1 | AVX = 1 | AVX_VNNI = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 1 | "
    "AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | LLAMAFILE = 1 |"
)
XEON = frozenset(
    ["fpu", "sse2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_int8"]
)


def test_the_avx2_wheel_on_an_avx512_cpu_is_told_most_rewarding_unit_first() -> None:
    assert unused_units(WHEEL, XEON) == ["avx512_vnni", "avx512f", "avx_vnni"]


def test_a_build_for_the_cpu_or_a_cpu_without_the_units_is_not_told() -> None:
    assert unused_units(NATIVE, XEON) == []
    assert unused_units(WHEEL, frozenset({"avx", "avx2", "fma"})) == []
    assert unused_units(WHEEL, frozenset()) == []


def test_cpu_flags_are_the_first_processors(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(info) == {"fpu", "avx2", "avx512f"}
    assert cpu_flags(tmp_path / "missing") == frozenset()


def test_the_build_switches_come_from_the_same_table_as_the_check() -> None:
    switches = cmake_switches(XEON)
    assert switches[0] == "-DGGML_NATIVE=OFF"
    assert "-DGGML_AVX512_VNNI=ON" in switches and "-DGGML_AVX_VNNI=ON" in switches and "-DGGML_AVX512=ON" in switches
    assert "-DGGML_AVX512_BF16=OFF" in switches and "-DGGML_BMI2=OFF" in switches  # flags this CPU lacks
    assert not any("AMX" in s for s in switches)  # AMX stays off (its kernels crashed at model load)
    # a build with every switch the table turns on reports them all: the check then tells nothing
    assert unused_units(NATIVE, XEON) == [] and {"AVX512_VNNI", "AVX2", "BMI2"} <= built_units(NATIVE)
    assert "AVX512" not in built_units(WHEEL) and "AVX" in built_units(WHEEL)
