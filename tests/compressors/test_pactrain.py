"""``pactrain``: integer lanes up to 1024 ranks, the ternary codec (unbiased, non-finite flag), and pruned models
trained under DDP on 2-4 ranks: equal to plain DDP, replicas identical, pruned entries never moving, bytes equal
to the kept fraction, the mask tracker in DDP (warm-up, rebuild, ranks that disagree, re-pruning),
channels_last, and checkpoints.

The multi-rank tests read one cached rank job per world size (tests/compressors/pactrain_jobs.py). The supports
and the tracker's state machine have their own files: test_pactrain_support.py and test_pactrain_tracker.py.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils import prune

from gcomp import BucketInfo
from gcomp.collectives.bitpack import WORD_BITS, fields_per_word, lane_bits, pack, packed_words, unpack
from gcomp.compressors.pactrain import PacTrainCompressor
from gcomp.compressors.pactrain import scale_grid
from gcomp.pruning import mask_of
from gcomp.registry import from_spec
from gcomp.testing.ops import check_bounded
from tests.compressors import pactrain_jobs as jobs
from tests.compressors.device_count_jobs import SMALL, job_packed_counts
from tests.distributed import run_ranks_once

# --- integer lanes up to 1024 ranks --------------------------------------------------------------------------------
# tests/collectives/test_bitpack.py has the round trips (every width) and the lane sum with field 0 at its maximum;
# what it leaves out: every word's top field at its maximum, so that for the widths that divide 64 (1, 4-7 and
# 64-127 ranks) the SUM runs into the sign bit of every word and wraps.

WORLDS = st.one_of(st.sampled_from([1, 4, 5, 7, 64, 100, 127, 511, 512, 1023, 1024]), st.integers(1, 1024))


@settings(max_examples=60, deadline=None)
@given(world=WORLDS, words=st.integers(1, 5), extra=st.integers(0, 63), seed=st.integers(0, 2**31 - 1))
def test_lane_sums_survive_the_int64_wrap_of_the_top_field(world, words, extra, seed):
    bits = lane_bits(world)
    per_word = fields_per_word(bits)
    n = words * per_word + extra % per_word  # whole words, then maybe a partial one
    codes = torch.randint(-1, 2, (world, n), generator=torch.Generator().manual_seed(seed))
    codes[:, per_word - 1::per_word] = 1  # the top field of every word sums to 2N
    codes[:, 0] = 1
    width = packed_words(n, bits) * per_word
    padded = torch.zeros(world, width, dtype=torch.uint8)
    padded[:, :n] = (codes + 1).to(torch.uint8)
    lanes = pack(padded.reshape(-1), bits).reshape(world, -1)  # row r: rank r's words
    for r in {0, world - 1}:  # the batched packing is each rank's own
        assert torch.equal(lanes[r], pack((codes[r] + 1).to(torch.uint8), bits))
        assert torch.equal(unpack(lanes[r], n, bits), codes[r] + 1)
    total = lanes.sum(0)  # int64 SUM, as gloo and NCCL do it: wraps modulo 2**64
    if WORD_BITS % bits == 0 and bits > 1:
        assert (total[:words] < 0).all(), "the top field's sum should have reached the sign bit"
    assert torch.equal(unpack(total, n, bits) - world, codes.sum(0))


# --- the codec, driven in-process ----------------------------------------------------------------------------------
# Ranks are simulated in one process: one compressor per rank (bound to no process group, then told the world
# size), their collectives computed here: SUM as a sum, MAX as fmax, which drops a NaN as a real MAX may.

def _tiny_pruned(seed: int = 0) -> tuple[nn.Module, BucketInfo, torch.Tensor]:
    """A Linear(8, 6) pruned at random (one output row entirely) and an unpruned Linear(6, 3), one bucket in
    DDP's order (last layer first). Returns the model, the bucket and its support."""
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 3))
    mask = (torch.rand(6, 8, generator=g) < 0.5).float()
    mask[2] = 0
    prune.custom_from_mask(model[0], "weight", mask)
    params = dict(model.named_parameters())
    names = list(params)[::-1]
    info = BucketInfo.from_layout(0, torch.float32, names, [params[n].numel() for n in names])
    support = torch.cat([torch.ones(params[n].numel(), dtype=torch.bool) if mask_of(model, n) is None
                         else (mask_of(model, n) != 0).reshape(-1) for n in names])
    return model, info, support


