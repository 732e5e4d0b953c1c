#!/usr/bin/env python3
"""Writes the seed corpus of frame_decoder_fuzz (tests/fuzz/corpus/frame_decoder/).

Each seed starts with the harness's 5 configuration bytes (see the top of
frame_decoder_fuzz.cpp), followed by the byte stream or, with the STRUCTURED bit, a stream
program. Run it again only when the input layout changes: the fuzzer ignores file names.
"""

import os
import struct
import sys

# Byte 0: limit class (bits 0-2), STRUCTURED (bit 3), DIRECT (bit 4), chunk style (bits 5-7).
TINY, SMALL, AROUND_DIRECT, MIB, DEFAULT, WIRE_MAX, SIZE_MAX, SHIFTED = range(8)
STRUCTURED = 0x08
DIRECT = 0x10


def config(limit_class, param=0, style=1, seed=0x5A, flags=0, stop=None):
    mode = limit_class | flags | (style << 5)
    return bytes([mode, seed]) + struct.pack("<H", param) + bytes([0 if stop is None else 0x80 | stop])


def greeting(major=1, minor=0, max_size=1 << 20, flags=0, magic=b"NIO3"):
    return magic + struct.pack("<HHII", major, minor, max_size, flags)


def frame(body, ftype=1, reserved=b"\0\0\0", length=None):
    return struct.pack("<I", len(body) if length is None else length) + bytes([ftype]) + reserved + body


def op(kind, p=0):
    return bytes([kind | (p << 3)])


SEEDS = {
    # Raw streams, limit 4096.
    "greeting": config(SMALL, 4096) + greeting(),
    "greeting_frames": config(SMALL, 4096, style=5)
    + greeting() + frame(b"hello") + frame(b"") + frame(bytes(range(256)) * 2),
    "zero_length": config(SMALL, 4096, style=0) + greeting() + frame(b"") + frame(b""),
    "over_limit": config(SMALL, 4096) + greeting() + frame(b"", length=4097) + b"x" * 16,
    "truncated_header": config(SMALL, 4096, style=0) + greeting() + frame(b"abc")[:5],
    "truncated_body": config(SMALL, 4096, style=2) + greeting() + frame(b"0123456789" * 10)[:60],
    "bad_magic": config(SMALL, 4096) + greeting(magic=b"NIO2") + frame(b"x"),
    "bad_major": config(SMALL, 4096) + greeting(major=2, minor=7) + frame(b"x"),
    "zero_max": config(SMALL, 4096) + greeting(max_size=0),
    "odd_minor_flags": config(SMALL, 4096) + greeting(minor=9, flags=0xFFFFFFFF) + frame(b"ok"),
    "reserved_nonzero": config(SMALL, 4096) + greeting() + frame(b"x", reserved=b"\0\1\0"),
    "unknown_type": config(SMALL, 4096) + greeting() + frame(b"x", ftype=2),
    "stop_at_greeting": config(SMALL, 4096, stop=0) + greeting() + frame(b"after"),
    "stop_at_second": config(SMALL, 4096, style=1, stop=2)
    + greeting() + frame(b"one") + frame(b"two") + frame(b"three"),
    "stop_at_empty": config(SMALL, 4096, style=0, stop=2)
    + greeting() + frame(b"") + frame(b"") + frame(b"x"),
    "tiny_limit": config(TINY, 3) + greeting() + frame(b"abc") + frame(b"abcd"),
    "limit_zero": config(TINY, 0) + greeting() + frame(b"") + frame(b"a"),
    # 0xFFFFFFFF declared: refused under a small limit, accepted (and never allocated up
    # front) under the wire maximum.
    "len_ffffffff_small": config(SMALL, 4096) + greeting() + frame(b"", length=0xFFFFFFFF),
    "len_ffffffff_wire_max": config(WIRE_MAX, style=1, flags=DIRECT)
    + greeting() + frame(b"", length=0xFFFFFFFF) + b"y" * 200,
    "len_ffffffff_size_max": config(SIZE_MAX, style=2, flags=DIRECT)
    + greeting() + frame(b"", length=0xFFFFFFFF) + b"z" * 100,
    # Stream programs: large messages from a few bytes, with direct reads.
    # greeting; 200 KiB frame; 3 KiB frame; 1.5 MiB frame.
    "big_frames_direct": config(DEFAULT, style=6, flags=STRUCTURED | DIRECT)
    + op(1) + struct.pack("<I", 64 << 20)
    + op(5, 3) + struct.pack("<H", 25600)
    + op(5, 0) + struct.pack("<H", 3072)
    + op(5, 5) + struct.pack("<H", 49152),
    # greeting; header declaring 2 GiB - 64 KiB; 2 MiB of it in pieces.
    "huge_declared_direct": config(WIRE_MAX, style=4, seed=7, flags=STRUCTURED | DIRECT)
    + op(1) + struct.pack("<I", 0xFFFFFFFF)
    + op(3, 15) + struct.pack("<H", 0xFFFE)
    + op(4, 7) + struct.pack("<H", 8191)
    + op(4, 7) + struct.pack("<H", 8191),
    # Right at the direct-read minimum: limit 64 KiB + 16, frames of 64 KiB +- 1.
    "around_direct_min": config(AROUND_DIRECT, 16, style=5, flags=STRUCTURED | DIRECT)
    + op(1) + struct.pack("<I", 1 << 20)
    + op(2) + struct.pack("<I", 65535) + op(4, 0) + struct.pack("<H", 65534)
    + op(2) + struct.pack("<I", 65536) + op(4, 0) + struct.pack("<H", 65535)
    + op(2) + struct.pack("<I", 65537) + op(4, 0) + struct.pack("<H", 65535) + op(0, 0) + b"!",
    # A message completed by a direct read whose callback says stop.
    "stop_in_direct": config(DEFAULT, style=6, seed=12, flags=STRUCTURED | DIRECT, stop=1)
    + op(1) + struct.pack("<I", 1 << 20) + op(5, 3) + struct.pack("<H", 25600)
    + op(5, 0) + struct.pack("<H", 10),
    # Many zero-length frames and small frames cut into header-sized reads.
    "many_small": config(MIB, style=5, flags=STRUCTURED)
    + op(1) + struct.pack("<I", 100) + op(6, 31) + op(5, 0) + struct.pack("<H", 7) + op(6, 3)
    + op(5, 1) + struct.pack("<H", 100),
    # A 96 KiB message followed by a small one: the big buffer must be released.
    "release_big_buffer": config(SHIFTED, 0x400, style=2, flags=STRUCTURED)
    + op(1) + struct.pack("<I", 1 << 20) + op(5, 1) + struct.pack("<H", 49152)
    + op(5, 0) + struct.pack("<H", 10) + op(2) + struct.pack("<I", 70000) + op(7) + b"\x20" + b"p" * 32,
}


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "corpus", "frame_decoder")
    os.makedirs(out, exist_ok=True)
    for name, data in SEEDS.items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
    print(f"{len(SEEDS)} seeds in {out}")


if __name__ == "__main__":
    main()
