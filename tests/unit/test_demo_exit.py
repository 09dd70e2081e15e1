"""`python -m mmserve` and a library user's script end cleanly: exit 0, no step thread left inside torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ABORT = "terminate called"  # what libstdc++ prints when a thread outlives the interpreter's teardown


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parents[2])


def test_the_demo_prints_its_answer_and_exits_0(tiny_ckpt_224: Path) -> None:
    done = _run(["-m", "mmserve", "--model", str(tiny_ckpt_224), "--max-tokens", "6"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert ABORT not in done.stderr
    assert "[finish_reason=length prompt_tokens=" in done.stdout and "completion_tokens=6]" in done.stdout
    assert "EngineStats(" in done.stdout


def test_an_engine_never_shut_down_still_exits_0(tiny_ckpt_224: Path) -> None:
    script = textwrap.dedent(f"""
        from mmserve.engine import Engine
        from mmserve.messages import ChatRequest, SamplingParams
        engine = Engine.from_model_dir({str(tiny_ckpt_224)!r})
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        [out] = engine.generate([ChatRequest("r", [{{"role": "user", "content": "Hi"}}], params)])
        print("tokens", len(out.token_ids))
        assert engine.decoder_service.loop._thread.is_alive()  # left running: the exit hook must stop it
    """)
    done = _run(["-c", script])
    assert done.returncode == 0, done.stderr[-2000:]
    assert ABORT not in done.stderr and "tokens 3" in done.stdout
