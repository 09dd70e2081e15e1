"""Process-wide settings of a replica that runs a model step loop (Encoder, Decoder), and of every replica
that holds a model's code or files (those and Preprocess).

Owns: torch's intra-op thread count and the interpreter's GIL switch interval in such a replica, that its
log records reach its Serve log (replica_logs.py), and taking what a replica built at start-up out of the cyclic garbage
collector's sight. Does not own the replica's environment variables (those
reach the process through the stage's `env`, see stage_args.py), nor anything of the model.
"""

from __future__ import annotations

import gc
import sys

import torch

from deployments.replica_logs import route_logs
from deployments.stage_args import StageArgs

# NOTE: the step loop thread shares the GIL with Serve's event-loop threads, which hand every output on.
# With CPython's 5 ms default a waiting thread can wait a whole interval per handoff; 0.5 ms cut a
# replica's first output and its per-token time (docs/benchmarks.md).
SWITCH_INTERVAL_S = 0.0005


def configure_step_process(stage: StageArgs) -> None:
    torch.set_num_threads(stage.threads())
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    route_logs()  # NOTE: the thread counts and matmul forms measured at start-up are INFO records


def freeze_startup_heap() -> None:
    """Move the objects a replica made while starting (modules, the model's Python objects, the tokenizer) to the
    interpreter's permanent generation, once its stage is built.

    NOTE: a process holding torch, transformers and a loaded model tracks hundreds of thousands of such
    objects, and a full collection over them holds the GIL for a long pause (docs/benchmarks.md): the step
    thread and the event loop stop meanwhile. CPython runs one whenever the objects that outlived collections
    grow by a quarter, which the first requests' caches and buffers do. Frozen, they are never scanned again
    (`gc.freeze`, as vLLM does once its engine has started); what is made while serving is collected as before.
    """
    gc.collect()
    gc.freeze()
