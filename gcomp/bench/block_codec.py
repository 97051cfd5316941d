"""The block-scaled formats' codec speed (``gcomp.compressors.blockfloat.formats``): encode, decode and both, each as a
ratio to a plain copy of the bucket, on one CPU thread, timed interleaved (``timing.median_times``) on the process's
CPU time, so that a loaded shared machine slows every operation alike.

    python -m gcomp.bench.block_codec --size-mb 64 --repeats 5 [--rounding stochastic] [--formats mxfp4 nvfp4]

The bucket is one row (one chunk); the encode and the decode allocate their outputs, as they do in a method.
"""
from __future__ import annotations

import argparse
import time

import torch

from gcomp.bench.timing import median_times
from gcomp.compressors.blockfloat.formats import NAMES, block_format


def run(size_mb: float = 64, repeats: int = 5, rounding: str = "nearest", formats=NAMES) -> list[dict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _rows(size_mb, repeats, rounding, formats)
    finally:
        torch.set_num_threads(threads)


def _rows(size_mb: float, repeats: int, rounding: str, formats) -> list[dict]:
    n = max(128, int(size_mb * 2 ** 20) // 4 // 128 * 128)
    x = torch.randn(1, n, generator=torch.Generator().manual_seed(0))
    dst = torch.empty_like(x)
    generator = torch.Generator().manual_seed(1)
    rows = []
    for name in formats:
        fmt = block_format(name)
        wire, _ = fmt.encode(x, rounding, generator)
        times = median_times({
            "copy": lambda: dst.copy_(x),
            "encode": lambda: fmt.encode(x, rounding, generator),
            "decode": lambda: fmt.decode(wire, n),
        }, repeats, time.process_time)
        copy = times["copy"]
        encode, decode = times["encode"] / copy, times["decode"] / copy
        rows.append({"format": name, "bits": fmt.bits_per_entry, "copy_ms": copy * 1e3,
                     "encode": encode, "decode": decode, "both": encode + decode})  # the columns add up
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| format | bits/entry | encode / copy | decode / copy | encode + decode / copy |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['format']} | {r['bits']:g} | {r['encode']:.2f} | {r['decode']:.2f} | {r['both']:.2f} |"
              for r in rows]
    return "\n".join(lines) + f"\n\n(copy: {rows[0]['copy_ms']:.1f} ms)" if rows else ""


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounding", choices=["nearest", "stochastic"], default="nearest")
    parser.add_argument("--formats", nargs="+", default=list(NAMES))
    args = parser.parse_args(argv)
    print(markdown(run(args.size_mb, args.repeats, args.rounding, args.formats)))


if __name__ == "__main__":
    main()
