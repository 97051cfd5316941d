"""PacTrain's codec speed: mask-pack and the ternary path, part by part, against a plain copy of the bucket (one
rank, no network). ``gcomp bench --codec`` (``codec_table.py``) compares every method as a whole.

    python -m gcomp.bench.pactrain_codec --sizes-mb 1 4 16 64 --ratio 0.5 --dtype float32 --world 4 --threads 1

Each bucket is synthetic but laid out like a pruned model: conv kernels (one of them channels_last) and weight
matrices pruned unstructured at random at ``ratio``, with small dense biases between them. Timed side by side,
interleaved within every repeat (the order rotates) and reported as medians, so that a noisy shared machine
slows every operation alike:

- copy: ``dst.copy_(bucket)``, the floor every codec is compared with;
- maskpack: ``SupportIndex.gather`` into a preallocated packed buffer (encode), ``scatter`` back (decode);
- naive: ``index_select`` with int64 positions, then ``zero_().index_copy_`` (the obvious reference);
- ternary: the real ``PacTrainCompressor`` (compress, ternarise, decompress) with the collectives left out, so
  the lanes it decodes are its own; and its parts, timed alike, to show what dominates.

Times are the process's CPU time by default (with one thread): on a loaded shared machine wall time mostly
measures who else held the core. Peak extra memory of a step (bytes allocated beyond the bucket and the
preallocated buffers, at the worst moment) comes from the profiler's CPU allocation events, as a fraction of
the bucket's bytes. ``run`` returns the rows (dicts) for other tools; ``markdown`` prints them.
"""
from __future__ import annotations

import argparse
import time
from typing import Sequence

import torch

from gcomp.bench.allocations import peak_extra_bytes
from gcomp.bench.timing import median_times
from gcomp.bucket import BucketInfo
from gcomp.compressors.pactrain import PacTrainCompressor
from gcomp.packing.support import SupportIndex, bucket_support
from gcomp.packing.tracker import PACKED, BucketTrack, MaskTracker

# (weight shape, channels_last) of the layers a synthetic bucket cycles through, each followed by its bias.
LAYERS = (((128, 64, 3, 3), True), ((256, 128, 3, 3), False), ((512, 512), False), ((64, 64, 3, 3), False),
          ((1024, 256), False))
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
TERNARY_PARTS = ("gather", "scales", "codes", "pack", "unpack", "scatter")


def synthetic_bucket(numel: int, ratio: float, dtype: torch.dtype, generator: torch.Generator):
    """A flat gradient bucket of ``numel`` entries, zero where pruned, with its parameter list for
    ``bucket_support`` (size, strides, mask) and its parameters' sizes."""
    params, left, i = [], numel, 0
    while left:
        shape, channels_last = LAYERS[i % len(LAYERS)]
        i += 1
        size, bias = torch.Size(shape), shape[0]
        if size.numel() + bias > left:  # the tail: one flat pruned parameter
            size, channels_last, bias = torch.Size([left]), False, 0
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        stride = torch.empty(size, device="meta", memory_format=fmt).stride()
        params.append((size, stride, torch.rand(size, generator=generator) >= ratio))
        if bias:
            params.append((torch.Size([bias]), (1,), None))
        left -= size.numel() + bias
    support = bucket_support(params, numel)
    bucket = torch.randn(numel, generator=generator).mul_(support).to(dtype)
    return bucket, support, params


def _compressor(support: SupportIndex, dtype: torch.dtype, numels, world: int):
    """A ternary PacTrainCompressor whose tracker holds ``support`` already frozen (packed), as after warm-up."""
    compressor = PacTrainCompressor(ternary=True)
    compressor.bind(None, None, {})
    compressor.world_size = world  # the lane width of ``world`` ranks, without their processes
    info = BucketInfo.from_layout(0, dtype, [f"p{j}" for j in range(len(numels))], numels)
    track = compressor.tracker.tracks[info.key] = BucketTrack(mode=PACKED, support=support)
    _no_change(track)
    return compressor, info