def _compressors(world: int, model: nn.Module, **params) -> list[PacTrainCompressor]:
    comps = []
    for rank in range(world):
        comp = PacTrainCompressor(stable_steps=1, seed=rank, **params)  # its own seed: independent draws
        comp.bind(model, None, {})
        comp.world = world
        comps.append(comp)
    return comps


def _max(tensors: list[torch.Tensor]) -> torch.Tensor:
    out = tensors[0].clone()
    for t in tensors[1:]:
        out = torch.fmax(out, t) if out.is_floating_point() else torch.maximum(out, t)
    return out


def _exchange(comps, info: BucketInfo, grads: list[torch.Tensor]) -> tuple[str, list[torch.Tensor]]:
    """One step of every simulated rank: returns the mode and what each rank decoded."""
    payloads = [c.encode(g.clone(), {}, info)[0] for c, g in zip(comps, grads)]
    mode = payloads[0].ctx.mode
    assert all(p.ctx.mode == mode for p in payloads)
    if mode == "ternary":
        scales = _max([p.tensors[0] for p in payloads])
        for c, p in zip(comps, payloads):
            p.tensors[0] = scales.clone()
            c.second_round(p)
        received = [scales, torch.stack([p.tensors[1] for p in payloads]).sum(0)]
    else:  # packed, ternary in one round (a single SUM), dense, tracking
        received = [torch.stack([p.tensors[0] for p in payloads]).sum(0)]
        if mode == "tracking":
            received.append(_max([p.tensors[1] for p in payloads]))
    return mode, [c.decode([t.clone() for t in received], p.ctx) for c, p in zip(comps, payloads)]


def _reach(mode: str, comps, info: BucketInfo, grads) -> None:
    for _ in range(4):  # stable_steps=1: tracking, candidate, then frozen
        if _exchange(comps, info, grads)[0] == mode:
            return
    pytest.fail(f"the bucket never went {mode}")


SAMPLES = 1000


@pytest.mark.parametrize("world, rounds", [(1, 2), (4, 2), (1, 1), (4, 1)])
def test_ternary_is_unbiased(world, rounds):
    """The mean of the decoded ``s * T`` over many steps approaches the sum of the ranks' gradients on the support,
    within 6 standard errors from the per-entry variance ``sum_i s * |g_i| - g_i**2``; off the support it is
    exactly 0, and every step decodes to a multiple ``s * T`` with integer ``|T| <= N``. The scale ``s`` is the
    shared max |g| (two rounds), or in one round that max's eighth-octave grid point, carried from the step
    before (the gradients repeat, so nothing outgrows it)."""
    model, info, support = _tiny_pruned()
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(info.numel, generator=g) for _ in range(world)]
    zero = support.nonzero().reshape(-1)[[0, 1, 2, 10, 30]]  # the whole first parameter (3 biases) and two more
    for grad in grads:
        grad[zero] = 0.0  # no variance: must come out exactly 0 (a scale of 0 too, for the first parameter)
    comps = _compressors(world, model, ternary=True, rounds=rounds)
    _reach("ternary", comps, info, grads)

    # the shared scale of each entry: max |g| over every rank's kept entries of its parameter (one round: its
    # grid point)
    scale = torch.zeros(info.numel, dtype=torch.float64)
    for (_, offset, numel) in info.segments():
        part = slice(offset, offset + numel)
        kept_part = support[part]
        if kept_part.any():
            most = max(float(gr[part][kept_part].abs().max()) for gr in grads)
            scale[part] = most if rounds == 2 or most == 0 else float(
                scale_grid.grid_scale(scale_grid.grid_exponent(torch.tensor([most]))))
    stacked = torch.stack(grads).double()
    expected = torch.where(support, stacked.sum(0), 0.0)
    variance = (scale * stacked.abs() - stacked**2).sum(0)

    total = torch.zeros(info.numel, dtype=torch.float64)
    for _ in range(SAMPLES):
        mode, decoded = _exchange(comps, info, grads)
        assert mode == ("ternary" if rounds == 2 else "ternary1")
        assert all(torch.equal(d, decoded[0]) for d in decoded[1:]), "ranks decoded different values"
        d = decoded[0].double()
        assert (d[~support] == 0).all() and (d[scale == 0] == 0).all()
        scaled = support & (scale > 0)
        steps_of_scale = d[scaled] / scale[scaled]
        assert ((steps_of_scale - steps_of_scale.round()).abs() <= 1e-5).all()
        assert (steps_of_scale.abs() <= world + 1e-5).all()
        total += d
    mean = total / SAMPLES
    bound = 6 * (variance / SAMPLES).sqrt() + 1e-6 * world * scale
    err = (mean - expected).abs()
    assert (err[support] <= bound[support]).all(), (
        f"biased: worst entry off by {(err - bound)[support].max().item():.3g} beyond 6 standard errors")
    assert torch.equal(mean[zero], torch.zeros(len(zero), dtype=torch.float64))


