"""Process-wide settings of a replica that runs a model step loop (Encoder, Decoder), and of every replica
that holds a model's code or files (those and Preprocess).

Owns: torch's intra-op thread count and the interpreter's GIL switch interval in such a replica, where the
engine's own log records go there, and taking what a replica built at start-up out of the cyclic garbage
collector's sight. Does not own the replica's environment variables (those
reach the process through the stage's `env`, see stage_args.py), nor anything of the model.
"""

from __future__ import annotations

import gc
import logging
import sys

import torch

from deployments.stage_args import StageArgs

# NOTE: the step loop thread shares the GIL with Serve's event-loop threads, which hand every output on.
# With CPython's 5 ms default a waiting thread can wait a whole interval per handoff; 0.5 ms cut a
# replica's first output and its per-token time (docs/benchmarks.md).
SWITCH_INTERVAL_S = 0.0005


def configure_step_process(stage: StageArgs) -> None:
    torch.set_num_threads(stage.threads())
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    route_engine_logs()


def route_engine_logs() -> None:
    """mmserve's records from INFO up (the thread counts and matmul forms it measured at start-up) into this
    replica's Serve log, through the handlers Serve gives its documented `ray.serve` logger.

    NOTE: otherwise they reach no handler: Python drops a record below WARNING that only the root logger
    could take, and a replica's root logger has none.
    """
    engine, serve_logger = logging.getLogger("mmserve"), logging.getLogger("ray.serve")
    if not serve_logger.handlers:
        return
    engine.setLevel(logging.INFO)
    for handler in serve_logger.handlers:
        if handler not in engine.handlers:
            engine.addHandler(handler)
    engine.propagate = False  # NOTE: each record once, in Serve's format


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