def _no_change(track: BucketTrack) -> None:
    """Receive "no rank's masks changed", as a packed step does, so that the next step stays packed."""
    MaskTracker.receive_changed(track, torch.zeros(1))


def _ternary_parts(compressor: PacTrainCompressor, info: BucketInfo, bucket, out) -> dict:
    """The steps of the ternary path, each a callable running the compressor's codec's own part (see
    ``gcomp.compressors.pactrain_ternary``), on the track's support and state; each reads what the one before
    left."""
    codec, track, s = compressor.codec, compressor.tracker.tracks[info.key], {}
    support, state = track.support, track.state

    def gather():
        codec.gather_values(support, state, bucket)

    def scales():
        s["scales"] = codec.local_scales(support, state)

    def codes():
        s["codes"] = codec.draw_codes(support, state, s["scales"][:-2])

    def pack():
        s["lanes"] = codec.pack(s["codes"])

    def unpack():
        s["decoded"] = codec.decode_values(support, state, s["scales"][:-2], s["scales"][-1], s["lanes"])

    def scatter():
        track.support.scatter(s["decoded"].to(out.dtype), out)

    return dict(zip(TERNARY_PARTS, (gather, scales, codes, pack, unpack, scatter)))


def measure(size_mb: float, ratio: float, dtype: torch.dtype, world: int, repeats: int, seed: int = 0,
            clock: str = "cpu") -> dict:
    """One row of the benchmark: a bucket of ``size_mb`` MB (in its own dtype) pruned at ``ratio``."""
    elt = torch.empty((), dtype=dtype).element_size()
    numel = max(1, int(size_mb * 2**20) // elt)
    bucket, support_bool, params = synthetic_bucket(numel, ratio, dtype, torch.Generator().manual_seed(seed))
    numels = [size.numel() for size, _, _ in params]
    support = SupportIndex(support_bool, tuple(numels))
    kept = support.kept
    dst, out, naive_out = torch.empty_like(bucket), torch.empty_like(bucket), torch.empty_like(bucket)
    packed = bucket.new_empty(kept + 1)  # as the compressor's: one more entry counts ranks whose masks changed
    idx64 = support_bool.nonzero().reshape(-1)

    def naive():
        naive_out.zero_().index_copy_(0, idx64, torch.index_select(bucket, 0, idx64))

    # Correctness first: mask-pack must give exactly what the naive reference gives.
    support.gather(bucket, packed)
    support.scatter(packed, out)
    naive()
    exact = bool(torch.equal(packed[:kept], bucket[idx64]) and torch.equal(out, naive_out)
                 and torch.equal(out, bucket))

    compressor, info = _compressor(support, dtype, numels, world)

    def ternary():
        payload = compressor.compress(bucket, info)
        if compressor.chained(payload):  # the first packed step; one round (the scale carried) from then on
            compressor.second_round(payload)
        payload.ctx.bucket = out  # decode elsewhere: the bucket stays every step's input
        return compressor.decompress(payload.tensors, payload.ctx)

    wire_ternary = compressor.compress(bucket, info).nbytes
    _no_change(compressor.tracker.tracks[info.key])
    parts = _ternary_parts(compressor, info, bucket, out)
    ops = {"copy": lambda: dst.copy_(bucket), "encode": lambda: support.gather(bucket, packed),
           "decode": lambda: support.scatter(packed, out), "naive": naive, "ternary": ternary}
    ops.update({f"t_{name}": fn for name, fn in parts.items()})
    t = median_times(ops, repeats, CLOCKS[clock])

    ms = {name: 1e3 * v for name, v in t.items()}
    maskpack = ms["encode"] + ms["decode"]
    bucket_bytes = numel * elt
    row = {"size_mb": size_mb, "dtype": str(dtype).removeprefix("torch."), "clock": clock, "numel": numel,
           "kept": kept, "params": len(params), "pieces": len(support.pieces), "exact": exact,
           "copy_ms": ms["copy"], "encode_ms": ms["encode"], "decode_ms": ms["decode"], "maskpack_ms": maskpack,
           "maskpack_x": maskpack / ms["copy"], "naive_ms": ms["naive"], "naive_x": ms["naive"] / ms["copy"],
           "ternary_ms": ms["ternary"], "ternary_x": ms["ternary"] / ms["copy"],
           "index_frac": support.index_bytes / bucket_bytes,
           "wire_packed_bpe": (kept + 1) * elt / numel, "wire_ternary_bpe": wire_ternary / numel}
    row.update({f"t_{name}_ms": ms[f"t_{name}"] for name in TERNARY_PARTS})
    for name, fn in (("maskpack", lambda: (support.gather(bucket, packed), support.scatter(packed, out))),
                     ("naive", naive), ("ternary", ternary)):
        row[f"mem_{name}_frac"] = peak_extra_bytes(fn) / bucket_bytes
    return row


def run(sizes_mb: Sequence[float] = (1, 4, 16, 64), ratio: float = 0.5, dtype: torch.dtype | str = torch.float32,
        world: int = 4, repeats: int = 11, seed: int = 0, clock: str = "auto") -> list[dict]:
    """One row per bucket size (see ``measure``); torch's thread count is left as the caller set it.

    ``clock``: "cpu" (this process's CPU time: on a loaded shared machine it leaves out the time other
    processes held the core; right for one thread only, since it adds up all threads), "wall", or "auto"
    (cpu with one torch thread, else wall).
    """
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if clock == "auto":
        clock = "cpu" if torch.get_num_threads() == 1 else "wall"
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {sorted(CLOCKS)} or auto; got {clock!r}")
    return [measure(size, ratio, dtype, world, repeats, seed, clock) for size in sizes_mb]


def markdown(rows: list[dict]) -> str:
    """The rows as two Markdown tables: speed and wire size, then the ternary breakdown and memory."""
    def table(header, lines):
        return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                         + ["| " + " | ".join(line) + " |" for line in lines])

    speed = table(
        ["size MB", "copy ms", "maskpack ms (enc + dec)", "maskpack / copy", "naive / copy", "ternary ms",
         "ternary / copy", "index / bucket", "wire B/elt packed", "wire B/elt ternary", "exact"],
        [[f"{r['size_mb']:g}", f"{r['copy_ms']:.3f}",
          f"{r['maskpack_ms']:.3f} ({r['encode_ms']:.3f} + {r['decode_ms']:.3f})", f"{r['maskpack_x']:.2f}",
          f"{r['naive_x']:.2f}", f"{r['ternary_ms']:.3f}", f"{r['ternary_x']:.2f}", f"{r['index_frac']:.3f}",
          f"{r['wire_packed_bpe']:.3f}", f"{r['wire_ternary_bpe']:.3f}", "yes" if r["exact"] else "NO"]
         for r in rows])
    parts = table(
        ["size MB", "gather ms", "scales ms", "rand + codes ms", "pack ms", "unpack + scale ms", "scatter ms",
         "sum of parts / copy", "peak extra mem / bucket: maskpack", "naive", "ternary"],
        [[f"{r['size_mb']:g}"] + [f"{r[f't_{p}_ms']:.3f}" for p in TERNARY_PARTS]
         + [f"{sum(r[f't_{p}_ms'] for p in TERNARY_PARTS) / r['copy_ms']:.2f}"]
         + [f"{r[f'mem_{m}_frac']:.2f}" for m in ("maskpack", "naive", "ternary")]
         for r in rows])
    return speed + "\n\n" + parts


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gcomp.bench.pactrain_codec", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--ratio", type=float, default=0.5, help="fraction of each weight pruned")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--world", type=int, default=4, help="ranks the ternary lanes are sized for")
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clock", default="auto", choices=["auto", "cpu", "wall"],
                        help="process CPU time or wall time (auto: cpu with one thread)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = run(args.sizes_mb, args.ratio, args.dtype, args.world, args.repeats, args.seed, args.clock)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.dtype}, ratio {args.ratio}, "
          f"world {args.world}, {args.repeats} repeats (medians of {rows[0]['clock']} time)\n")
    print(markdown(rows))


if __name__ == "__main__":
    main()
