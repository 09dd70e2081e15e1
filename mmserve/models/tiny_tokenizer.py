"""The tokenizer and processor files of the tiny Gemma 3 checkpoint, built offline.

Owns: a small Gemma-style BPE tokenizer trained locally on a fixed corpus (the real special tokens, "\n"
runs as ordinary tokens), its tokenizer_config.json laid out like the real one, the processor configs,
and the verbatim Gemma 3 chat template. Does not own: the model config or weights (`tiny_checkpoint.py`).
Nothing here touches the network.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>",
                  "<start_of_image>", "<end_of_image>", "<image_soft_token>")
MAX_NEWLINE_RUN = 31  # the real vocabulary has "\n" * 1..31 as ordinary tokens

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A small cat sat on the warm mat by the door.
What is in this image? Describe the picture in one sentence. The photo shows a red car parked on a street.
There are two people walking along the beach at sunset, and the sky is orange, pink and purple.
Please answer the question about the image. How many apples are on the table? I can see three green apples.
The chart compares sales in January, February and March; the blue bar is the highest of all.
A large white building stands behind a row of tall trees, with mountains far away in the background.
Hello! How can I help you today? Thank you for your question, here is a short and helpful answer.
You are a helpful assistant. Answer briefly and clearly, and say when you are not sure about something.
The model reads text and images, then writes an answer one token at a time until it reaches the end.
In the kitchen there is a wooden table, four chairs, a bowl of fruit and a cup of hot coffee.
A dog with brown fur is running through the green grass in a park, chasing a yellow ball.
This document explains how to install the software, start the server and send a first request.
The user and the model take turns; the system prompt goes in the first user turn of the chat.
Letters: A B C D E F G H I J K L M N O P Q R S T U V W X Y Z and a b c d e f g h i j k l m n o p q r s t u v w x y z.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 12 16 32 64 100 224 256 896 1000 2024 2025.
Questions like "where", "when", "which", "who" and "why" ask for different kinds of information.
The weather today is sunny with a few clouds, and tomorrow it will rain in the morning.
"""


def _corpus() -> list[str]:
    runs = ["\n" * n for n in range(1, MAX_NEWLINE_RUN + 1)]
    return _CORPUS.splitlines(keepends=True) * 3 + runs * 2 + ["\n\n".join(_CORPUS.split(". "))]


def _train_bpe(n_tokens: int) -> tuple[list[str], list[tuple[str, str]]]:
    """Train a byte-fallback BPE over the corpus; return its vocabulary (in id order) and merges."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "▁")
    # NOTE: training splits words at "▁" and isolates newline runs, so no merge crosses a word or a
    # newline run; GemmaTokenizer then encodes whole strings with these merges and segments the same way.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split("▁", "merged_with_next"), pre_tokenizers.Split(Regex("\n+"), "isolated"),
    ])
    tok.train_from_iterator(_corpus(), trainers.BpeTrainer(vocab_size=n_tokens, show_progress=False))
    model = json.loads(tok.to_str())["model"]
    return list(model["vocab"]), [tuple(m) for m in model["merges"]]


def build_tokenizer(vocab_size: int) -> Any:
    """A GemmaTokenizer: Gemma's special tokens, 256 byte tokens, then the trained BPE pieces."""
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    pieces, merges = _train_bpe(vocab_size - len(SPECIAL_TOKENS) - len(byte_tokens))
    vocab: dict[str, int] = {}
    for token in (*SPECIAL_TOKENS, *byte_tokens, *pieces):
        vocab.setdefault(token, len(vocab))
    # NOTE: the hint says list[str], but the BPE backend takes (left, right) tuples
    tok = GemmaTokenizer(vocab=vocab, merges=cast(Any, merges), add_bos_token=True, add_eos_token=False)
    tok.add_special_tokens({"extra_special_tokens": list(SPECIAL_TOKENS[5:])})
    return tok


def special_token_ids(tok: Any) -> dict[str, int]:
    names = ("pad", "eos", "bos", "unk", "mask", "start_of_turn", "end_of_turn", "boi", "eoi", "image")
    return {n: tok.convert_tokens_to_ids(t) for n, t in zip(names, SPECIAL_TOKENS, strict=True)}


def save_tokenizer(tok: Any, out: Path) -> None:
    """Write tokenizer.json and a tokenizer_config.json laid out like the real Gemma 3 one."""
    tok.backend_tokenizer.save(str(out / "tokenizer.json"))
    added = {
        str(tok.convert_tokens_to_ids(t)): {"content": t, "lstrip": False, "normalized": False,
                                            "rstrip": False, "single_word": False, "special": True}
        for t in SPECIAL_TOKENS
    }
    config = {
        "add_bos_token": True, "add_eos_token": False, "added_tokens_decoder": added,
        "boi_token": "<start_of_image>", "bos_token": "<bos>", "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False, "eoi_token": "<end_of_image>", "eos_token": "<eos>",
        # NOTE: Gemma3Processor reads tokenizer.boi_token / eoi_token / image_token (+ _id); the dict
        # form of extra_special_tokens is what turns them into tokenizer attributes on load.
        "extra_special_tokens": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                 "image_token": "<image_soft_token>"},
        "image_token": "<image_soft_token>", "mask_token": "<mask>", "model_max_length": int(1e30),
        "pad_token": "<pad>", "processor_class": "Gemma3Processor",
        "spaces_between_special_tokens": False, "tokenizer_class": "GemmaTokenizer", "unk_token": "<unk>",
    }
    write_json(out / "tokenizer_config.json", config)
    write_json(out / "special_tokens_map.json", {
        "boi_token": "<start_of_image>", "bos_token": "<bos>", "eoi_token": "<end_of_image>",
        "eos_token": "<eos>", "image_token": "<image_soft_token>", "pad_token": "<pad>", "unk_token": "<unk>",
    })


def save_processor_configs(out: Path, *, image_size: int, mm_tokens: int) -> None:
    """processor_config.json, preprocessor_config.json and chat_template.json, as in the real repo."""
    write_json(out / "processor_config.json", {"image_seq_length": mm_tokens,
                                                "processor_class": "Gemma3Processor"})
    write_json(out / "preprocessor_config.json", {
        "do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None, "do_rescale": True,
        "do_resize": True, "image_mean": [0.5, 0.5, 0.5], "image_processor_type": "Gemma3ImageProcessor",
        "image_seq_length": mm_tokens, "image_std": [0.5, 0.5, 0.5], "pan_and_scan_max_num_crops": None,
        "pan_and_scan_min_crop_size": None, "pan_and_scan_min_ratio_to_activate": None,
        "processor_class": "Gemma3Processor", "resample": 2, "rescale_factor": 1 / 255,
        "size": {"height": image_size, "width": image_size},
    })
    write_json(out / "chat_template.json", {"chat_template": CHAT_TEMPLATE})


def write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


# NOTE: the verbatim chat template of google/gemma-3-*-it (newlines inside the string literals are real
# newline characters there too). The system message is folded into the first user turn.
CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""
