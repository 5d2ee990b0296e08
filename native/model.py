"""Models: a set of model files, each in one role, checked before the runtime sees them.

A model comes from explicit {role: path} or from a folder (one model named after the folder,
its roles named by an optional manifest `model.json` or detected from the files' headers).
Every file's header is validated (`headers.py`) and its role checked against its tensor names
(`roles.py`) because the runtime (master-596) does not abort on a bad model file: it returns
NULL with an ERROR record that names the file's full path. We raise an error a user can act
on, naming the role and the file's name only (full paths leak into records that leave the
machine), and give the memory rules (`memory.py`) and the fit plan (`fitplan.py`) the file
sizes split by component without reading gigabytes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from .errors import ModelLoadError
from .headers import FileHeader, validate_header
from .roles import (
    COMPONENTS,
    DEFAULT_NATIVE_SIZE,
    HIGH_NOISE,
    ROLE_COMPONENTS,
    ROLE_PARAMS,
    ROLES,
    UPSCALER,
    detect_role,
    detect_role_with_evidence,
    guess_architecture,
    native_size_for,
    split_checkpoint,
)
from .video import check_clip_vision, check_pair
from .video import check_header as check_video_header

MODEL_SUFFIXES: tuple[str, ...] = (".safetensors", ".gguf")
MANIFEST_NAME = "model.json"

# A role slot that also takes files detected as another role: sd.cpp's model_path loads a
# diffusion-only file (a checkpoint may lack the parts given in other slots).
# The high-noise expert of a Wan 2.2 pair is a diffusion model by its tensor names.
_ALSO_ACCEPTS: dict[str, tuple[str, ...]] = {
    "checkpoint": ("diffusion_model",),
    HIGH_NOISE: ("diffusion_model",),
}


@dataclass(frozen=True)
class ModelFile:
    """One file of a model: its absolute path, its role, its size in bytes and its header."""

    path: Path
    role: str
    size: int
    header: FileHeader


@dataclass(frozen=True)
class Model:
    """A model: a name, its files by role and its native image size (width, height).
    `directory` is the model's folder (None when its files live in different folders)."""

    name: str
    files: dict[str, ModelFile]
    native_size: tuple[int, int] = DEFAULT_NATIVE_SIZE
    directory: Path | None = None

    @cached_property
    def architecture(self) -> str:
        """The diffusion model's coarse architecture (roles.guess_architecture): sd1, sd2,
        sdxl, mmdit, flux, dit or unknown. Read once per Model: the catalog hands a worker
        the same Model for every job, and the scan of 1,228 tensor names cost 9 ms a job
        (with `decoders` and the video reading, 6 ms of the 9.7 ms between two images on the
        H200, docs/gpu.md)."""
        main = self.files.get("diffusion_model") or self.files.get("checkpoint")
        return guess_architecture(main.header) if main is not None else "unknown"

    @property
    def total_bytes(self) -> int:
        """The sum of the file sizes: the base of the seed's memory estimate."""
        return sum(f.size for f in self.files.values())

    def component_bytes(self) -> dict[str, int]:
        """Bytes per pipeline component, {"diffusion", "text_encoders", "vae"}, for the fit
        plan. A checkpoint's tensors are split by their prefixes; header bytes and tensors of
        no known component count as diffusion. The values sum to `total_bytes`."""
        out = dict.fromkeys(COMPONENTS, 0)
        for role, mf in self.files.items():
            if role != "checkpoint":
                out[ROLE_COMPONENTS[role]] += mf.size
                continue
            split = split_checkpoint(mf.header)
            for component, nbytes in split.items():
                out[component] += nbytes
            out["diffusion"] += mf.size - sum(split.values())
        return out

    def path_roles(self) -> dict[str, str]:
        """{path: placeholder} for scrubbing logs: every file's absolute path ->
        "<role file>" and the model folder -> "<model dir>"; longest paths first so a
        replacer that goes in order never leaves half a path behind."""
        pairs: dict[str, str] = {}
        for role, mf in self.files.items():
            for p in path_variants(mf.path):
                pairs[p] = f"<{role} file>"
        if self.directory is not None:
            for p in path_variants(self.directory):
                pairs.setdefault(p, "<model dir>")
        return dict(sorted(pairs.items(), key=lambda kv: -len(kv[0])))

    @cached_property
    def decoders(self) -> tuple[str, ...]:
        """The decoders this model has, the full VAE first (sdfarm.native.decoders): a job
        chooses among them with its `decoder`. Read once per Model, as `architecture`."""
        from .decoders import available

        return available(self)

    @property
    def can_encode(self) -> bool:
        """Whether the model's own decoder (its VAE, else its TAESD) comes with an encoder,
        which img2img and inpainting need (`can_encode_with`)."""
        from .decoders import own

        return self.can_encode_with(own(self.decoders))

    def can_encode_with(self, decoder: str) -> bool:
        """Whether an engine decoding with `decoder` (vae or taesd) can turn an image into
        latents: the runtime encodes with the decoder's own autoencoder, so the TAESD, or
        the VAE file or the checkpoint's VAE, must hold an encoder; a decoder-only one cannot."""
        sides = (
            (("taesd", ("encoder.layers.", "tae.encoder.")),)
            if decoder == "taesd"
            else (
                ("vae", ("encoder.", "first_stage_model.encoder.", "vae.encoder.")),
                ("checkpoint", ("first_stage_model.encoder.", "vae.encoder.")),
            )
        )
        for role, prefixes in sides:
            mf = self.files.get(role)
            if mf is not None:
                return any(n.startswith(prefixes) for n in mf.header.tensors)
        return False

    def ctx_paths(self) -> dict[str, str]:
        """{sd_ctx_params_t field: path} for the runtime, e.g. {"llm_path": "/m/llm.gguf"}."""
        return {ROLE_PARAMS[role]: str(mf.path) for role, mf in self.files.items()}

    @classmethod
    def from_files(
        cls,
        files: Mapping[str, str | os.PathLike[str]],
        *,
        name: str | None = None,
        native_size: tuple[int, int] | None = None,
        directory: str | os.PathLike[str] | None = None,
    ) -> Model:
        """A model from explicit {role: path}. Each file's header is validated and its
        detected role must agree with the given one (a file whose role cannot be detected is
        accepted: detection is best effort, the runtime has the last word). A checkpoint
        slot also takes a diffusion-only file (sd.cpp's model_path loads it)."""
        if not files:
            raise ModelLoadError("a model needs files: none were given")
        model_files: dict[str, ModelFile] = {}
        for role, raw_path in files.items():
            if role not in ROLE_PARAMS:
                raise ModelLoadError(
                    f"unknown role {role!r} (roles: {', '.join(ROLES)})", role=role
                )
            path = Path(raw_path).absolute()
            header = validate_header(path, role)
            detected, evidence = detect_role_with_evidence(header)
            if detected not in (None, role, *_ALSO_ACCEPTS.get(role, ())):
                raise ModelLoadError(
                    f"{role} file {path.name}: given as {role}, it looks like "
                    f"{_article(detected)} {detected} file ({evidence})",
                    role=role,
                )
            check_video_header(header, f"{role} file {path.name}")
            model_files[role] = ModelFile(path, role, header.file_size, header)

        main = model_files.get("diffusion_model") or model_files.get("checkpoint")
        if main is None:
            raise ModelLoadError(
                f"model {name or '(unnamed)'} has no diffusion_model or checkpoint file "
                f"(it has: {', '.join(model_files)})"
            )
        named = {r: (mf.header, mf.path.name) for r, mf in model_files.items()}
        check_pair(named, name or main.path.stem)
        check_clip_vision(named, name or main.path.stem)
        if name is None:
            name = main.path.stem
        if directory is None:
            parents = {mf.path.parent for mf in model_files.values()}
            directory = parents.pop() if len(parents) == 1 else None
        size = native_size or native_size_for(main.header)
        ordered = {r: model_files[r] for r in ROLES if r in model_files}
        return cls(name, ordered, (int(size[0]), int(size[1])), _abs_or_none(directory))

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Model:
        """A folder is one model named after the folder. Its optional manifest `model.json`,
        {"files": {"role": "filename"}, "native_size": [w, h]}, names the roles (filenames
        relative, inside the folder); without "files", every *.safetensors and *.gguf file
        gets its role detected from its header."""
        folder = Path(path).absolute()
        name = folder.name
        if not folder.is_dir():
            what = "is not a folder" if folder.exists() else "does not exist"
            raise ModelLoadError(f"model folder {name} {what}")
        manifest = _read_manifest(folder)
        native = manifest.get("native_size")
        if "files" in manifest:
            files = {role: folder / fname for role, fname in manifest["files"].items()}
        else:
            files = _detect_files(folder)
        return cls.from_files(files, name=name, native_size=native, directory=folder)


