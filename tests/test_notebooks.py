"""The notebooks run top to bottom (nbclient, a kernel on this interpreter), are committed with their outputs and
their cells equal to what notebooks/build.py writes, read only data inside the repository (notebooks/data/); the
policy written in 01_policies runs on the real backend."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
KERNEL = "gyre-test-python"


def _build():
    spec = importlib.util.spec_from_file_location("gyre_notebooks_build", NOTEBOOKS / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory) -> Path:
    """A kernelspec that runs ipykernel on this very interpreter (a fresh clone needs no install step)."""
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "gyre test", "language": "python",
    }))
    return root


def _execute(name: str, kernel_dir: Path, env: dict[str, str] | None = None) -> tuple[nbformat.NotebookNode, float]:
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    km = KernelManager(kernel_name=KERNEL, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernel_dir / "kernels")]))
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        t0 = time.perf_counter()
        NotebookClient(nb, km=km, timeout=300, resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
        return nb, time.perf_counter() - t0
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _images(nb: nbformat.NotebookNode) -> int:
    return sum("image/png" in out.get("data", {}) for c in nb.cells if c.cell_type == "code" for out in c.outputs)


EXECUTED = {"01_policies.ipynb", "02_traces.ipynb"}  # each has its test_*_notebook_runs below


def test_every_notebook_is_generated_and_executed():
    """Every notebook in notebooks/ comes from build.py and is executed by a test here."""
    found = {p.name for p in NOTEBOOKS.glob("*.ipynb")}
    assert found == set(_build().NOTEBOOKS) == EXECUTED, f"notebooks {found}, built {set(_build().NOTEBOOKS)}"


@pytest.mark.parametrize("name", sorted(EXECUTED))
def test_notebook_is_built_and_executed(name):
    """The committed notebook's cells are exactly what notebooks/build.py writes, and every code cell ran (in order,
    without an error): the outputs a reader sees come from this code."""
    build = _build()
    committed = nbformat.reads((NOTEBOOKS / name).read_text(), as_version=4)
    nbformat.validate(committed)
    built = nbformat.reads(build.render(name), as_version=4)
    assert [(c.cell_type, c.source) for c in committed.cells] == [(c.cell_type, c.source) for c in built.cells], \
        f"{name}'s cells differ from notebooks/build.py: run `python notebooks/build.py`"
    counts = [c.execution_count for c in committed.cells if c.cell_type == "code"]
    assert counts == list(range(1, len(counts) + 1)), f"{name}: code cells not all run, in order: {counts}"
    errors = [o for c in committed.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{name}: a cell ended in an error: {errors[0].get('ename')}"


def test_notebooks_read_no_data_outside_the_repository():
    """The notebooks' data ship in notebooks/data/ with their licences; no cell points outside the repository."""
    for f in ("azure_llm_inference_2023_code.csv", "README.md", "vllm_timings/LICENSE-LLMServingSim",
              "vllm_timings/RTX4090_Llama-3.1-8B/requests.jsonl"):
        assert (NOTEBOOKS / "data" / f).exists(), f"notebooks/data/{f} is missing"
    for name in EXECUTED:
        src = "\n".join(c.source for c in nbformat.read(NOTEBOOKS / name, as_version=4).cells)
        assert "shared" not in src and "/work" not in src, f"{name} reads outside the repository"


def test_policies_notebook_runs(kernel_dir):
    """01_policies runs top to bottom and draws its figures (timeline, utilization, breakdown)."""
    nb, wall = _execute("01_policies.ipynb", kernel_dir, {"GYRE_NOTEBOOK_REAL": "0"})
    assert _images(nb) >= 4, f"expected >= 4 inline figures, got {_images(nb)}"
    assert wall < 170, f"01_policies took {wall:.0f} s; keep both notebooks under 3 minutes"


def test_traces_notebook_runs(kernel_dir):
    """02_traces calibrates from the Azure trace, plots the fit and replays it, top to bottom."""
    nb, wall = _execute("02_traces.ipynb", kernel_dir)  # its data from notebooks/data/
    assert _images(nb) >= 2, f"expected the fit and timeline figures, got {_images(nb)}"
    assert wall < 170, f"02_traces took {wall:.0f} s; keep both notebooks under 3 minutes"


def notebook_policy(name: str = "01_policies.ipynb", cls: str = "Pipeline"):
    """The policy class exactly as the notebook defines it (its cell's source, executed alone)."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    src = next(c.source for c in nb.cells if c.cell_type == "code" and f"class {cls}" in c.source)
    ns: dict = {"__name__": "notebook_policy"}
    exec(compile(src, f"{name}:{cls}", "exec"), ns)
    return ns[cls]


def test_notebook_policy_imports_only_the_interface():
    """The notebook's policy imports nothing but gyre.cluster and gyre.handles, and fits in 40 lines."""
    nb = nbformat.read(NOTEBOOKS / "01_policies.ipynb", as_version=4)
    src = next(c.source for c in nb.cells if c.cell_type == "code" and "class Pipeline" in c.source)
    imports = [line for line in src.splitlines() if line.startswith(("import ", "from "))]
    assert all(line.split()[1] in ("gyre.cluster", "gyre.handles") for line in imports), imports
    assert len(src.splitlines()) <= 40, f"the notebook's policy is {len(src.splitlines())} lines"


def test_notebook_policy_in_simulator():
    """The notebook's policy trains every step, one step off-policy at most, on a tiny sim workload."""
    from gyre.config import override
    from gyre.presets import get_preset
    from gyre.sim.harness.runner import simulate

    cfg = override(get_preset("short-math"), steps=3, **{"cluster.gpus": 8, "workload.groups_per_step": 4})
    r = simulate(cfg, notebook_policy()(), check=True)
    s = r.metrics.summary()
    assert s["steps"] == 3, f"trained {s['steps']} steps, expected 3"
    assert s["staleness_max"] == 1, f"staleness max {s['staleness_max']}, expected exactly 1"
    assert len(r.metrics.staleness) == 3 * 4 * 8, "every execution of every group is trained once"


@pytest.mark.slow
@pytest.mark.xdist_group("ray")  # with the other local-Ray tests, in one worker
def test_notebook_policy_on_real_backend(local_ray):
    """The same policy class runs unchanged on the real backend (local Ray, logical GPUs, torch engines)."""
    pytest.importorskip("torch", reason="the real backend needs torch (pip install -e '.[real]')")
    try:
        from gyre.real.pool import ActorPool
        from gyre.real.config import get_preset
        from gyre.real.runner import run_real
    except ImportError as exc:
        pytest.skip(f"gyre.real does not import: {exc}")
    cfg = get_preset("tiny-test")
    r = run_real(cfg, notebook_policy()(), pool=ActorPool.shared(cfg.pool), steps=2)
    s = r.metrics.summary()
    assert s["steps"] == 2, f"trained {s['steps']} steps on the real backend, expected 2"
    assert s["staleness_max"] <= 1, f"staleness max {s['staleness_max']} on the real backend"
    trained = r.metrics.staleness["exec"]
    assert trained.is_unique and set(trained) == {x[2] for x in r.log if x[0] == "admit"}, "each execution trained once"