def test_one_round_carries_what_its_scale_clipped_so_the_steps_add_up():
    """One round: gradients alternate between g and 3g, so every second step outgrows the scale carried from the
    step before; what goes above it is sent as +-scale and the excess comes back in the rank's next step. Over
    many steps the mean of what was decoded is the mean gradient (within 6 standard errors and what the last
    carry still holds); without the carry the 3g steps would lose a third or more of their largest entries."""
    model, info, support = _tiny_pruned()
    world, g = 2, torch.Generator().manual_seed(4)
    small = [torch.randn(info.numel, generator=g) * support for _ in range(world)]
    comps = _compressors(world, model, ternary=True)
    _reach("ternary", comps, info, small)
    total, steps = torch.zeros(info.numel, dtype=torch.float64), 1000
    for step in range(steps):
        grads = small if step % 2 else [3 * x for x in small]
        mode, decoded = _exchange(comps, info, grads)
        assert mode == "ternary1"
        assert all(torch.equal(d, decoded[0]) for d in decoded[1:])
        total += decoded[0].double()
    expected = 2 * torch.stack(small).double().sum(0)  # mean of g and 3g, summed over ranks
    largest = max(float(x.abs().max()) for x in small)
    bound = 6 * (3 * largest * 3 * torch.stack(small).abs().double().sum(0) / steps).sqrt() + 3 * world * largest / steps
    assert ((total / steps - expected).abs() <= bound + 1e-6).all()
    assert all(c.stats.get("scale_resyncs", 0) == 0 for c in comps)


def test_a_segment_without_a_scale_resyncs_and_loses_nothing():
    """A parameter zero on every rank when the scale was shared has no scale: when it turns non-zero, its
    values are kept back (carried) and a resync is asked for in the same all-reduce; the next step takes the
    exact scale in two rounds and sends them, exactly here (every entry at the shared max)."""
    model, info, support = _tiny_pruned()
    world, g = 2, torch.Generator().manual_seed(5)
    grads = [torch.randn(info.numel, generator=g) * support for _ in range(world)]
    bias = slice(0, 3)  # "1.bias", first in the bucket, never pruned
    for x in grads:
        x[bias] = 0.0
    comps = _compressors(world, model, ternary=True)
    for c in comps:
        c.stats = {"scale_resyncs": 0, "one_round_buckets": 0}
    _reach("ternary", comps, info, grads)  # the two-round step: the bias has no scale
    turned = [x.clone() for x in grads]
    turned[0][bias] = 2.0
    mode, decoded = _exchange(comps, info, turned)
    assert mode == "ternary1" and all((d[bias] == 0).all() for d in decoded)
    mode, decoded = _exchange(comps, info, grads)  # the bias is zero again: only the carry is left to send
    assert mode == "ternary" and all(c.stats["scale_resyncs"] == 1 for c in comps)
    assert all(torch.equal(d[bias], torch.full((3,), 2.0)) for d in decoded)
    assert _exchange(comps, info, grads)[0] == "ternary1"


def test_two_rounds_are_kept_when_asked():
    model, info, support = _tiny_pruned()
    grads = [torch.randn(info.numel, generator=torch.Generator().manual_seed(6)) for _ in range(2)]
    comps = _compressors(2, model, ternary=True, rounds=2)
    _reach("ternary", comps, info, grads)
    assert [_exchange(comps, info, grads)[0] for _ in range(3)] == ["ternary"] * 3
    with pytest.raises(ValueError, match="rounds"):
        PacTrainCompressor(ternary=True, rounds=3)


