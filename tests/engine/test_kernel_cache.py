"""The kernels' build cache (engine/cpu_kernels.py) after a build that was killed half-way."""
from __future__ import annotations

from engine import cpu_kernels


def test_a_build_killed_half_way_does_not_hold_up_the_next_one(tmp_path, monkeypatch):
    """torch's builder leaves its lock file behind when it dies; the next load builds, not waits."""
    monkeypatch.setattr(cpu_kernels, "cache_dir", lambda kind: tmp_path / kind)
    name, directory = cpu_kernels._name_and_dir("native", False)
    directory.mkdir(parents=True)
    (directory / "lock").touch()  # what a killed build leaves
    builds = []

    def build(built_name, built_directory, march, matmuls_only, csrc):
        builds.append((built_name, (built_directory / "lock").exists()))
        return "the module"

    monkeypatch.setattr(cpu_kernels, "_build", build)
    assert cpu_kernels._load("native", False) == "the module"
    assert builds == [(name, False)]
