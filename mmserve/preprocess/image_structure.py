"""A container's structure read before Pillow opens it, refusing what costs far more to open or decode than
its bytes suggest.

Owns: walking a JPEG's markers (its scans and segments), a PNG's chunks and a TIFF's strips or tiles, and the
caps on each. Every refusal is a `MediaError`. Does not own decoding, the formats accepted, or the pixel cap
(`image_decode.py`).

NOTE: Pillow's own opening is linear in these counts and holds the GIL: a file of 20 MiB made of empty JPEG
segments, PNG chunks or one-row TIFF strips took tens of seconds and gigabytes to open on our 2-vCPU VM, and a
progressive JPEG is decoded scan by scan, each a pass over every coefficient (docs/reliability.md). Real
pictures come nowhere near the caps.
"""

from __future__ import annotations

import re
import struct

from mmserve.errors import MediaError

# NOTE: encoders write about 10 scans; libjpeg-turbo's djpeg has -maxscans for this.
MAX_JPEG_SCANS = 100
MAX_JPEG_SEGMENTS = 1000  # markers of the first image: a photo's EXIF, ICC and tables are a few dozen
MAX_PNG_CHUNKS = 10_000  # other than pixels and frames (IDAT, fdAT, fcTL: however finely split): a few are usual
MAX_PNG_ALL_CHUNKS = 200_000  # all of them: an 8 KiB IDAT each is 1.6 GB; empty ones cost Pillow to read too
MAX_JPEG_PADDING = 1 << 20  # bytes between a JPEG's segments (fill bytes, junk): Pillow reads them one by one
MAX_TIFF_STRIPS = 65_536  # strips or tiles of the first image: a strip per row of a 4096-row image is 4,096
# The next marker after entropy-coded data: 0xFF then neither a stuffed 0x00 nor a restart marker (RST0-7)
_NEXT_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")
_MARKER_START = re.compile(rb"\xff[^\xff\x00]")  # the next marker among bytes that are none: its last 0xFF
_TIFF_COUNTS = (273, 324)  # StripOffsets, TileOffsets: Pillow takes the strips where both are given
_PNG_PIXELS = (b"IDAT", b"fdAT", b"fcTL")  # an image's and an animation's pixels, and its frames' headers
# Every header Pillow opens as TIFF (its PREFIXES); it reads the byte order from the first two bytes and takes
# the file for a BigTIFF when the third is 43 ("+"), whatever the order
_TIFF_HEADERS = (b"II*\x00", b"MM\x00*", b"II\x00*", b"MM*\x00", b"II+\x00", b"MM\x00+")
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD9)})  # markers without a length: TEM, RST0-7, SOI


def check_structure(data: bytes) -> None:
    """Refuse a JPEG, PNG or TIFF whose structure is past the caps; other bytes pass (Pillow judges them)."""
    if data.startswith(b"\xff\xd8"):
        scans, segments = jpeg_markers(data, MAX_JPEG_SCANS + 1, MAX_JPEG_SEGMENTS + 1)
        if scans > MAX_JPEG_SCANS:
            raise MediaError(f"the JPEG has more than {MAX_JPEG_SCANS} scans: a cost to decode, not a picture")
        if segments > MAX_JPEG_SEGMENTS:
            raise MediaError(f"the JPEG has more than {MAX_JPEG_SEGMENTS} segments: a cost to open, not a picture")
        if jpeg_padding(data) > MAX_JPEG_PADDING:
            raise MediaError(f"the JPEG has more than {MAX_JPEG_PADDING} bytes between its segments: a cost to "
                             "open, not a picture")
    elif data.startswith(b"\x89PNG\r\n\x1a\n"):
        other, every = png_chunks(data, MAX_PNG_CHUNKS + 1, MAX_PNG_ALL_CHUNKS + 1)
        if other > MAX_PNG_CHUNKS or every > MAX_PNG_ALL_CHUNKS:
            raise MediaError(f"the PNG has more than {MAX_PNG_CHUNKS} chunks besides its pixels and frames, or "
                             f"{MAX_PNG_ALL_CHUNKS} in all: a cost to open, not a picture")
    elif data[:4] in _TIFF_HEADERS and tiff_strips(data) > MAX_TIFF_STRIPS:
        raise MediaError(f"the TIFF has more than {MAX_TIFF_STRIPS} strips or tiles: a cost to open, not a picture")