def _abs_or_none(p: str | os.PathLike[str] | None) -> Path | None:
    return None if p is None else Path(p).absolute()


def path_variants(p: Path) -> list[str]:
    """The path as given and as resolved (symlinks), since either may reach a log line."""
    out = [str(p)]
    try:
        resolved = str(p.resolve())
    except OSError:
        return out
    if resolved not in out:
        out.append(resolved)
    return out


def _article(role: str) -> str:
    return "an" if role == "llm" else "a"


def _read_manifest(folder: Path) -> dict[str, Any]:
    """The folder's model.json, checked: roles known, filenames relative and inside the
    folder (a manifest must not point the runtime at other files on the host)."""
    mpath = folder / MANIFEST_NAME
    label = f"{MANIFEST_NAME} of model {folder.name}"
    if not mpath.exists():
        return {}
    try:
        doc = json.loads(mpath.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{label} cannot be read: {type(exc).__name__}") from None
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{label} is not valid JSON ({exc.msg} at {exc.pos})") from None
    if not isinstance(doc, dict):
        raise ModelLoadError(f"{label} must be a JSON object")
    out: dict[str, Any] = {}
    if "files" in doc:
        files = doc["files"]
        if not isinstance(files, dict) or not files:
            raise ModelLoadError(f'{label}: "files" must map roles to file names')
        checked: dict[str, str] = {}
        for role, fname in files.items():
            if role not in ROLE_PARAMS:
                raise ModelLoadError(
                    f"{label}: unknown role {role!r} (roles: {', '.join(ROLES)})", role=role
                )
            if not isinstance(fname, str) or not fname:
                raise ModelLoadError(f"{label}: the {role} file name must be a string", role=role)
            if not _stays_inside(fname):
                raise ModelLoadError(
                    f"{label}: the {role} file {fname!r} must be a file name inside the model "
                    "folder (no absolute paths, no '..')",
                    role=role,
                )
            checked[role] = fname
        out["files"] = checked
    if "native_size" in doc:
        size = doc["native_size"]
        if not (
            isinstance(size, list)
            and len(size) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in size)
        ):
            raise ModelLoadError(f'{label}: "native_size" must be [width, height] in pixels')
        out["native_size"] = (size[0], size[1])
    return out


