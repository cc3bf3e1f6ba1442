"""Every package of ours lives under conveyor/, so a folder at the checkout root never hides a PyPI package of the
same name wherever the root is on sys.path (pytest, Ray workers, the engine process, benchmark scripts). The PyPI
`kernels` package, which transformers >= 5.25 imports, is the case that once forced a pin."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Folders at the root that Python may import, and why each is allowed there.
ALLOWED_ROOT_PACKAGES = {
    "conveyor": "the product",
    "tests": "pytest's rootdir package (tests.tiny_model, ...)",
    "benchmarks": "run as python -m benchmarks.X",
    "scripts": "developer tools run as files (setup.sh, config_docs.py); nothing imports it as a package",
}


def _importable_root_folders() -> set[str]:
    return {p.name for p in ROOT.iterdir()
            if p.is_dir() and p.name.isidentifier() and not p.name.startswith(".")
            and (any(p.glob("*.py")) or (p / "__init__.py").exists())}


def test_no_root_folder_but_the_allowed_ones_is_importable() -> None:
    extra = _importable_root_folders() - set(ALLOWED_ROOT_PACKAGES)
    assert not extra, f"move these under conveyor/: {sorted(extra)}"


def test_pypi_kernels_and_transformers_import_from_the_checkout_root() -> None:
    code = ("import sys, kernels, transformers, conveyor.kernels;"
            "print(kernels.__file__); print(transformers.__version__); print(conveyor.kernels.__file__)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    pypi_kernels, version, ours = result.stdout.split()
    assert "site-packages" in Path(pypi_kernels).parts, pypi_kernels
    assert Path(ours).resolve().is_relative_to(ROOT / "conveyor" / "kernels")
    assert tuple(int(x) for x in version.split(".")[:2]) >= (5, 25)  # the release that imports PyPI `kernels`