@pytest.mark.parametrize("clip", [2.5, float("inf")])
def test_ternary_clipping_sends_a_one_entry_parameter_as_it_is(clip):
    """A one-entry parameter has standard deviation 0, so ``clip * std`` is 0 (or NaN for an infinite clip). By
    TernGrad's rule (``quantise.segment_scales``) such a cap is ignored: the exact shared scale (two rounds)
    stays max |g|, and a bias of -10 on every rank is sent exactly (probability 1), neither as 0 nor as NaN."""
    g = torch.Generator().manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 1))
    prune.custom_from_mask(model[0], "weight", (torch.rand(6, 8, generator=g) < 0.5).float())
    params = dict(model.named_parameters())
    names = list(params)[::-1]  # DDP's order: the last layer first, so its one-entry bias leads the bucket
    info = BucketInfo.from_layout(0, torch.float32, names, [params[n].numel() for n in names])
    assert names[0] == "1.bias" and info.numels[0] == 1
    world = 3
    grads = [torch.randn(info.numel, generator=g) for _ in range(world)]
    for grad in grads:
        grad[0] = -10.0
    comps = _compressors(world, model, ternary=True, clip=clip, rounds=2)
    _reach("ternary", comps, info, grads)
    for decoded in _exchange(comps, info, grads)[1]:
        assert decoded[0] == -10.0 * world, decoded[0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("ternary", [False, True], ids=["packed", "ternary"])
def test_nonfinite_on_the_support_surfaces_on_every_rank(ternary, bad):
    """One rank's non-finite entry decodes to non-finite on every rank; ternary decodes it as NaN through its
    flag slot even though the simulated MAX of the scales (fmax) drops a NaN scale."""
    model, info, support = _tiny_pruned()
    g = torch.Generator().manual_seed(2)
    grads = [torch.randn(info.numel, generator=g) for _ in range(2)]
    comps = _compressors(2, model, ternary=ternary)
    _reach("ternary" if ternary else "packed", comps, info, grads)
    where = int(support.nonzero()[5])
    grads[1][where] = bad
    _, decoded = _exchange(comps, info, grads)
    for d in decoded:
        assert not torch.isfinite(d[where])
        if ternary:
            assert torch.isnan(d[where])
    # and a finite step afterwards decodes finite again (the flag is not sticky)
    grads[1][where] = 0.0
    _, decoded = _exchange(comps, info, grads)
    assert all(torch.isfinite(d).all() for d in decoded)


def test_lossless_decodes_the_dense_sum_on_the_support_bit_for_bit():
    model, info, support = _tiny_pruned()
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(info.numel, generator=g) for _ in range(2)]
    grads[0][support.nonzero()[:3]] = -0.0  # a negative zero's sign survives the scatter
    comps = _compressors(2, model)
    _reach("packed", comps, info, grads)
    _, decoded = _exchange(comps, info, grads)
    expected = torch.where(support, grads[0] + grads[1], torch.zeros(()))
    for d in decoded:
        assert torch.equal(d.view(torch.int32), expected.view(torch.int32))


# --- one bucket's operations do not grow with its parameters or entries ------------------------------------------

def _counts() -> dict:
    specs = ["pactrain", "prunex", "pactrain:ternary=true"]
    return run_ranks_once(("packed-device-counts",), 2, job_packed_counts, specs, SMALL, timeout=600)[0]


@pytest.mark.parametrize("spec", ["pactrain", "prunex", "pactrain:ternary=true"])
def test_a_packed_bucket_is_bucket_wide_with_one_declared_host_read(spec):
    counts = _counts()
    assert counts[(spec, *SMALL[0])]["ops"].get("index_select")  # a packed step was counted, not a tracking one
    check_bounded(spec, counts, from_spec(spec).host_syncs, SMALL)
    assert from_spec(spec).host_syncs == 1


# --- pruned models under DDP: one rank job per world size ------------------------------------------------------------

WORLD_CONFIGS = {2: list(jobs.CONFIGS), 3: ["basic"], 4: ["basic", "ternary"]}


def _ranks(world: int) -> list[dict]:
    """Per rank: ``{config name: {"pactrain": run, "reference": run or None}}`` (see ``jobs.train``)."""
    return run_ranks_once(("pactrain", world), world, jobs.job_train, WORLD_CONFIGS[world])


def _runs(world: int, name: str, which: str = "pactrain") -> list[dict]:
    return [r[name][which] for r in _ranks(world)]


def _assert_same(got: dict, expected: dict, exact: bool, what: str) -> None:
    """Bit for bit, or within float summation tolerance (1e-6 relative) where rank order may differ."""
    for name, e in expected.items():
        a = got[name]
        ok = torch.equal(a, e) if exact else torch.allclose(a, e, rtol=1e-6, atol=1e-7)
        assert ok, f"{what}: {name} differs by up to {(a.double() - e.double()).abs().max().item():.3g}"