def jpeg_markers(data: bytes, most_scans: int, most_segments: int) -> tuple[int, int]:
    """(scans, segments) of the first image in JPEG `data`, each counted up to its `most`.

    NOTE: the markers are walked (segments skipped by their length, entropy-coded data to the next marker) up to
    the first image's end: a byte pair 0xFF 0xDA may also sit inside an EXIF segment or in data appended after
    the image (a phone's motion photo appends a video). Bytes between segments that are no marker are skipped
    to the next 0xFF, as libjpeg does: a stray byte must not end the count while the decoder reads on.
    """
    scans = segments = 0
    i = 2  # after the start-of-image marker
    while scans < most_scans and segments < most_segments and i + 4 <= len(data):
        if data[i] != 0xFF or data[i + 1] in (0xFF, 0x00):  # junk or fill bytes between segments: skipped, as
            found = _MARKER_START.search(data, i + 1)  # libjpeg does (0xFF 0x00 is no marker either)
            if found is None:
                break
            i = found.start()
            continue
        marker = data[i + 1]
        if marker == 0xD9:  # end of image
            break
        segments += 1
        if marker in _STANDALONE:  # no length follows
            i += 2
            continue
        i += 2 + int.from_bytes(data[i + 2:i + 4], "big")
        if marker == 0xDA:  # a scan: its header, then entropy-coded data up to the next marker
            scans += 1
            found = _NEXT_MARKER.search(data, i)
            i = found.start() if found else len(data)
    return scans, segments


def jpeg_padding(data: bytes) -> int:
    """Bytes of JPEG `data` between its segments (fill bytes and junk), up to its first scan's data."""
    padding, i = 0, 2
    while i + 4 <= len(data) and padding <= MAX_JPEG_PADDING:
        if data[i] != 0xFF or data[i + 1] in (0xFF, 0x00):  # junk, or fill bytes
            found = _MARKER_START.search(data, i + 1)
            end = found.start() if found is not None else len(data)
            padding += end - i
            i = end
            continue
        if data[i + 1] in (0xD9, 0xDA):  # the end, or a scan: Pillow's opening stops at the first
            break
        i += 2 if data[i + 1] in _STANDALONE else 2 + int.from_bytes(data[i + 2:i + 4], "big")
    return padding


def png_chunks(data: bytes, most: int, most_all: int) -> tuple[int, int]:
    """(chunks other than pixels and frames, all chunks) of PNG `data`, counted up to `most` and `most_all`."""
    other = every = 0
    i = 8  # after the signature
    while other < most and every < most_all and i + 8 <= len(data):
        kind = data[i + 4:i + 8]
        every += 1
        other += kind not in _PNG_PIXELS
        if kind == b"IEND":
            break
        i += 12 + int.from_bytes(data[i:i + 4], "big")  # length, type, data, CRC
    return other, every


def tiff_strips(data: bytes) -> int:
    """The strips (or tiles) of the first image of TIFF `data` (classic or BigTIFF): the count of its
    StripOffsets field, else of its TileOffsets; 0 if unread."""
    order, big = "<" if data[:2] == b"II" else ">", data[2] == 43
    ifd_at, count_of, entry, size = ("Q", "Q", "HHQ", 20) if big else ("I", "H", "HHI", 12)
    counts: dict[int, int] = {}
    try:
        (ifd,) = struct.unpack_from(f"{order}{ifd_at}", data, 8 if big else 4)
        (entries,) = struct.unpack_from(f"{order}{count_of}", data, ifd)
        first = ifd + struct.calcsize(count_of)
        for k in range(min(entries, (len(data) - first) // size)):  # NOTE: never more entries than bytes
            tag, _, count = struct.unpack_from(f"{order}{entry}", data, first + size * k)
            if tag in _TIFF_COUNTS:
                counts[tag] = int(count)
    except (struct.error, OverflowError):  # a header cut short, or an offset past any file: Pillow refuses it
        return 0
    return next((counts[tag] for tag in _TIFF_COUNTS if tag in counts), 0)
