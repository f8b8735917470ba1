"""The simulator's hot path compiled: the engine's per-event classes built as C extensions, loaded only when
they were built from the sources in this tree; pure Python otherwise.

What is compiled (`MODULES`): the step cost (gyre.roofline_step), the engine lifecycle every engine inherits
(gyre.engine_lifecycle), and from gyre.sim.cluster the simulated engine with its KV books, KV pressure and
executions, the event heaps and the event loop. Each keeps its `.py` source as its own pure-Python
fallback: a `.pxd` beside it (Cython's augmenting declarations) makes its classes C types with typed attributes
and C-level method calls.
A value that a log or an output shows keeps its Python type (an attribute that is sometimes an int, sometimes
a float, stays an object), and every float operation is the same one in the same order (no contraction into
fused multiply-adds), so a compiled run writes the same log, byte for byte, as a pure one (tests/test_compiled.py).

`main()` (`make install` runs it) builds them with Cython into build/compiled/<key>/, the key a hash of the
sources, the declarations, the build's flags and the interpreter's extension suffix; importing gyre installs a finder
that loads them from there when the key of the sources now in the tree has a complete build, so an edited
source runs as pure Python until it is built again, never as a stale extension. `GYRE_PURE=1` in the
environment loads none. Without Cython or a C compiler the build says so in one line and everything runs pure.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUFFIX = sysconfig.get_config_var("EXT_SUFFIX") or ".so"  # an extension module's file ending
# module -> its source, relative to ROOT (pyproject's package-dir: gyre.sim is sim/)
MODULES = {
    "gyre.roofline_step": "gyre/roofline_step.py",
    "gyre.engine_lifecycle": "gyre/engine_lifecycle.py",
    "gyre.sim.cluster.time_heap": "sim/cluster/time_heap.py",
    "gyre.sim.cluster.kv_ledger": "sim/cluster/kv_ledger.py",
    "gyre.sim.cluster.execution": "sim/cluster/execution.py",
    "gyre.sim.cluster.kv_pressure": "sim/cluster/kv_pressure.py",
    "gyre.sim.cluster.engine": "sim/cluster/engine.py",
    "gyre.sim.cluster.event_loop": "sim/cluster/event_loop.py",
}
# C compiler flags: no fused multiply-adds (a * b + c rounds twice in Python; one FMA would round once)
CFLAGS = ["-O2", "-ffp-contract=off"]
# annotations are documentation, not C types (an int passed where `float` is annotated stays an int); `**` on
# C doubles is C's pow (Python's float pow for the non-negative bases it is used on), not a complex power
DIRECTIVES = {"language_level": 3, "annotation_typing": False, "binding": True, "cpow": True}


def key(root: Path = ROOT) -> str:
    """The build key of the sources now in the tree at `root`."""
    h = hashlib.sha256()
    h.update(SUFFIX.encode())
    h.update(repr((CFLAGS, sorted(DIRECTIVES.items()))).encode())
    for name, rel in sorted(MODULES.items()):
        src = root / rel
        h.update(name.encode())
        for f in (src, src.with_suffix(".pxd")):
            h.update(f.read_bytes() if f.exists() else b"-")
    return h.hexdigest()[:20]


def build_dir(k: str | None = None) -> Path:
    return ROOT / "build" / "compiled" / (k or key())


def _so(folder: Path, name: str) -> Path:
    return folder / (name + SUFFIX)


class _Finder:
    """Finds the compiled modules of one complete build (a meta-path finder)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def find_spec(self, fullname, path=None, target=None):
        rel = MODULES.get(fullname)
        if rel is None or path is None or str((ROOT / rel).parent) not in [str(Path(p)) for p in path]:
            return None  # not ours, or another checkout's package (benchmarks' --root)
        so = _so(self.folder, fullname)
        loader = importlib.machinery.ExtensionFileLoader(fullname, str(so))
        return importlib.util.spec_from_file_location(fullname, so, loader=loader)


def install() -> bool:
    """Load the compiled modules from now on if a complete build of these sources exists (and GYRE_PURE is not
    set); True if so. Importing gyre calls it."""
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return True
    if os.environ.get("GYRE_PURE"):
        return False
    try:
        folder = build_dir()
    except OSError:
        return False
    if not all(_so(folder, n).exists() for n in MODULES):
        return False
    sys.meta_path.insert(0, _Finder(folder))
    return True


def active() -> list[str]:
    """The modules of `MODULES` this process has loaded compiled (imported ones only)."""
    return [n for n in MODULES if str(getattr(sys.modules.get(n), "__file__", "")).endswith(SUFFIX)]


def build() -> Path:
    """Build the extensions of the sources now in the tree (nothing if that build exists); return its folder.
    The sources are staged under their import names (gyre/sim/cluster/...) so the declarations cimport each
    other by module name."""
    k = key()
    out = build_dir(k)
    if not all(_so(out, n).exists() for n in MODULES):
        _build(out)
    for old in out.parent.iterdir():  # builds of earlier sources are never loaded again
        if old != out and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
    return out


def _build(out: Path) -> None:
    import tempfile

    from Cython.Build import cythonize
    from setuptools import Extension
    from setuptools.dist import Distribution

    with tempfile.TemporaryDirectory(prefix="gyre-build-") as tmp:
        stage = Path(tmp)
        exts = []
        for name, rel in MODULES.items():
            dest = stage / (name.replace(".", "/") + ".py")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / rel, dest)
            if (ROOT / rel).with_suffix(".pxd").exists():
                shutil.copy((ROOT / rel).with_suffix(".pxd"), dest.with_suffix(".pxd"))
            exts.append(Extension(name, [str(dest)], extra_compile_args=CFLAGS))
        for d in {p.parent for p in stage.rglob("*.py")}:
            while d != stage:
                (d / "__init__.py").touch()
                d = d.parent
        cwd = os.getcwd()
        os.chdir(stage)
        try:
            mods = cythonize(exts, compiler_directives=DIRECTIVES, quiet=True, include_path=[str(stage)])
            dist = Distribution({"ext_modules": mods})
            cmd = dist.get_command_obj("build_ext")
            cmd.inplace = True
            cmd.parallel = os.cpu_count() or 1
            dist.run_command("build_ext")
        finally:
            os.chdir(cwd)
        part = out.with_name(out.name + ".part")
        shutil.rmtree(part, ignore_errors=True)
        part.mkdir(parents=True)
        for name in MODULES:
            shutil.copy(_so(stage, name.replace(".", "/")), _so(part, name))
        shutil.rmtree(out, ignore_errors=True)
        part.rename(out)


def main() -> None:
    """Build, or say in one line why not (the simulator then runs as pure Python). What Cython and the C
    compiler print (the generated C's warnings) goes to build/compiled/build.log."""
    log = ROOT / "build" / "compiled" / "build.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    try:
        with open(log, "w") as f:  # the compiler is a subprocess: redirect the file descriptors themselves
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
            try:
                out, err = build(), None
            except Exception as e:  # noqa: BLE001 (no Cython, no compiler: the pure-Python path stays)
                out, err = None, e
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
    finally:
        os.close(saved[0])
        os.close(saved[1])
    if err is not None:
        print(f"gyre.compiled: not built ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}; "
              f"see {log.relative_to(ROOT)}); the simulator runs as pure Python", file=sys.stderr)
    else:
        print(f"gyre.compiled: {len(MODULES)} hot-path modules built in {out.relative_to(ROOT)}")