LOSSLESS = [(2, n) for n in ("basic", "static", "view", "cnn_cl", "rebuild", "mismatch", "diverge", "reprune")] \
    + [(3, "basic"), (4, "basic")]
EVERY = [(2, n) for n in jobs.CONFIGS] + [(3, "basic"), (4, "basic"), (4, "ternary")]


def _id(case) -> str:
    return f"ws{case[0]}-{case[1]}"


@pytest.mark.parametrize("world, name", LOSSLESS, ids=map(_id, LOSSLESS))
def test_lossless_training_equals_plain_ddp(world, name):
    """Parameters and last gradients after training equal plain DDP's (no hook: a dense all-reduce of the masked
    gradients) with the same masks, per rank, and the same mask edits at the same step: bit for bit on 2 ranks.

    ``mismatch``: rank 1 holds other masks throughout (pactrain must stay dense). ``diverge`` (rank 1) and
    ``reprune`` (every rank) prune more during training: the step of the edit is still reduced on the old
    support, which holds every rank's new mask, so it equals the dense reduction too; the next steps are dense
    (diverge) or packed on the new support (reprune)."""
    for rank, r in enumerate(_ranks(world)):
        got, reference = r[name]["pactrain"], r[name]["reference"]
        assert got["history"][-1]["packed_buckets"] > 0 or name == "mismatch"
        _assert_same(got["params"], reference["params"], world == 2, f"rank {rank} parameters")
        _assert_same(got["grads"], reference["grads"], world == 2, f"rank {rank} last gradients")


@pytest.mark.parametrize("world, name", EVERY, ids=map(_id, EVERY))
def test_replicas_stay_identical(world, name):
    runs = _runs(world, name)
    for rank, run in enumerate(runs[1:], 1):
        _assert_same(run["params"], runs[0]["params"], True, f"rank {rank} against rank 0")


@pytest.mark.parametrize("world, name", EVERY, ids=map(_id, EVERY))
def test_pruned_entries_never_move(world, name):
    """Entries every rank's initial mask prunes keep their initial value (zero gradient, so zero momentum) and
    the effective weight there is exactly 0; entries every rank's final mask prunes get an exactly zero gradient
    at the last step; kept entries did train."""
    runs = _runs(world, name)
    for pname in runs[0]["init_masks"]:
        pruned = torch.stack([r["init_masks"][pname] == 0 for r in runs]).all(0)
        pruned_at_end = torch.stack([r["masks"][pname] == 0 for r in runs]).all(0)
        assert pruned.any()
        for rank, r in enumerate(runs):
            assert torch.equal(r["params"][pname][pruned], r["init"][pname][pruned]), f"rank {rank}: {pname} moved"
            assert ((r["params"][pname] * r["masks"][pname])[pruned_at_end] == 0).all()
            assert (r["grads"][pname][pruned_at_end] == 0).all(), f"rank {rank}: {pname} has gradient off its mask"
            assert not torch.equal(r["params"][pname][~pruned], r["init"][pname][~pruned])


# --- bytes -------------------------------------------------------------------------------------------------------

def _step_bytes(run: dict, world: int, ternary: bool, dense_above: float = 0.9) -> tuple[int, int, int]:
    """What one step sends once every bucket froze, from the final masks and the hook's bucket layouts:
    ``(bytes sent, bytes of a plain fp32 all-reduce, buckets packed)``.

    Packed: the kept entries plus 1 flag entry, fp32. Ternary (after its first packed step: one round): one
    ``lane_bits(N)``-bit field per kept entry in int64 words, the counting lanes of the next scale
    (``scale_grid.hist_words`` per bucket) and 3 int64 counts. A bucket keeping more than ``dense_above`` goes
    whole."""
    sent = dense = packed = 0
    for names, numels in run["layouts"]:
        numel = sum(numels)
        kept = sum(int(run["masks"][n].count_nonzero()) if n in run["masks"] else k for n, k in zip(names, numels))
        dense += 4 * numel
        if kept > dense_above * numel:
            sent += 4 * numel
        elif ternary:
            sent += 8 * (packed_words(kept, lane_bits(world)) + scale_grid.hist_words(len(names), world) + 3)
            packed += 1
        else:
            sent += 4 * (kept + 1)
            packed += 1
    return sent, dense, packed


