"""Engine keys: the name an engine is cached, listed, placed and loaded under.

A model's engine holds what its context was made with (sd_ctx_params_t of master-596): the
model's files and, when a job asks for them, a ControlNet (`control_net_path`),
textual-inversion embeddings (`embeddings`) and the TAESD as the decoder (`taesd_path`
without `tae_preview_only`, sdfarm.native.decoders). Those cannot change on a loaded engine,
so such an engine is another engine, and its key says so:

    sd15                                   the model alone (its own decoder)
    sd15+control:canny                     with ControlNet `canny`
    sd15+control:canny+embeddings:a,b      and the embeddings a and b (sorted)
    sd15+decoder:taesd                     decoding with the model's TAESD

Names are letters, digits, '.', '_' and '-' (sdfarm.native.catalog.NAME), so '+', ':' and ','
never occur inside one and a key splits back unambiguously. A job of such an engine carries the
key as its model (as an upscale job carries `upscaler:NAME`): the scheduler's affinity (a
device that already holds this engine), the heartbeat's loaded list and the worker's engine
cache then need nothing else to tell the engines apart, and the estimate adds the ControlNet's
and the embeddings' bytes to the model's (`extra_bytes`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sdfarm.native.catalog import NAME
from sdfarm.native.decoders import engine_decoder
from sdfarm.native.errors import InvalidParameterError

CONTROL = "+control:"
EMBEDDINGS = "+embeddings:"
DECODER = "+decoder:"
MARKS = (CONTROL, EMBEDDINGS, DECODER)


@dataclass(frozen=True)
class EngineKey:
    """A key's parts: the model's name, the ControlNet's ("" for none), the embeddings',
    the decoder ("" for the model's own, "taesd")."""

    model: str
    control_net: str = ""
    embeddings: tuple[str, ...] = ()
    decoder: str = ""

    def __str__(self) -> str:
        key = self.model
        if self.control_net:
            key += CONTROL + self.control_net
        if self.embeddings:
            key += EMBEDDINGS + ",".join(sorted(self.embeddings))
        if self.decoder:
            key += DECODER + self.decoder
        return key

    @property
    def plain(self) -> bool:
        """The model alone (its key is its name)."""
        return not self.control_net and not self.embeddings and not self.decoder


def is_key(name: str) -> bool:
    """Whether `name` is an engine key with parts beyond a model's name."""
    return any(mark in name for mark in MARKS)


def embedding_names(value: str) -> tuple[str, ...]:
    """The names of a job's `embeddings` text ("a,b"), as validated (sorted, unique)."""
    return tuple(n for n in value.split(",") if n)


def key_of(model: str, params: Mapping[str, Any]) -> EngineKey:
    """The engine a generation job of `model` with (validated) `params` runs on."""
    return EngineKey(
        model,
        str(params.get("control_net") or ""),
        embedding_names(str(params.get("embeddings") or "")),
        engine_decoder(str(params.get("decoder") or "default")),
    )


def engine_key(model: str, params: Mapping[str, Any]) -> str:
    """`key_of` as its string."""
    return str(key_of(model, params))


def parse(key: str) -> EngineKey | None:
    """The parts of an engine key, or None when it is not one (an upscaler's, a bad name)."""
    key, marked, decoder = key.partition(DECODER)
    if marked and decoder != "taesd":  # the only decoder a key names
        return None
    rest, _, embeddings = key.partition(EMBEDDINGS)
    model, _, control = rest.partition(CONTROL)
    names = tuple(n for n in embeddings.split(",") if n) if embeddings else ()
    parts = [model, *([control] if control else []), *names]
    if not all(NAME.match(p) for p in parts) or (EMBEDDINGS in key and not names):
        return None
    if CONTROL in key and not control:
        return None
    return EngineKey(model, control, names, decoder)


def check_key(key: str, model: str, params: Mapping[str, Any]) -> None:
    """InvalidParameterError when a job's engine key is not the one its parameters name (a
    worker checks what it is about to load)."""
    want = engine_key(model, params)
    if key != want:
        raise InvalidParameterError("model", f"the job's engine {key!r} is not {want!r}")


def unknown_error(key: str, heartbeats: Mapping[str, Mapping[str, Any]], models: list[str]) -> str:
    """Why no live worker can load engine `key`: its model, ControlNet or an embedding is
    unknown, or no live worker's copy of its model has the TAESD it decodes with (the
    scheduler fails such a job with this)."""
    parts = parse(key)
    if parts is None:
        return f"invalid engine {key!r}"

    def have(field: str) -> list[str]:
        return sorted({str(n) for hb in heartbeats.values() for n in hb.get(field) or {}})

    if parts.model not in models:
        return f"unknown model {parts.model!r}: no live worker has it; the farm has: " + (
            ", ".join(models) or "no models"
        )
    if parts.control_net and parts.control_net not in have("controlnets"):
        return f"unknown ControlNet {parts.control_net!r}: no live worker has it; the farm " + (
            f"has: {', '.join(have('controlnets')) or 'no ControlNets'}"
        )
    missing = [n for n in parts.embeddings if n not in have("embeddings")]
    if parts.decoder and not missing:
        return (
            f"decoder taesd needs a TAESD file (role taesd) in model {parts.model!r}, and the "
            "live workers' copies of it do not all have one; use decoder default"
        )
    return f"unknown embedding {missing[0] if missing else '?'!r}: no live worker has it; " + (
        f"the farm has: {', '.join(have('embeddings')) or 'no embeddings'}"
    )


def extra_bytes(
    key: EngineKey, controlnets: Mapping[str, int], embeddings: Mapping[str, int]
) -> int | None:
    """What a key's ControlNet and embeddings add to its model's bytes in the estimate (the
    ControlNet as loaded, the embeddings' files and the f32 token table,
    sdfarm.native.embeddings.TABLE_BYTES); None when one of them is unknown."""
    from sdfarm.native.embeddings import TABLE_BYTES

    total = 0
    if key.control_net:
        if key.control_net not in controlnets:
            return None
        total += int(controlnets[key.control_net])
    if key.embeddings:
        if any(n not in embeddings for n in key.embeddings):
            return None
        total += sum(int(embeddings[n]) for n in key.embeddings) + TABLE_BYTES
    return total
