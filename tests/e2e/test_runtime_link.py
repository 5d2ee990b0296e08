"""The runtime keeps a libstdc++ linked into it statically to itself
(sdfarm.native.build.PRIVATE_STDCXX). The GPU machine's toolchain links it so; exported, its
GNU-unique symbols took over the locale facet ids of the libstdc++ that cuDNN brought later,
and the runtime's process died inside cuDNN (docs/gpu.md, "Convolutions through cuDNN")."""

from __future__ import annotations

import subprocess
from pathlib import Path

from sdfarm.native.build import PRIVATE_STDCXX, ensure_runtime

# What cuDNN's engines do with libstdc++: a number through an ostream.
SOURCE = r"""
#include <sstream>
#include <string>
extern "C" int render(long v, char * out, int n) {
    std::ostringstream s;
    s << v;
    const std::string r = s.str();
    const int k = (int) r.size() < n - 1 ? (int) r.size() : n - 1;
    r.copy(out, k);
    out[k] = 0;
    return k;
}
"""


LIBSTDCXX_PREFIXES = ("_ZNSt6locale", "_ZNSo9_M_insert", "_ZNSt9basic_ios")


def exported_libstdcxx(lib: Path) -> list[str]:
    """libstdc++'s locale and ostream symbols that `lib` defines in its dynamic table."""
    out = subprocess.run(
        ["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True
    ).stdout
    names = [line.split()[-1] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(LIBSTDCXX_PREFIXES)]


def static_libstdcxx_library(tmp_path: Path, name: str, *flags: str) -> Path:
    src = tmp_path / "render.cpp"
    src.write_text(SOURCE)
    out = tmp_path / name
    cmd = ["g++", "-O1", "-shared", "-fPIC", str(src), "-o", str(out), "-static-libstdc++"]
    subprocess.run([*cmd, *flags], check=True, capture_output=True)
    return out


def test_the_link_flag_keeps_a_static_libstdcxx_out_of_the_exports(tmp_path):
    exported = static_libstdcxx_library(tmp_path, "plain.so")
    private = static_libstdcxx_library(tmp_path, "private.so", PRIVATE_STDCXX)
    # as on the GPU machine (its CUDA build: 112 of these), unless the flag is given
    assert "_ZNSo9_M_insertIlEERSoT_" in exported_libstdcxx(exported)
    assert exported_libstdcxx(private) == []


def test_the_runtime_was_linked_with_the_flag_and_exports_no_libstdcxx():
    built = Path(ensure_runtime("cpu").directory)
    assert PRIVATE_STDCXX in (built / "build.log").read_text()
    (lib,) = built.glob("libstable-diffusion.*")
    assert exported_libstdcxx(lib) == []