def _since_last_freeze(history: list[dict]) -> tuple[int, dict]:
    """Steps after the last step in which a bucket froze, and the stats' growth over them."""
    last = max(i for i in range(1, len(history)) if history[i]["freezes"] > history[i - 1]["freezes"])
    return len(history) - 1 - last, {k: history[-1][k] - history[last][k] for k in history[-1]}


BYTES = [(2, "basic"), (2, "static"), (2, "view"), (2, "cnn_cl"), (2, "reprune"), (3, "basic"), (4, "basic")]


@pytest.mark.parametrize("world, name", BYTES, ids=map(_id, BYTES))
def test_packed_steps_send_the_kept_fraction(world, name):
    """Over the steps after the tracker froze, bytes_sent / bytes_dense is the kept fraction of the buckets
    (kept + 1 flag entry per packed bucket, the whole of a bucket kept above 0.9): exactly, in bytes."""
    for rank, run in enumerate(_runs(world, name)):
        steps, grown = _since_last_freeze(run["history"])
        sent, dense, packed = _step_bytes(run, world, ternary=False)
        assert steps >= 2 and packed >= 1 and grown["unfreezes"] == 0
        assert grown["packed_buckets"] == steps * packed
        assert grown["bytes_dense"] == steps * dense
        assert grown["bytes_sent"] == steps * sent, (
            f"rank {rank}: ratio {grown['bytes_sent'] / grown['bytes_dense']:.4f}, kept fraction {sent / dense:.4f}")


@pytest.mark.parametrize("world", [2, 4])
def test_ternary_packed_steps_send_lane_bits_per_kept_entry(world):
    """Ternary after the freeze, in one round: the exact bytes of ``_step_bytes``, and at most the kept fraction
    times ``lane_bits(N) / 32`` (4/32 on 4 ranks) plus the next scale's counting lanes, the 3 counts and each
    bucket's last, partly filled word; no bucket took two rounds after its first packed step."""
    for run in _runs(world, "ternary"):
        steps, grown = _since_last_freeze(run["history"])
        sent, dense, packed = _step_bytes(run, world, ternary=True)
        assert steps >= 2 and packed >= 1
        assert grown["bytes_dense"] == steps * dense
        assert grown["bytes_sent"] == steps * sent
        bound = 0.0
        for names, numels in run["layouts"]:
            numel = sum(numels)
            kept = sum(int(run["masks"][n].count_nonzero()) if n in run["masks"] else k
                       for n, k in zip(names, numels))
            if kept > 0.9 * numel:
                bound += 4 * numel
            else:
                bound += 4 * kept * lane_bits(world) / 32 + 8 * (scale_grid.hist_words(len(names), world) + 3) + 8
        assert grown["bytes_sent"] <= steps * bound
        assert grown["one_round_buckets"] == steps * packed and grown["scale_resyncs"] == 0


# --- the mask tracker in DDP -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, warmup", [("basic", 1), ("static", 2)])
def test_packs_from_the_first_step_on_the_final_buckets(name, warmup):
    """Nothing is packed during the hook's warm-up (DDP's rebuild: 1 step, 2 with static_graph); the masks were
    pruned before install, every rank's digest of them agreed there, and they never change, so there is no
    waiting for ``stable_steps`` (5) nor an agreeing step: every bucket packs from the first final step on."""
    first = warmup
    for run in _runs(2, name):
        history = run["history"]
        assert [h["packed_buckets"] for h in history[:first]] == [0] * first
        packed = [b - a for a, b in zip([0] + [h["packed_buckets"] for h in history], [h["packed_buckets"]
                                                                                        for h in history])]
        assert set(packed[first:]) == {history[first]["packed_buckets"]} and packed[first] > 0  # all, each step
        assert history[-1]["warmup_steps"] == warmup
        assert history[first]["layouts"] == history[-1]["layouts"] == len(run["layouts"]) == 3


def test_survives_the_rebuild():
    """With the warm-up cut to 0 the tracker sees DDP's initial one-bucket layout, then the 3 rebuilt ones. The
    initial bucket packs at once, on the masks agreed at install (it takes their copies); the new layouts are
    tracked from scratch: their masks are those of install, so after one agreeing step on the rebuilt layout
    (step 1) both pruned buckets pack from step 2."""
    for run in _runs(2, "rebuild"):
        history = run["history"]
        assert history[0]["layouts"] == 1 and history[-1]["layouts"] == 4
        assert [h["packed_buckets"] for h in history[:2]] == [1] * 2
        assert history[2]["packed_buckets"] == 1 + 2 and history[3]["packed_buckets"] == 1 + 4


