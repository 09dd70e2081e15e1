"""The seeded workloads and the requests of one benchmark cell.

Owns: what a request asks (prompt text of ~50 tokens, its images, pan-and-scan or not), as plain
data that every system turns into its own call; seeds derive from (run seed, workload, concurrency,
index), so two systems in one run, or two runs with one seed, send identical requests.
Does not own how a request is sent (systems.py, inprocess.py).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

WORKLOADS = ("unique", "hot", "multi", "text", "multiturn")
TURNS = 3  # turns of a `multiturn` chat: each re-sends the history, its image included
MAX_TOKENS = 32  # output tokens per request, forced (ignore_eos / min_new_tokens)
PROMPT_TOKENS = 50  # text tokens of the user's prompt (the tiny checkpoint's tokenizer)
HOT_SET = 3  # images the hot workload reuses
HOT_SHARE = 0.9  # fraction of hot requests that reuse one of them

_WORD_TEXT = (
    "the quick brown fox jumps over lazy dog small cat sat on warm mat by door what is in this image "
    "describe picture one sentence photo shows red car parked street there are two people walking along "
    "beach at sunset and sky orange pink purple please answer question about how many apples table can "
    "see three green chart compares sales january february march blue bar highest of all large white "
    "building stands behind row tall trees with mountains far away background hello help you today thank "
    "for your here short helpful model reads text images then writes time until it reaches end kitchen "
    "wooden four chairs bowl fruit cup hot coffee brown fur running through grass park chasing yellow "
    "ball weather sunny"
)
_WORDS = _WORD_TEXT.split()


@dataclass(frozen=True)
class ImageSpec:
    seed: int
    width: int = 1024
    height: int = 768
    fmt: str = "JPEG"  # "JPEG" | "PNG"


@dataclass(frozen=True)
class BenchRequest:
    key: str  # unique within a run, e.g. "unique/c4/7"
    text: str  # the user's prompt (~PROMPT_TOKENS tokens)
    images: tuple[ImageSpec, ...] = ()
    pan_and_scan: bool = False
    max_tokens: int = MAX_TOKENS
    # earlier turns of its chat, (question, answer) each; the images belong to the first question
    history: tuple[tuple[str, str], ...] = ()


def _seed(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:4], "little")


def prompt_text(seed: int, tokenizer, n_tokens: int = PROMPT_TOKENS) -> str:
    """Random words from the tokenizer's own corpus until the text is `n_tokens` tokens long."""
    rng = random.Random(seed)
    words: list[str] = []
    while len(tokenizer(" ".join(words), add_special_tokens=False)["input_ids"]) < n_tokens:
        words.append(rng.choice(_WORDS))
    return " ".join(words).capitalize() + "?"


def cell_requests(workload: str, concurrency: int, n: int, run_seed: int, tokenizer) -> list[BenchRequest]:
    """The `n` requests of one (workload, concurrency) cell, in the order they are sent."""
    if workload == "multiturn":
        return _chat_turns(concurrency, n, run_seed, tokenizer)
    rng = random.Random(_seed(run_seed, workload, concurrency))
    # NOTE: each cell its own hot images: a cell that reused the last cell's found them in mmserve's caches
    # already (and in no cache of a server that has none), so a cell's figure hung on the cells run before it
    hot = [ImageSpec(_seed(run_seed, "hot-image", concurrency, k)) for k in range(HOT_SET)]
    out = []
    for i in range(n):
        key = f"{workload}/c{concurrency}/{i}"
        text = prompt_text(_seed(run_seed, key, "prompt"), tokenizer)
        fresh = _seed(run_seed, key, "image")
        if workload == "text":
            images: tuple[ImageSpec, ...] = ()
        elif workload == "unique":
            images = (ImageSpec(fresh),)
        elif workload == "hot":
            images = (rng.choice(hot),) if rng.random() < HOT_SHARE else (ImageSpec(fresh),)
        elif workload == "multi":
            # one square photo (no crops) and two wide ones (2 crops each with pan-and-scan)
            images = (ImageSpec(fresh, 1024, 1024), ImageSpec(fresh + 1, 1536, 640),
                      ImageSpec(fresh + 2, 1600, 640, "PNG"))
        else:
            raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")
        out.append(BenchRequest(key, text, images, pan_and_scan=workload == "multi"))
    return out


def _chat_turns(concurrency: int, n: int, run_seed: int, tokenizer) -> list[BenchRequest]:
    """`n` requests of 3-turn chats over one image each, turn by turn: a round's chats send turn 1, then
    turn 2 with the history, then turn 3. The assistant's earlier answers are fixed text (the same for
    every system), as a client would re-send what it was told."""
    out: list[BenchRequest] = []
    chats = -(-n // TURNS)
    for first in range(0, chats, concurrency):
        members = range(first, min(first + concurrency, chats))
        for turn in range(TURNS):
            for chat in members:
                if len(out) == n:
                    return out
                key = f"multiturn/c{concurrency}/{chat}/t{turn}"
                qa = [(prompt_text(_seed(run_seed, key[:key.rindex("/")], t, "q"), tokenizer),
                       prompt_text(_seed(run_seed, key[:key.rindex("/")], t, "a"), tokenizer, 32))
                      for t in range(turn + 1)]
                image = ImageSpec(_seed(run_seed, "chat-image", concurrency, chat))
                out.append(BenchRequest(key, qa[-1][0], (image,), history=tuple(qa[:-1])))
    return out


def probe_requests(run_seed: int, tokenizer, n: int, tag: str, image: bool = True) -> list[BenchRequest]:
    """Single-image (or text-only) requests with images no workload uses, keyed `probe-<tag>/<i>`."""
    return [BenchRequest(f"probe-{tag}/{i}", prompt_text(_seed(run_seed, tag, i, "prompt"), tokenizer),
                         (ImageSpec(_seed(run_seed, tag, i, "image")),) if image else ()) for i in range(n)]


def openai_messages(req: BenchRequest, data_url) -> list[dict]:
    """OpenAI chat messages: the images first, then the first question; the chat's earlier answers and
    questions; the prompt last. `data_url(spec)` gives each URL."""
    questions = [q for q, _ in req.history] + [req.text]
    parts: list[dict] = [{"type": "image_url", "image_url": {"url": data_url(s)}} for s in req.images]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": questions[0]}]}]
    for (_, answer), question in zip(req.history, questions[1:], strict=True):
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": question}]
    return messages
