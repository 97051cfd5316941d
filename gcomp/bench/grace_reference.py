"""GRACE's sign codecs, transcribed, and a side-by-side timing of gcomp's against them on the same tensor.

``python -m gcomp.bench.grace_reference --numel 10000000`` times one step of each sign method on one rank and
one thread, GRACE's and gcomp's interleaved (``gcomp.bench.timing.median_times``), and prints both and their
ratio. One step is what each framework does to a tensor on one rank of an all-gather: GRACE compresses
(compensating and updating its memory first, for EF-signSGD), decompresses the one gathered payload and
aggregates the list of decompressed tensors; gcomp compensates, compresses, updates its memory and aggregates
the stacked payload (``Method.reduce`` without the collective: the hook's encode and decode).

What the two send differs: GRACE sends a uint8 per entry (and for EF-signSGD a 0-d mean), gcomp one bit per
entry plus an fp32 scale; GRACE's signsgd and signum decode to bare signs (its ``aggregate``: the sign of the
summed signs, ties +1), gcomp's to scaled signs (majority vote ties 0).

The GRACE classes below are transcribed from GRACE (Xu et al., "GRACE: A Compressed Communication Framework for
Distributed Machine Learning", ICDCS 2021), https://github.com/sands-lab/grace at commit 106e3de,
grace_dl/dist/compressor/{signsgd,efsignsgd,signum}.py and grace_dl/dist/memory/efsignsgd.py (db6d129), with
its base classes left out; used under GRACE's BSD 2-Clause license, reproduced here:

    Copyright (c) 2020, King Abdullah University of Science and Technology (KAUST)

    Redistribution and use in source and binary forms, with or without modification, are permitted provided
    that the following conditions are met:
    1. Redistributions of source code must retain the above copyright notice, this list of conditions and
       the following disclaimer.
    2. Redistributions in binary form must reproduce the above copyright notice, this list of conditions and
       the following disclaimer in the documentation and/or other materials provided with the distribution.

    THIS SOFTWARE IS PROVIDED BY THE COPYRIGHT HOLDERS AND CONTRIBUTORS "AS IS" AND ANY EXPRESS OR IMPLIED
    WARRANTIES, INCLUDING, BUT NOT LIMITED TO, THE IMPLIED WARRANTIES OF MERCHANTABILITY AND FITNESS FOR A
    PARTICULAR PURPOSE ARE DISCLAIMED. IN NO EVENT SHALL THE COPYRIGHT OWNER OR CONTRIBUTORS BE LIABLE FOR ANY
    DIRECT, INDIRECT, INCIDENTAL, SPECIAL, EXEMPLARY, OR CONSEQUENTIAL DAMAGES (INCLUDING, BUT NOT LIMITED TO,
    PROCUREMENT OF SUBSTITUTE GOODS OR SERVICES; LOSS OF USE, DATA, OR PROFITS; OR BUSINESS INTERRUPTION)
    HOWEVER CAUSED AND ON ANY THEORY OF LIABILITY, WHETHER IN CONTRACT, STRICT LIABILITY, OR TORT (INCLUDING
    NEGLIGENCE OR OTHERWISE) ARISING IN ANY WAY OUT OF THE USE OF THIS SOFTWARE, EVEN IF ADVISED OF THE
    POSSIBILITY OF SUCH DAMAGE.
"""
from __future__ import annotations

import argparse
from typing import Callable

import torch

import gcomp
from gcomp.bench.timing import median_times

METHODS = ("signsgd", "efsignsgd", "signum")
LEARNING_RATE = 0.1  # GRACE's EF-signSGD takes the learning rate (its memory scales by it); any value costs alike
MOMENTUM = 0.9       # gcomp's signum default


# --- GRACE, transcribed (base classes left out: ``average=False`` is kept as an attribute) ------------------------

class SignSGDCompressor:

    def __init__(self):
        self.average = False

    def compress(self, tensor, name):
        shape = tensor.size()
        tensor = tensor.flatten()

        tensor_compressed = tensor >= 0
        return [tensor_compressed.type(torch.uint8)], shape

    def decompress(self, tensors, shape):
        """Decoding the signs to float format """
        sign_encode, = tensors
        sign_decode = sign_encode.type(torch.float32) * 2 - 1
        tensor_decompressed = sign_decode.view(shape)
        return tensor_decompressed

    def aggregate(self, tensors):
        """Aggregate a list of tensors."""
        agged_tensor = sum(tensors)
        sign = agged_tensor >= 0
        agged_tensor = sign * 2.0 - 1.0
        return agged_tensor