def test_a_rank_with_other_masks_is_detected_and_sent_dense():
    """Rank 1 holds other masks from the hook's first step (changed after DDP is built, with NO_SYNC, before
    install): every candidate support's digest differs, so every rank warns, counts a mismatch per packable
    bucket and check, never packs and never freezes those buckets (the unpruned bucket, the same on every
    rank, freezes into dense mode). The first check comes one step after the warm-up (masks as installed:
    no waiting), then one every stable_steps + 1 = 3 steps: 4 checks in 11 steps. Equality with plain DDP:
    test_lossless_training_equals_plain_ddp."""
    for run in _runs(2, "mismatch"):
        last = run["history"][-1]
        assert last["packed_buckets"] == 0 and last["freezes"] == 1 and last["unfreezes"] == 0
        assert last["mask_mismatches"] == 4 * 2
        assert sum("different masks" in w for w in run["warnings"]) == 4 * 2


def test_masks_changed_between_install_and_the_first_step_pack_on_the_agreed_ones():
    """Rank 1 prunes more during DDP's warm-up, after install agreed on the masks: the first step on the final
    layout packs both pruned buckets on the masks agreed at install and carries rank 1's change, so every rank
    unfreezes them at the next step, with a warning, and then finds the digests differ. Equality with plain
    DDP: test_lossless_training_equals_plain_ddp."""
    for run in _runs(2, "early_edit"):
        history = run["history"]
        assert history[0]["packed_buckets"] == 0 and history[1]["packed_buckets"] == 2
        assert history[1]["unfreezes"] == 0 and history[2]["unfreezes"] == history[-1]["unfreezes"] == 2
        assert history[-1]["packed_buckets"] == 2 and history[-1]["mask_mismatches"] > 0
        assert sum("changed on some rank" in w for w in run["warnings"]) == 2


def test_one_rank_changing_its_masks_falls_back_to_dense():
    """Rank 1 prunes more in place at step EDIT_AT, after the freeze: that step is still packed (on the old
    support), the next unfreezes both packed buckets on every rank with a warning, and from then on the digests
    differ: dense all-reduce with mismatches, packed_buckets stops growing."""
    at = jobs.EDIT_AT
    for run in _runs(2, "diverge"):
        history = run["history"]
        assert history[at]["packed_buckets"] > history[at - 1]["packed_buckets"]
        assert history[-1]["packed_buckets"] == history[at]["packed_buckets"]
        assert history[at]["unfreezes"] == 0 and history[at + 1]["unfreezes"] == history[-1]["unfreezes"] == 2
        assert history[-1]["mask_mismatches"] > 0
        assert sum("changed on some rank" in w for w in run["warnings"]) == 2
        assert any("different masks" in w for w in run["warnings"])


def test_masks_changed_on_every_rank_refreeze_on_the_new_support():
    """Every rank re-prunes at step EDIT_AT (one mask edited in place, one replaced by torch's prune): both packed
    buckets unfreeze at the next step, track stable_steps (2) steps, freeze again and pack from step
    EDIT_AT + 1 + 2 + 1 on; test_packed_steps_send_the_kept_fraction checks the bytes against the new masks."""
    at = jobs.EDIT_AT
    for run in _runs(2, "reprune"):
        history = run["history"]
        packed = [h["packed_buckets"] for h in history]
        assert history[at + 1]["unfreezes"] == history[-1]["unfreezes"] == 2
        assert history[-1]["freezes"] == 3 + 2 and history[-1]["mask_mismatches"] == 0
        assert packed[at + 1] == packed[at + 3] == packed[at] and packed[at + 4] == packed[at] + 2
        for pname, mask in run["masks"].items():
            assert mask.count_nonzero() < run["init_masks"][pname].count_nonzero()
        assert sum("changed on some rank" in w for w in run["warnings"]) == 2


# --- channels_last -----------------------------------------------------------------------------------------------

def test_channels_last_cnn_matches_its_contiguous_twin():
    """The same pruned CNN in channels_last and contiguous under pactrain on 2 ranks: both pack, and the
    parameters agree up to the convolution kernels' own rounding (they differ by layout in the last bits; the
    bit-exact check of channels_last is against plain DDP in test_lossless_training_equals_plain_ddp). A support
    laid out in logical instead of memory order would drop kept gradients and be far off."""
    for cl, twin in zip(_runs(2, "cnn_cl"), _runs(2, "cnn")):
        weight = cl["params"]["0.weight_orig"]
        assert weight.is_contiguous(memory_format=torch.channels_last) and not weight.is_contiguous()
        assert cl["history"][-1]["packed_buckets"] > 0 and twin["history"][-1]["packed_buckets"] > 0
        for name, p in twin["params"].items():
            assert torch.allclose(cl["params"][name], p, rtol=1e-5, atol=1e-6), name


