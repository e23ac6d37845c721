"""Fetch what the cross-version checks need into `.cache/` (`make test` runs this).

    python tests/conformance/prepare.py               # everything below
    python tests/conformance/prepare.py site 0.34.0   # one release's Python code
    python tests/conformance/prepare.py tests 0.34.0  # one release's own test suite

What is fetched follows the one list of verified releases,
`engine_sidecar.plugin.vllm_compat.VERIFIED_VLLM`, each with its pinned sha256; everything
comes through pip (`--require-hashes`), which refuses a file that does not match:
- `site`: for each release with a wheel hash (those without a CPU build, whose
  scheduler is pure Python and runs beside the installed torch), the wheel, unpacked
  without its native libraries into `.cache/vllm-<version>/site`;
- `tests`: for the first and the newest release (`conformance_releases`), the source
  archive's `tests/` and `pyproject.toml` in `.cache/conformance/vllm-<version>`, plus
  the offline Hugging Face configs those tests name (`hf_configs`). pip reads a source
  archive's metadata by running its build backend: vLLM's with no target device
  (`VLLM_TARGET_DEVICE=empty`, nothing is compiled) and its version as published.

Each step is skipped when its output exists (a stamp names the pinned hash), so
repeated runs cost nothing; a half-written tree is never used.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import hf_configs

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache"
CONFORMANCE_DIR = CACHE / "conformance"
HF_HUB_DIR = CONFORMANCE_DIR / "hf-hub"
# Native code (CUDA kernels, the Rust frontend binary, kernel headers): useless on a
# CPU machine and 80% of the wheel.
_NATIVE_SUFFIXES = (".so", ".cu", ".cuh", ".h", ".hpp", ".inl")
_NATIVE_NAMES = ("vllm/vllm-rs",)


def verified_releases() -> dict[str, tuple[str | None, str | None]]:
    """version -> (wheel sha256, source archive sha256), from the plugin's list."""
    sys.path[:0] = [str(REPO)]
    from engine_sidecar.plugin.vllm_compat import VERIFIED_VLLM

    return {version: tuple(release) for version, release in VERIFIED_VLLM.items()}  # type: ignore[misc]


def site_releases() -> list[str]:
    """Releases whose wheel is unpacked to run the plugin's scheduler tests on."""
    return [version for version, (wheel, _) in verified_releases().items() if wheel]


def conformance_releases() -> list[str]:
    """Releases whose own tests/v1/core runs stock and with the plugin: the first
    (the CPU build the engine tests use) and the newest."""
    with_tests = [version for version, (_, sdist) in verified_releases().items() if sdist]
    return list(dict.fromkeys([with_tests[0], with_tests[-1]]))


def site_dir(version: str) -> Path:
    return CACHE / f"vllm-{version}" / "site"


def suite_dir(version: str) -> Path:
    """Holds the release's tests/ and pyproject.toml."""
    return CONFORMANCE_DIR / f"vllm-{version}"


def _stamped(directory: Path, stamp: str) -> bool:
    marker = directory / ".kvquota-stamp"
    return marker.is_file() and marker.read_text() == stamp


def _publish(tmp: Path, directory: Path, stamp: str) -> None:
    """Move a finished tree into place (a half-written one is never used)."""
    (tmp / ".kvquota-stamp").write_text(stamp)
    if directory.exists():
        shutil.rmtree(directory)
    tmp.rename(directory)


def _pip_download(version: str, sha256: str, into: Path, *options: str,
                  env: dict[str, str] | None = None) -> Path:
    """`pip download` one vLLM file, pinned by its hash; returns the file."""
    into.mkdir(parents=True, exist_ok=True)
    requirements = into / f"requirements-{sha256[:12]}.txt"
    requirements.write_text(f"vllm=={version} --hash=sha256:{sha256}\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
         "--no-deps", "--require-hashes", *options, "-r", str(requirements), "-d", str(into)],
        check=True, env=env,
    )
    suffix = ".tar.gz" if "--no-binary" in options else ".whl"
    found = sorted(into.glob(f"vllm-{version}*{suffix}"))
    if not found:
        raise SystemExit(f"pip downloaded no vllm {version} {suffix} into {into}")
    return found[-1]


def prepare_site(version: str) -> Path:
    wheel_sha256 = verified_releases()[version][0]
    if wheel_sha256 is None:
        raise SystemExit(f"vLLM {version} has no pinned wheel in VERIFIED_VLLM")
    target = site_dir(version)
    if _stamped(target, wheel_sha256):
        return target
    wheel = _pip_download(version, wheel_sha256, target.parent, "--only-binary", ":all:")
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".unpack-"))
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if not name.endswith(_NATIVE_SUFFIXES) and name not in _NATIVE_NAMES:
                archive.extract(name, tmp)
    _publish(tmp, target, wheel_sha256)
    return target


def prepare_tests(version: str) -> Path:
    sdist_sha256 = verified_releases()[version][1]
    if sdist_sha256 is None:
        raise SystemExit(f"vLLM {version} has no pinned source archive in VERIFIED_VLLM")
    target = suite_dir(version)
    stamp = f"{sdist_sha256} hf-configs {hf_configs.GENERATOR_VERSION}"
    if _stamped(target, stamp):
        return target
    env = dict(os.environ, VLLM_TARGET_DEVICE="empty", VLLM_VERSION_OVERRIDE=version)
    tarball = _pip_download(version, sdist_sha256, CONFORMANCE_DIR, "--no-binary", ":all:",
                            "--no-build-isolation", env=env)
    tmp = Path(tempfile.mkdtemp(dir=CONFORMANCE_DIR, prefix=".unpack-"))
    top = f"vllm-{version}/"
    with tarfile.open(tarball) as archive:
        members = [
            m for m in archive.getmembers()
            if m.name.startswith(top + "tests/") or m.name == top + "pyproject.toml"
        ]
        for member in members:
            member.name = member.name[len(top):]
        archive.extractall(tmp, members=members, filter="data")
    if not _stamped(HF_HUB_DIR, hf_configs.GENERATOR_VERSION):
        hub = Path(tempfile.mkdtemp(dir=CONFORMANCE_DIR, prefix=".hub-"))
        hf_configs.write_hub_cache(hub)
        _publish(hub, HF_HUB_DIR, hf_configs.GENERATOR_VERSION)
    _publish(tmp, target, stamp)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("what", nargs="?", choices=["site", "tests"],
                        help="one step for one release (default: every step make test needs)")
    parser.add_argument("version", nargs="?", help="a release in VERIFIED_VLLM")
    args = parser.parse_args(argv)
    if args.what is None:
        steps = [("site", v) for v in site_releases()]
        steps += [("tests", v) for v in conformance_releases()]
    elif args.version in verified_releases():
        steps = [(args.what, args.version)]
    else:
        parser.error(f"version must be one of {', '.join(verified_releases())}")
    for what, version in steps:
        path = prepare_site(version) if what == "site" else prepare_tests(version)
        print(f"vLLM {version} {what}: {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