class EFSignSGDCompressor:

    def __init__(self, lr):
        self.average = False
        self.learning_rate = lr

    def compress(self, tensor, name):
        """Encoding and compressing the signs """
        shape = tensor.size()
        tensor = tensor.flatten()

        sign_encode = tensor >= 0
        mean = tensor.abs().mean()
        tensor_compressed = mean, sign_encode.type(torch.uint8)

        return tensor_compressed, shape

    def decompress(self, tensor_compressed, shape):
        """Decoding the signs to float format """
        mean, sign_encode = tensor_compressed
        sign_decode = sign_encode.type(torch.float32) * 2 - 1
        sign_decode = mean * sign_decode
        tensor_decompressed = sign_decode.view(shape)
        return tensor_decompressed

    def aggregate(self, tensors):
        """Aggregate a list of tensors."""
        return sum(tensors) / self.learning_rate


class SignumCompressor:

    def __init__(self, momentum):
        self.average = False
        self.momentum = momentum
        self.momentums = {}

    def compress(self, tensor, name):
        """Encoding and compressing the signs """
        shape = tensor.size()
        tensor = tensor.flatten()

        # update tensor by momentum
        if name in self.momentums:
            tensor = (1.0 - self.momentum) * tensor + self.momentum * self.momentums[name]
        self.momentums[name] = tensor
        tensor_compressed = tensor >= 0
        return [tensor_compressed.type(torch.uint8)], shape

    def decompress(self, tensors, shape):
        sign_encode, = tensors
        """Decoding the signs to float format """
        sign_decode = sign_encode.type(torch.float32) * 2 - 1
        tensor_decompressed = sign_decode.view(shape)
        return tensor_decompressed

    def aggregate(self, tensors):
        """Aggregate a list of tensors."""
        agged_tensor = sum(tensors)
        agged_tensor = agged_tensor >= 0
        agged_tensor = agged_tensor * 2.0 - 1.0
        return agged_tensor


class EFSignSGDMemory:
    def __init__(self, lr):
        self.residuals = {}
        self.learning_rate = lr

    def compensate(self, tensor, name):
        """Update the tensor with the residuals."""
        if name in self.residuals:
            tensor = self.residuals[name] + self.learning_rate * tensor
        return tensor

    def update(self, tensor, name, compressor, tensor_compressed, ctx):
        """Update the residuals."""
        tensor_decompressed = compressor.decompress(tensor_compressed, ctx)
        residual = tensor - tensor_decompressed
        self.residuals[name] = residual


# --- one step of each, on one rank ------------------------------------------------------------------------------

def grace_step(name: str, tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
    """One GRACE step on ``tensor`` for one rank (its all-gather communicator with one payload gathered)."""
    compressor = {"signsgd": SignSGDCompressor, "efsignsgd": lambda: EFSignSGDCompressor(LEARNING_RATE),
                  "signum": lambda: SignumCompressor(MOMENTUM)}[name]()
    memory = EFSignSGDMemory(LEARNING_RATE) if name == "efsignsgd" else None

    def step():
        t = tensor if memory is None else memory.compensate(tensor, "bucket")
        compressed, ctx = compressor.compress(t, "bucket")
        if memory is not None:
            memory.update(t, "bucket", compressor, compressed, ctx)
        return compressor.aggregate([compressor.decompress(compressed, ctx)])

    return step


def gcomp_step(name: str, tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
    """One gcomp step on ``tensor`` for one rank: the hook's encode and decode around a one-rank all-gather."""
    method = gcomp.create(name, **({"momentum": MOMENTUM} if name == "signum" else {}))
    bucket = gcomp.BucketInfo.single(tensor)

    def step():
        payload = method._send(tensor, bucket, {"bytes_sent": 0})  # compensate, encode, keep the residual
        return method.compressor.decode([t.unsqueeze(0) for t in payload.tensors], payload.ctx)

    return step


def compare(numel: int, methods=METHODS, repeats: int = 5, seed: int = 0) -> list[dict]:
    """Median seconds per step of GRACE's and gcomp's codec for each method on one random fp32 tensor of
    ``numel`` entries (one thread, interleaved), and gcomp's time over GRACE's."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tensor = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
        rows = []
        for name in methods:
            times = median_times({"grace": grace_step(name, tensor), "gcomp": gcomp_step(name, tensor)}, repeats)
            rows.append({"method": name, "numel": numel, "grace_s": times["grace"], "gcomp_s": times["gcomp"],
                         "ratio": times["gcomp"] / times["grace"]})
        return rows
    finally:
        torch.set_num_threads(threads)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=10_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--method", action="append", choices=METHODS, help="repeatable; default: all three")
    args = parser.parse_args(argv)
    print(f"one step on one rank, one thread, {args.numel} fp32 entries (medians of {args.repeats})")
    print("| method | GRACE ms | gcomp ms | gcomp / GRACE |")
    print("| --- | --- | --- | --- |")
    for r in compare(args.numel, args.method or METHODS, args.repeats):
        print(f"| {r['method']} | {r['grace_s'] * 1e3:.2f} | {r['gcomp_s'] * 1e3:.2f} | {r['ratio']:.2f} |")


if __name__ == "__main__":
    main()
