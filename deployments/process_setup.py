"""Process-wide settings of a replica that runs a model step loop (Encoder, Decoder).

Owns: torch's intra-op thread count and the interpreter's GIL switch interval in such a replica.
Does not own the replica's environment variables (those reach the process through the stage's
`env`, see args.py), nor anything of the model.
"""

from __future__ import annotations

import sys

import torch

from deployments.args import StageArgs

# NOTE: the step loop thread shares the GIL with Serve's event-loop threads, which hand every output on.
# With CPython's 5 ms default a waiting thread can wait a whole interval per handoff: on 2 cores a decoder
# replica's first output of a short text prompt took ~125 ms and each next token ~44 ms, against ~95 ms
# and ~30 ms at 0.5 ms (the in-process engine: ~75 ms and ~33 ms). 50 ms was worse still (~135 / ~39 ms).
SWITCH_INTERVAL_S = 0.0005


def configure_step_process(stage: StageArgs) -> None:
    torch.set_num_threads(stage.threads())
    sys.setswitchinterval(SWITCH_INTERVAL_S)
