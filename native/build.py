"""Build the runtime (libstable-diffusion) and our cffi shim into a cache.

No registry carries a prebuilt libstable-diffusion, so we build it from the pinned,
sha256-checked `stable-diffusion-cpp-python==0.4.7` sdist (which vendors stable-diffusion.cpp
master-596-90e87bc), or from a user's checkout of that exact commit. The build lands in
`<cache>/runtime/<key>/`, where the key hashes (source, backend, compiler, cmake flags), so a
second build is instant; the shim, which is bound to the Python version, gets its own key on
top of that. Our source patches (`sdfarm.native.sourcepatch`: today a faster CUDA im2col and
group norm) are applied to a copy of the source for the backends they touch and join the key;
`--no-patches` builds the source as it is.

    python -m sdfarm.native.build [--backend cpu|vulkan|cuda|metal] [--source DIR] [--no-patches]
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from sdfarm.native import sourcepatch

HERE = Path(__file__).resolve().parent
SOURCES = json.loads((HERE / "SOURCES.json").read_text())
SHIM_DIR = HERE / "shim"
BACKENDS = {
    "cpu": [],
    "vulkan": ["-DSD_VULKAN=ON"],
    "cuda": ["-DSD_CUDA=ON"],
    "metal": ["-DSD_METAL=ON"],
}
MODULE_NAME = "_sdfarm_native"

PRIVATE_STDCXX = "-Wl,--exclude-libs,libstdc++.a"
"""The runtime's link flag (GNU ld, Linux): a libstdc++ linked into the runtime statically
stays private to it. Some toolchains link it so: the GPU machine's CUDA build defined 4,285
of libstdc++'s symbols, 106 of them GNU-unique (bench/results/gpu/log-cudnnwhy.txt). A unique
symbol binds process-wide to its first definition, so the libstdc++.so that cuDNN brings
later used the runtime's locale facet ids with its own locales: cuDNN's ostream called a
codecvt facet as its num_put and the process died (SIGSEGV, docs/gpu.md). Where libstdc++ is
linked dynamically, as on this machine, the flag changes nothing."""


class BuildError(RuntimeError):
    """The runtime or the shim could not be built; the message says which step and why."""


@dataclass(frozen=True)
class RuntimeBuild:
    """Where one finished build lives and what it was built from."""

    backend: str
    key: str
    directory: str
    library: str
    module_dir: str
    sd_version: str
    source_sha256: str
    compiler: str
    cli: str | None


def cache_root() -> Path:
    """`$SDFARM_CACHE`, else `$XDG_CACHE_HOME/sdfarm`, else `~/.cache/sdfarm`."""
    if os.environ.get("SDFARM_CACHE"):
        return Path(os.environ["SDFARM_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "sdfarm"


def _log(msg: str) -> None:
    print(f"sdfarm build: {msg}", file=sys.stderr, flush=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_sdist(root: Path) -> Path:
    """Download the pinned sdist with pip (the ordinary client) and check its sha256."""
    dest = root / "sdist"
    path = dest / SOURCES["filename"]
    if path.exists() and _sha256(path) == SOURCES["sha256"]:
        return path
    dest.mkdir(parents=True, exist_ok=True)
    spec = f"{SOURCES['package']}=={SOURCES['version']}"
    _log(f"downloading {spec} (source only, about 20 MB)")
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "--disable-pip-version-check",
            "-q",
            spec,
            "-d",
            tmp,
        ]
        run = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / SOURCES["filename"]
        if not got.exists():
            raise BuildError(f"pip download of {spec} failed:\n{run.stderr[-2000:]}")
        digest = _sha256(got)
        if digest != SOURCES["sha256"]:
            raise BuildError(
                f"{SOURCES['filename']} has sha256 {digest}, expected {SOURCES['sha256']}: "
                "refusing to build from an unverified source"
            )
        os.replace(got, path)
    return path


def unpack_sdist(sdist: Path, root: Path) -> Path:
    """Unpack only the vendored stable-diffusion.cpp tree (never its stale .git files)."""
    out = root / "src" / SOURCES["sha256"][:16]
    src = out / SOURCES["subdir"]
    if (src / "CMakeLists.txt").exists():
        return src
    tmp = Path(tempfile.mkdtemp(dir=root / "src" if (root / "src").exists() else None))
    (root / "src").mkdir(parents=True, exist_ok=True)
    _log("unpacking the vendored stable-diffusion.cpp")
    prefix = SOURCES["subdir"] + "/"
    with tarfile.open(sdist) as tar:
        members = [
            m
            for m in tar.getmembers()
            if m.name.startswith(prefix) and "/.git" not in m.name[len(prefix) - 1 :]
        ]
        tar.extractall(tmp, members=members, filter="data")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return src


def checkout_source(path: Path) -> tuple[Path, str]:
    """A user's checkout must be the pinned commit; its identity is that commit."""
    path = path.resolve()
    if not (path / "include" / "stable-diffusion.h").exists():
        raise BuildError(
            f"{path} is not a stable-diffusion.cpp checkout (no include/stable-diffusion.h)"
        )
    head = subprocess.run(
        ["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    commit = head.stdout.strip()
    if head.returncode != 0 or commit != SOURCES["sd_commit"]:
        raise BuildError(
            f"{path} is at commit {commit or '(not a git checkout)'}; sdfarm needs "
            f"{SOURCES['sd_commit']} ({SOURCES['sd_version']}): the shim's struct layouts are "
            "pinned to it"
        )
    if not (path / "ggml" / "CMakeLists.txt").exists():
        raise BuildError(f"{path}/ggml is empty: run `git submodule update --init` there")
    return path, "git-" + commit


def compiler_id() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or "cc"
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
        return out.splitlines()[0].strip()
    except (OSError, IndexError):
        return cc


def _cmake_flags(backend: str, native: bool, cli: bool, extra: list[str]) -> list[str]:
    return [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DSD_BUILD_SHARED_LIBS=ON",
        f"-DGGML_NATIVE={'ON' if native else 'OFF'}",
        f"-DSD_BUILD_EXAMPLES={'ON' if cli else 'OFF'}",
        "-DSD_WEBP=OFF",
        "-DSD_WEBM=OFF",
        # Outside git the version would read "unknown", inside another repo its tag.
        "-DGIT_EXE=GIT_EXE-NOTFOUND",
        f"-DSDCPP_BUILD_VERSION={SOURCES['sd_version']}",
        f"-DSDCPP_BUILD_COMMIT={SOURCES['sd_commit'][:7]}",
        *BACKENDS[backend],
        *_linker_flags(),
        *extra,
    ]


def cudnn_sdpa_flags() -> list[str]:
    """Compile attention through cuDNN into a CUDA build where its headers are installed
    (sdfarm.native.cudnn.sdpa_include_dirs; the toolkit's include folder is nvcc's); none
    otherwise. The folders enter the cache key with the other flags."""
    from sdfarm.native.cudnn import sdpa_include_dirs

    nvcc = shutil.which("nvcc")
    toolkit = Path(nvcc).resolve().parent.parent / "include" if nvcc else None
    dirs = sdpa_include_dirs(toolkit_include=toolkit)
    if not dirs:
        return []
    includes = " ".join(f"-I{d}" for d in dirs)
    return [f"-DCMAKE_CUDA_FLAGS=-DSDFARM_CUDNN_SDPA=1 {includes}"]


def _linker_flags() -> list[str]:
    """PRIVATE_STDCXX where the linker is GNU ld's kind (Linux); none elsewhere."""
    linux = sys.platform.startswith("linux")
    return [f"-DCMAKE_SHARED_LINKER_FLAGS={PRIVATE_STDCXX}"] if linux else []


def _key(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _shim_hash() -> str:
    h = hashlib.sha256()
    for f in sorted(SHIM_DIR.glob("*")):
        h.update(f.name.encode() + f.read_bytes())
    h.update((HERE / "binding.py").read_bytes())
    return h.hexdigest()


def build_library(src: Path, out: Path, flags: list[str], jobs: int) -> None:
    work = out / "cmake"
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    _log(f"configuring ({' '.join(f for f in flags if 'SD_' in f and '=ON' in f) or 'CPU'})")
    for cmd in (
        ["cmake", "-S", str(src), "-B", str(work), *gen, *flags],
        ["cmake", "--build", str(work), "-j", str(jobs)],
    ):
        log = out / "build.log"
        with log.open("a") as f:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
            raise BuildError(f"`{' '.join(cmd[:3])}` failed (log: {log}):\n{tail}")
    libs = list((work / "bin").glob("libstable-diffusion.*")) + list(
        work.glob("libstable-diffusion.*")
    )
    if not libs:
        raise BuildError(f"the build produced no libstable-diffusion in {work}")
    for lib in libs:
        shutil.copy2(lib, out / lib.name)
    for exe in ("sd-cli", "sd"):
        found = work / "bin" / exe
        if found.exists():
            shutil.copy2(found, out / exe)
    # Headers the shim compiles against, so the shim never needs the source again.
    inc = out / "include"
    inc.mkdir(exist_ok=True)
    shutil.copy2(src / "include" / "stable-diffusion.h", inc)
    for h in (src / "ggml" / "include").glob("*.h"):
        shutil.copy2(h, inc)
    shutil.rmtree(work, ignore_errors=True)


def build_shim(libdir: Path, moddir: Path) -> None:
    """Compile our C shim with cffi in API mode against the runtime's header."""
    from sdfarm.native.binding import make_ffibuilder

    moddir.mkdir(parents=True, exist_ok=True)
    builder = make_ffibuilder(libdir)
    with tempfile.TemporaryDirectory() as tmp:
        built = Path(builder.compile(tmpdir=tmp, verbose=False))
        shutil.copy2(built, moddir / built.name)


def ensure_runtime(
    backend: str = "cpu",
    source: str | os.PathLike[str] | None = None,
    native: bool = False,
    cli: bool = False,
    cmake_args: list[str] | None = None,
    jobs: int | None = None,
    patches: bool = True,
) -> RuntimeBuild:
    """Return the cached build for these inputs, building what is missing. Safe to call from
    several processes at once (a file lock serialises builders)."""
    if backend not in BACKENDS:
        raise BuildError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if source:
            src, source_id = checkout_source(Path(source))
        else:
            src, source_id = None, SOURCES["sha256"]
        flags = _cmake_flags(backend, native, cli, list(cmake_args or []))
        if backend == "cuda" and patches:
            flags += cudnn_sdpa_flags()
        compiler = compiler_id()
        applied = sourcepatch.for_backend(backend) if patches else []
        pid = sourcepatch.patch_id(applied)
        # A backend no patch touches keeps the key it had before patches existed.
        key = _key(source_id, backend, compiler, *flags, *(["patches=" + pid] if pid else []))
        out = root / "runtime" / key
        manifest = out / "build.json"
        if not manifest.exists():
            started = time.monotonic()
            if src is None:
                src = unpack_sdist(fetch_sdist(root), root)
            if backend == "cuda" and patches:
                sdpa = any("SDFARM_CUDNN_SDPA" in f for f in flags)
                _log(
                    "attention through cuDNN compiled in (on where SDFARM_CUDNN names cuDNN)"
                    if sdpa
                    else "attention stays with ggml: cuDNN's frontend headers were not found "
                    "(pip install 'sdfarm[cudnn]')"
                )
            if applied:
                _log(f"applying {', '.join(p.name for p in applied)}")
                try:
                    src = sourcepatch.apply(src, root / "src" / f"{key}-patched", applied)
                except sourcepatch.PatchError as e:
                    raise BuildError(str(e)) from e
            if out.exists():
                shutil.rmtree(out)
            out.mkdir(parents=True)
            build_library(src, out, flags, jobs or os.cpu_count() or 2)
            manifest.write_text(
                json.dumps(
                    {
                        "backend": backend,
                        "source": source_id,
                        "compiler": compiler,
                        "flags": flags,
                        "patches": [p.name for p in applied],
                        "sd_version": SOURCES["sd_version"],
                        "seconds": round(time.monotonic() - started, 1),
                    },
                    indent=1,
                )
            )
            _log(f"runtime built in {time.monotonic() - started:.0f} s -> {out}")
        return _finish(out, backend, key, source_id, compiler)


def _finish(out: Path, backend: str, key: str, source_id: str, compiler: str) -> RuntimeBuild:
    """Compile the shim for this Python against the runtime in `out` (once) and describe it."""
    tag = sysconfig.get_config_var("EXT_SUFFIX") or sys.implementation.cache_tag
    moddir = out / ("shim-" + _key(_shim_hash(), tag))
    if not any(moddir.glob(MODULE_NAME + "*")):
        build_shim(out, moddir)
    lib = next(out.glob("libstable-diffusion.*"))
    exe = next((str(out / e) for e in ("sd-cli", "sd") if (out / e).exists()), None)
    return RuntimeBuild(
        backend,
        key,
        str(out),
        str(lib),
        str(moddir),
        SOURCES["sd_version"],
        source_id,
        compiler,
        exe,
    )


def prebuilt_runtime(directory: str | os.PathLike[str]) -> RuntimeBuild:
    """A runtime built elsewhere (`$SDFARM_RUNTIME_DIR`: a folder with libstable-diffusion,
    include/ and build.json, as `sdfarm build` leaves it), e.g. carried to a GPU host or baked
    into an image; only the shim is compiled here."""
    out = Path(directory).expanduser().resolve()
    manifest = out / "build.json"
    if not manifest.exists() or not any(out.glob("libstable-diffusion.*")):
        raise BuildError(f"{out} holds no runtime build (no build.json / libstable-diffusion)")
    facts = json.loads(manifest.read_text())
    return _finish(
        out,
        facts.get("backend", "cpu"),
        out.name,
        facts.get("source", "?"),
        facts.get("compiler", "?"),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sdfarm build", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--backend", default=os.environ.get("SDFARM_BACKEND", "cpu"), choices=sorted(BACKENDS)
    )
    p.add_argument("--source", help="a checkout of stable-diffusion.cpp at the pinned commit")
    p.add_argument(
        "--native",
        action="store_true",
        help="tune for this CPU (faster here, not portable to other hosts)",
    )
    p.add_argument("--with-cli", action="store_true", help="also build the runtime's own sd-cli")
    p.add_argument("--cmake-arg", action="append", default=[], help="extra -D flag for cmake")
    p.add_argument("--json", action="store_true", help="print the build's facts as JSON")
    p.add_argument(
        "--no-patches",
        action="store_true",
        help="build the pinned source without sdfarm's patches (sdfarm.native.sourcepatch)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        b = ensure_runtime(
            args.backend,
            args.source,
            args.native,
            args.with_cli,
            args.cmake_arg,
            patches=not args.no_patches,
        )
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(asdict(b)))
    else:
        print(f"{b.sd_version} {b.backend} build at {b.directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