# --- checkpoints ---------------------------------------------------------------------------------------------------

FIXED = {"find_unused_parameters": True}  # one bucket layout throughout: a fresh DDP model starts on the same one
RESUME_STEPS = 14
RESUMES = {  # name: (pactrain parameters, DDP options, checkpoint after this many steps, load the hook state)
    "lossless-rebuilt": ({}, {}, 9, True),
    "ternary-frozen": ({"ternary": True}, FIXED, 9, True),
    "ternary-ef-frozen": ({"ternary": True, "error_feedback": True}, FIXED, 9, True),
    "ternary-tracking": ({"ternary": True}, FIXED, 3, True),
    "ternary-frozen-no-hook-state": ({"ternary": True}, FIXED, 9, False),
}


def _resumed(name: str) -> list[dict]:
    return [r[name] for r in run_ranks_once(("pactrain-resume",), 2, jobs.job_resume, RESUMES, RESUME_STEPS)]


@pytest.mark.parametrize("name", [
    "lossless-rebuilt", "ternary-frozen", "ternary-ef-frozen", "ternary-tracking",
])
def test_state_dict_resume_is_bit_identical(name):
    """Train 14 steps on 2 ranks straight, or checkpoint (model, optimizer, hook; torch.load weights_only) and
    resume on a fresh pruned model, DDP and hook: the same parameters bit for bit, and for ternary the same
    packed steps. Ternary needs a fixed bucket layout (a fresh DDP model starts from its initial layout, where a
    run that never stopped is on the rebuilt one, as for every layout-dependent method in test_contracts);
    lossless pactrain is exact on 2 ranks whatever it sends, so its case goes through DDP's rebuild."""
    for rank, run in enumerate(_resumed(name)):
        assert torch.equal(torch.cat([p.reshape(-1) for p in run["resumed"].values()]),
                           torch.cat([p.reshape(-1) for p in run["straight"].values()])), f"rank {rank} diverged"
        assert run["straight_stats"]["packed_buckets"] > 0
        if name.startswith("ternary"):
            for key in ("packed_buckets", "freezes", "bytes_sent"):
                assert run["resumed_stats"][key] == run["straight_stats"][key], key


def test_resume_without_the_hook_state_diverges():
    """The control for the test above: without the hook state (generator, frozen supports) a ternary run leaves
    its trajectory."""
    for run in _resumed("ternary-frozen-no-hook-state"):
        assert not torch.equal(run["resumed"]["0.weight_orig"], run["straight"]["0.weight_orig"])


def test_flush_hands_the_carried_residual_over_at_its_kept_positions():
    """``auto`` hands what a method holds back to the next one (``flush``): ternary error feedback's residual lives
    on the packed support, so it comes back laid out in the bucket; what was decoded plus it is every step's
    gradient, and a second flush holds nothing."""
    from gcomp.collectives.reduce import ChainedAllreduceCommunicator
    from gcomp.compressors.pactrain import PacTrainMethod
    from gcomp.core import NoMemory

    model, info, support = _tiny_pruned()
    comps = _compressors(1, model, ternary=True, error_feedback=True)
    method = PacTrainMethod(comps[0], NoMemory(), ChainedAllreduceCommunicator())
    g = torch.Generator().manual_seed(5)
    _reach("ternary", comps, info, [torch.randn(info.numel, generator=g) * support])
    method.flush(info, torch.zeros(info.numel))  # what the steps so far held back, handed over: from here on, none
    given, decoded = torch.zeros(info.numel, dtype=torch.float64), torch.zeros(info.numel, dtype=torch.float64)
    for _ in range(3):
        grad = torch.randn(info.numel, generator=g) * support
        given += grad.double()
        decoded += _exchange(comps, info, [grad])[1][0].double()
    held = method.flush(info, torch.zeros(info.numel))
    assert held[~support].eq(0).all() and held.abs().sum() > 0
    torch.testing.assert_close(decoded + held.double(), given, rtol=0, atol=1e-5)
    assert method.flush(info, torch.zeros(info.numel)) is None
