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
MAX_PNG_CHUNKS = 10_000  # other than IDAT (pixels, however finely an encoder splits them): a few are usual
MAX_TIFF_STRIPS = 65_536  # strips or tiles of the first image: a strip per row of a 4096-row image is 4,096
# The next marker after entropy-coded data: 0xFF then neither a stuffed 0x00 nor a restart marker (RST0-7)
_NEXT_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")
_TIFF_COUNTS = (273, 324)  # StripOffsets, TileOffsets


def check_structure(data: bytes) -> None:
    """Refuse a JPEG, PNG or TIFF whose structure is past the caps; other bytes pass (Pillow judges them)."""
    if data.startswith(b"\xff\xd8"):
        scans, segments = jpeg_markers(data, MAX_JPEG_SCANS + 1, MAX_JPEG_SEGMENTS + 1)
        if scans > MAX_JPEG_SCANS:
            raise MediaError(f"the JPEG has more than {MAX_JPEG_SCANS} scans: a cost to decode, not a picture")
        if segments > MAX_JPEG_SEGMENTS:
            raise MediaError(f"the JPEG has more than {MAX_JPEG_SEGMENTS} segments: a cost to open, not a picture")
    elif data.startswith(b"\x89PNG\r\n\x1a\n") and png_chunks(data, MAX_PNG_CHUNKS + 1) > MAX_PNG_CHUNKS:
        raise MediaError(f"the PNG has more than {MAX_PNG_CHUNKS} chunks besides its pixels: a cost to open, "
                         "not a picture")
    elif data[:4] in (b"II*\x00", b"MM\x00*") and tiff_strips(data) > MAX_TIFF_STRIPS:
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
        if data[i] != 0xFF:  # junk between segments: libjpeg skips to the next 0xFF
            i = data.find(b"\xff", i)
            if i < 0:
                break
            continue
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0xD9:  # end of image
            break
        segments += 1
        i += 2 + int.from_bytes(data[i + 2:i + 4], "big")
        if marker == 0xDA:  # a scan: its header, then entropy-coded data up to the next marker
            scans += 1
            found = _NEXT_MARKER.search(data, i)
            i = found.start() if found else len(data)
    return scans, segments


def png_chunks(data: bytes, most: int) -> int:
    """The chunks of PNG `data` other than IDAT, counted up to `most` (each skipped by its length field)."""
    chunks, i = 0, 8  # after the signature
    while chunks < most and i + 8 <= len(data):
        kind = data[i + 4:i + 8]
        chunks += kind != b"IDAT"
        if kind == b"IEND":
            break
        i += 12 + int.from_bytes(data[i:i + 4], "big")  # length, type, data, CRC
    return chunks


def tiff_strips(data: bytes) -> int:
    """The strips (or tiles) of the first image of TIFF `data`: the count of its offsets field; 0 if unread."""
    order = "<" if data[:2] == b"II" else ">"
    try:
        (ifd,) = struct.unpack_from(f"{order}I", data, 4)
        (entries,) = struct.unpack_from(f"{order}H", data, ifd)
        for k in range(entries):
            tag, _, count = struct.unpack_from(f"{order}HHI", data, ifd + 2 + 12 * k)
            if tag in _TIFF_COUNTS:
                return int(count)
    except struct.error:  # a header cut short: Pillow refuses it
        return 0
    return 0