def _stays_inside(fname: str) -> bool:
    """True when a manifest file name cannot leave the folder on any OS."""
    for pure in (PurePosixPath(fname), PureWindowsPath(fname)):
        if pure.is_absolute() or pure.drive or pure.root or ".." in pure.parts:
            return False
    return True


def _detect_files(folder: Path) -> dict[str, Path]:
    """{role: path} for a folder without a manifest, roles detected from the headers."""
    candidates = sorted(
        p
        for p in folder.iterdir()
        if p.suffix.lower() in MODEL_SUFFIXES and not p.name.startswith(".") and p.is_file()
    )
    if not candidates:
        raise ModelLoadError(
            f"model folder {folder.name} holds no .safetensors or .gguf file "
            f"(and no {MANIFEST_NAME})"
        )
    found: dict[str, Path] = {}
    for p in candidates:
        header = validate_header(p)
        role = detect_role(header)
        if role == UPSCALER:
            raise ModelLoadError(
                f"model file {p.name} in model {folder.name} is an upscaler (ESRGAN), not part "
                "of a model: put it in the models directory's upscalers/ folder",
                role=role,
            )
        if role is None:
            shown = ", ".join(list(header.tensors)[:3]) or "no tensors"
            raise ModelLoadError(
                f"model file {p.name} in model {folder.name}: its role cannot be told from its "
                f"tensor names ({shown}); name it in {MANIFEST_NAME}"
            )
        if role in found and role == "diffusion_model":
            raise ModelLoadError(
                f"diffusion_model files {found[role].name} and {p.name} in model {folder.name}: "
                f"two diffusion models; for a Wan 2.2 pair name the low-noise one "
                f"diffusion_model and the high-noise one {HIGH_NOISE} in {MANIFEST_NAME}",
                role=role,
            )
        if role in found:
            raise ModelLoadError(
                f"{role} files {found[role].name} and {p.name} in model {folder.name}: two files "
                f"with one role; name the one to use in {MANIFEST_NAME}",
                role=role,
            )
        found[role] = p
    return found
