"""Build a tiny random-weight Gemma 3 checkpoint folder, offline.

Owns: the command line only; every option mirrors a keyword of
`mmserve.models.tiny_checkpoint.build_tiny_gemma3` (so the two never drift apart).
Example: python scripts/make_tiny_gemma3.py --out /tmp/tiny --image-size 224 --mm-tokens 16
"""

from __future__ import annotations

import argparse
import inspect
import sys

from mmserve.models.tiny_checkpoint import build_tiny_gemma3


def _none_or_float(text: str) -> float | None:
    return None if text.lower() == "none" else float(text)


def _none_or_int(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder to write (created if missing)")
    for param in inspect.signature(build_tiny_gemma3).parameters.values():
        if param.kind is not inspect.Parameter.KEYWORD_ONLY:
            continue
        default = param.default
        # NOTE: an optional int or float (a None default, or None in its hint) is typed as int- or float-or-"none"
        hint = {part.strip() for part in str(param.annotation).split("|")}
        optional = default is None or "None" in hint
        kind = (_none_or_int if "int" in hint else _none_or_float) if optional else type(default)
        ap.add_argument(f"--{param.name.replace('_', '-')}", type=kind, default=default,
                        help=f"default: {default}")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = vars(parser().parse_args(argv))
    out = build_tiny_gemma3(args.pop("out"), **args)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
