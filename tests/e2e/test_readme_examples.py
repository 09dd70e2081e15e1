"""The README's example requests, read from README.md itself, run as written against the e2e server.

Only the address changes (README: port 8000; the test server: a free port), so README and reality
cannot drift: an example that stops working fails here.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

from tests.e2e.e2e_support import Server
from tests.e2e.serve_process import REPO

README = (REPO / "README.md").read_text()


def _block(language: str, must_contain: str) -> str:
    """The README's first ```language block that contains `must_contain`."""
    for body in re.findall(rf"```{language}\n(.*?)```", README, flags=re.S):
        if must_contain in body:
            return body
    raise AssertionError(f"README has no ```{language} block with {must_contain!r}")


def _at(server: Server, text: str) -> str:
    return text.replace("localhost:8000", f"127.0.0.1:{server.port}").replace(
        "127.0.0.1:8000", f"127.0.0.1:{server.port}")


def test_the_readme_curl_example_answers_200_with_content(e2e_server: Server) -> None:
    command = _block("bash", "/v1/chat/completions")
    assert "data:image/" in command and "https://" not in command  # offline: the image is inline
    command = _at(e2e_server, command).replace("curl -s", "curl -s -w '\\n%{http_code}'", 1)
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    body, status = done.stdout.rsplit("\n", 1)
    assert status == "200", body
    choice = json.loads(body)["choices"][0]
    # NOTE: sampled from random weights, an answer may end its turn at once: then, and only then, empty
    assert choice["message"]["content"] or choice["finish_reason"] == "stop", choice


def test_the_readme_openai_client_example_prints_an_answer(e2e_server: Server) -> None:
    script = _at(e2e_server, _block("python", "from openai import OpenAI"))
    # the README's code as written, then (to stderr) what tells an empty answer from a lost one
    script += "\nimport sys\nprint(reply.choices[0].finish_reason, reply.usage.completion_tokens, file=sys.stderr)\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    reason, tokens = done.stderr.split()[-2:]
    content = done.stdout.removesuffix("\n")  # what the README's print showed
    assert int(tokens) >= 1 and content != "None"
    # NOTE: sampled from random weights, an answer may end its turn at once: then, and only then, empty
    assert content or reason == "stop", (content, reason)
