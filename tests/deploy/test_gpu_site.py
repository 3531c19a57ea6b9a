"""benchmarks/gpu_site.py: a distribution left out of the GPU site goes with every file its RECORD
lists and the folders that leaves empty; what other distributions hold in the same folders stays."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2]))
from benchmarks.gpu_site import drop_distribution  # noqa: E402


def _distribution(site: Path, name: str, files: list[str]) -> Path:
    dist_info = site / f"{name}-1.0.dist-info"
    dist_info.mkdir()
    for file in files:
        (site / file).parent.mkdir(parents=True, exist_ok=True)
        (site / file).write_text(file)
    (dist_info / "RECORD").write_text("".join(f"{f},sha256=x,1\n" for f in files + [f"{dist_info.name}/RECORD"]))
    return dist_info


def test_a_dropped_distribution_takes_its_files_and_emptied_folders_only(tmp_path):
    dropped = _distribution(tmp_path, "grpcio", ["grpc/__init__.py", "grpc/_cython/cygrpc.so", "grpc/aio/base.py"])
    _distribution(tmp_path, "grpcio_reflection", ["grpc_reflection/v1alpha/reflection.py", "grpc/kept.py"])
    drop_distribution(tmp_path, dropped)
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert left == ["grpc/kept.py", "grpc_reflection/v1alpha/reflection.py",
                    "grpcio_reflection-1.0.dist-info/RECORD"]
    assert not (tmp_path / "grpc" / "_cython").exists() and not (tmp_path / "grpc" / "aio").exists()
