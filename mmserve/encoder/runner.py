"""Runs a model's vision encoder over a batch of processed image items.

Owns: turning `ProcessedItem`s (uint8 numpy crops) into one batch on the runner's device,
chunking it to `max_batch_items` crops per forward, splitting the output back per item, and the
counters of what ran. Does not own: the model (it is handed a vision callable, e.g. for Gemma 3
normalize-then-`get_image_features`), the pixels' normalization and dtype, caching, or scheduling.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np
import torch

from mmserve.messages import ProcessedItem
from mmserve.models.base import VisionEncoder  # (n_images, 3, H, W) -> (n_images, mm_tokens, hidden)
from mmserve.runtime.host_copy import to_device
from mmserve.runtime.passing_thread import in_passing_thread
from mmserve.runtime.step_threads import StepThreads

# NOTE: on a CPU a batch of images costs about the same per image as one alone (docs/benchmarks.md,
# "What moved the figures"), so batching there only makes the first image wait for the last.
GPU_BATCH_ITEMS = 16  # crops per forward by default on an accelerator, where batching pays
CPU_BATCH_ITEMS = 1
GPU_BATCH_WAIT_MS = 5.0  # how long the first request waits for company on an accelerator; 0 on a CPU


def batch_wait_s(batch_wait_ms: float | None, device: torch.device) -> float:
    """The encoder's batching window in seconds: the configured one, else by device."""
    if batch_wait_ms is None:
        batch_wait_ms = GPU_BATCH_WAIT_MS if device.type != "cpu" else 0.0
    return batch_wait_ms / 1000


class EncoderRunner:
    def __init__(
        self,
        encode_images: VisionEncoder,
        *,
        device: str | torch.device = "cpu",
        max_batch_items: int | None = None,  # None = by device: GPU_BATCH_ITEMS, CPU_BATCH_ITEMS on a CPU
        passing_forwards: bool = True,  # on a CPU, each forward in a thread of its own (flag)
    ) -> None:
        self.device = torch.device(device)
        if max_batch_items is None:
            max_batch_items = CPU_BATCH_ITEMS if self.device.type == "cpu" else GPU_BATCH_ITEMS
        if max_batch_items < 1:
            raise ValueError(f"max_batch_items must be >= 1, got {max_batch_items}")
        self.encode_images = encode_images
        self.passing_forwards = passing_forwards and self.device.type == "cpu"
        self.threads = StepThreads(self.device)  # the count torch has now, re-applied in whatever thread runs us
        self.max_batch_items = max_batch_items  # crops per vision forward
        self.forward_passes = 0  # vision forwards run
        self.images_encoded = 0  # crops encoded
        self.items_encoded = 0  # items (images) encoded
        self.batch_sizes: Counter[int] = Counter()  # crops per forward -> forwards

    def embed_multimodal(self, items: Sequence[ProcessedItem]) -> list[torch.Tensor]:
        """Encode every crop of every item in as few forwards as allowed.

        Returns one `(n_crops * mm_tokens, hidden)` tensor per item, in order, each with its own
        storage (so dropping one from a cache really frees it).
        """
        if not items:
            return []
        crops, n_crops = _flatten_crops(items)
        # NOTE: on a CPU beside a decoder in the same process, in a passing thread, whose OpenMP pool ends with
        # the forward: a pool kept by the encoder's thread would slow every small step of that decoder
        # (passing_thread.py). A process with no other torch stage (`passing_forwards` off) runs them here, in
        # the stage's own thread: its pool and malloc arena then stay warm from one forward to the next (a new
        # thread each time is handed glibc's arenas in turn, and the first forwards fault theirs in:
        # docs/benchmarks.md).
        per_item = in_passing_thread(lambda: self._encode(crops, n_crops), "mmserve-vision") \
            if self.passing_forwards else self._encode(crops, n_crops)
        if self.device.type == "cuda":
            # NOTE: the forward waited for here: the step's `encoder.forward` is then the forward's time, not its
            # launches', and an error the device raises asynchronously fails this step, whose requests the stage
            # isolates, not the later copy that reads the embeddings (which would wait for the forward anyway)
            torch.cuda.synchronize(self.device)
        self.items_encoded += len(items)
        return per_item  # each (n_crops * mm_tokens, hidden)

    def warm_up(self, image_size: int) -> None:
        """One vision forward of a blank `image_size` crop, read back and not counted.

        NOTE: on an accelerator the first call of each kernel loads it (and cuDNN and cuBLAS start): work that
        would otherwise fall on the first image (and on a new replica's first, under autoscaling)."""
        pixels = torch.zeros((1, 3, image_size, image_size), dtype=torch.uint8)  # (1, 3, H, W), host
        with torch.inference_mode():
            self.encode_images(to_device(pixels, self.device)).cpu()

    def _encode(self, crops: list[np.ndarray], n_crops: list[int]) -> list[torch.Tensor]:
        self.threads.apply(len(crops))
        with torch.inference_mode():
            chunks = [
                self._forward(crops[start : start + self.max_batch_items])
                for start in range(0, len(crops), self.max_batch_items)
            ]
        features = chunks[0] if len(chunks) == 1 else torch.cat(chunks)  # (total, mm_tokens, hidden)
        hidden = features.shape[-1]
        # NOTE: cloned outside inference_mode (under no_grad) so the results are normal tensors:
        # inference tensors would break a decoder that runs with autograd enabled, and cloning
        # gives each item its own storage instead of a view that pins the whole batch.
        with torch.no_grad():
            return [t.reshape(-1, hidden).clone() for t in features.split(n_crops)]

    def _forward(self, crops: list[np.ndarray]) -> torch.Tensor:
        # NOTE: np.stack copies into a fresh writable array, so read-only arrays (zero-copy from
        # the Ray object store) never reach torch.from_numpy, which warns on them.
        batch = torch.from_numpy(np.stack(crops))  # (n, 3, H, W) uint8, host
        # NOTE: moved as uint8 (a quarter of float32's bytes); the vision callable normalizes and casts.
        out = self.encode_images(to_device(batch, self.device))  # (n, mm_tokens, hidden)
        if out.dim() != 3 or out.shape[0] != len(crops):
            raise RuntimeError(
                f"vision callable returned shape {tuple(out.shape)} for {len(crops)} images; "
                "expected (n_images, mm_tokens, hidden)"
            )
        self.forward_passes += 1
        self.images_encoded += len(crops)
        self.batch_sizes[len(crops)] += 1
        return out


def _flatten_crops(items: Sequence[ProcessedItem]) -> tuple[list[np.ndarray], list[int]]:
    """All crops of all items in order (views, no copy) and the crop count of each item."""
    crops: list[np.ndarray] = []
    n_crops: list[int] = []
    for item in items:
        pv = item.pixel_values  # (n_crops, 3, H, W)
        if pv.ndim != 4 or pv.shape[0] < 1:
            raise ValueError(f"pixel_values must be (n_crops >= 1, 3, H, W), got {pv.shape}")
        if crops and pv.shape[1:] != crops[0].shape:
            raise ValueError(f"items of one batch must share crop shape: {pv.shape[1:]} vs {crops[0].shape}")
        crops.extend(pv)
        n_crops.append(pv.shape[0])
    return crops, n_crops
