"""The peer: what users would otherwise run on the GPU, PyTorch + `diffusers`, with the
SD-Turbo architecture (SD 2.1's UNet, OpenCLIP-H text encoder, the SD VAE) in fp16 with random
weights (nothing downloaded), timed the way our engine is timed: prompt encoding, the sampling
steps and the VAE decode, up to 8-bit pixels on the host, per image.

    python bench/peer_diffusers.py --sizes 512,1024 --steps 1,4 --batches 1,4 \\
        [--compile] [--runs 5] [--out FILE]

Eager runs every case; `--compile` adds `torch.compile` of the UNet and the VAE decoder (each
new shape compiles first, untimed). No classifier-free guidance (SD-Turbo's setting, and
cfg_scale 1 on our side): one UNet pass per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# SD-Turbo (stabilityai/sd-turbo): SD 2.1's UNet and OpenCLIP ViT-H/14's text tower.
UNET = {
    "sample_size": 64,
    "in_channels": 4,
    "out_channels": 4,
    "layers_per_block": 2,
    "block_out_channels": (320, 640, 1280, 1280),
    "down_block_types": ("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
    "up_block_types": ("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
    "cross_attention_dim": 1024,
    "attention_head_dim": (5, 10, 20, 20),
    "use_linear_projection": True,
}
VAE = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4,
    "block_out_channels": (128, 256, 512, 512),
    "layers_per_block": 2,
    "latent_channels": 4,
    "sample_size": 512,
}
TEXT = {
    "vocab_size": 49408,
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 23,
    "num_attention_heads": 16,
    "max_position_embeddings": 77,
    "hidden_act": "gelu",
    "projection_dim": 1024,
}
VAE_SCALE = 0.18215


class Peer:
    """The three models on the GPU in fp16 and a scheduler; `images(batch, size, steps)` makes
    a batch the way a pipeline does."""

    def __init__(self, device: str = "cuda") -> None:
        import torch
        from diffusers import AutoencoderKL, EulerDiscreteScheduler, UNet2DConditionModel
        from transformers import CLIPTextConfig, CLIPTextModel

        self.torch = torch
        self.device = device
        dtype = torch.float16 if device == "cuda" else torch.float32
        self.dtype = dtype
        torch.manual_seed(0)
        with torch.device(device):
            self.unet = UNet2DConditionModel(**UNET).to(dtype).eval()
            self.vae = AutoencoderKL(**VAE).to(dtype).eval()
            self.text = CLIPTextModel(CLIPTextConfig(**TEXT)).to(dtype).eval()
        self.scheduler = EulerDiscreteScheduler(
            num_train_timesteps=1000,
            beta_start=0.00085,
            beta_end=0.012,
            beta_schedule="scaled_linear",
            timestep_spacing="trailing",
        )
        self.decode = self.vae.decode
        self.unet_call = self.unet

    def compile(self) -> None:
        torch = self.torch
        self.unet_call = torch.compile(self.unet, fullgraph=False)
        self.decode = torch.compile(self.vae.decode, fullgraph=False)

    def params(self) -> int:
        return sum(p.numel() for m in (self.unet, self.vae, self.text) for p in m.parameters())

    def images(self, batch: int, size: int, steps: int) -> Any:
        torch = self.torch
        with torch.inference_mode():
            ids = torch.randint(0, TEXT["vocab_size"], (batch, 77), device=self.device)
            emb = self.text(ids).last_hidden_state
            self.scheduler.set_timesteps(steps, device=self.device)
            latents = torch.randn(
                (batch, 4, size // 8, size // 8), device=self.device, dtype=self.dtype
            )
            latents = latents * self.scheduler.init_noise_sigma
            for t in self.scheduler.timesteps:
                x = self.scheduler.scale_model_input(latents, t)
                noise = self.unet_call(x, t, encoder_hidden_states=emb).sample
                latents = self.scheduler.step(noise, t, latents).prev_sample
            img = self.decode(latents / VAE_SCALE).sample
            pixels = ((img.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
            return pixels.permute(0, 2, 3, 1).cpu()  # waits for the GPU


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def measure(peer: Peer, batch: int, size: int, steps: int, runs: int, warm: int) -> dict:
    for _ in range(warm):
        peer.images(batch, size, steps)
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        peer.images(batch, size, steps)
        times.append(time.perf_counter() - t)
    per_call = statistics.median(times)
    return {
        "batch": batch,
        "size": size,
        "steps": steps,
        "s_per_call": round(per_call, 4),
        "s_per_image": round(per_call / batch, 4),
        "images_per_s": round(batch / per_call, 2),
        "runs": runs,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="512,1024")
    p.add_argument("--steps", default="1,4")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--compile", action="store_true", help="also torch.compile (batch 4 only)")
    p.add_argument("--compile-batches", default="4")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--deadline", type=float, default=0, help="stop starting cases after N s")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    t0 = time.perf_counter()
    import torch

    peer = Peer(args.device)
    doc: dict[str, Any] = {
        "bench": "peer_diffusers",
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else args.device,
        "params": peer.params(),
        "eager": [],
        "compiled": [],
        "skipped": [],
    }
    import diffusers

    doc["diffusers"] = diffusers.__version__
    print(f"peer: {doc['params']:,} parameters, torch {doc['torch']}, diffusers "
          f"{doc['diffusers']}, {doc['device']}", flush=True)  # fmt: skip

    def over() -> bool:
        return bool(args.deadline) and time.perf_counter() - t0 > args.deadline

    def save() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")

    for size in _ints(args.sizes):
        for steps in _ints(args.steps):
            for batch in _ints(args.batches):
                case = f"eager b{batch} {size} {steps}step"
                if over():
                    doc["skipped"].append(case)
                    continue
                row = measure(peer, batch, size, steps, args.runs, warm=2)
                doc["eager"].append(row)
                print(f"{case}: {row['s_per_image']:.4f} s/image", flush=True)
                save()
    if args.compile:
        peer.compile()
        for size in _ints(args.sizes):
            for batch in _ints(args.compile_batches):
                for steps in _ints(args.steps):
                    case = f"compiled b{batch} {size} {steps}step"
                    if over():
                        doc["skipped"].append(case)
                        continue
                    tc = time.perf_counter()
                    peer.images(batch, size, steps)  # compiles this shape
                    compile_s = time.perf_counter() - tc
                    row = measure(peer, batch, size, steps, args.runs, warm=1)
                    row["first_call_s"] = round(compile_s, 1)
                    doc["compiled"].append(row)
                    print(f"{case}: {row['s_per_image']:.4f} s/image (first call "
                          f"{compile_s:.0f} s)", flush=True)  # fmt: skip
                    save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
