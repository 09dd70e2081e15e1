"""How image embeddings travel between processes: as numpy arrays, which the Ray object store shares
zero-copy on one node.

Owns: the array a tensor becomes on the way out and the tensor it becomes again on the way in, for
every dtype the stages run in. Does not own the message that carries them (`EncoderOutput`) nor how it
travels.

NOTE: numpy has no bfloat16. A bfloat16 tensor travels as its raw bits in an int16 array (half the
bytes of a float32 copy: Gemma-3-4B's 256 x 2560 embeddings of one image are 1.3 MB instead of 2.6 MB)
and is viewed back as bfloat16 on arrival: the values are the encoder's exactly.
"""

from __future__ import annotations

import numpy as np
import torch

_BITS_OF = {torch.bfloat16: torch.int16}  # torch dtypes numpy lacks -> the same-width integer that carries them


def to_wire(embeddings: list[torch.Tensor]) -> tuple[list[np.ndarray], str]:
    """CPU numpy copies of (num_embeds, hidden) embeddings of one dtype, and that dtype's torch name."""
    dtypes = {e.dtype for e in embeddings}
    if len(dtypes) > 1:
        raise ValueError(f"embeddings of one request must share a dtype, got {sorted(map(str, dtypes))}")
    dtype = dtypes.pop() if dtypes else torch.float32
    bits = _BITS_OF.get(dtype)
    arrays = [(e.detach().cpu().view(bits) if bits is not None else e.detach().cpu()).numpy() for e in embeddings]
    return arrays, str(dtype).removeprefix("torch.")


def from_wire(arrays: list[np.ndarray], dtype: str) -> list[torch.Tensor]:
    """The tensors `to_wire` was given, as writable copies (arrays from the object store are read-only)."""
    wanted = getattr(torch, dtype)
    tensors = [torch.from_numpy(np.array(a)) for a in arrays]
    return [t.view(wanted) for t in tensors] if wanted in _BITS_OF else tensors
