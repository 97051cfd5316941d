"""Point-to-point round programs (gcomp.collectives.program): ``pack``/``unpack`` round trips and sizes, the
in-process simulator ``run_locally`` (results, and the schedule errors it must catch), and ``run_program`` on
real gloo process groups (same results as the simulator, byte and message counts, zero-byte messages skipped,
sub-groups addressed by group rank)."""
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from gcomp.collectives.program import Round, message_nbytes, pack, run_locally, run_program, unpack
from tests.distributed import run_ranks

SETTINGS = settings(max_examples=80, deadline=None)

DTYPES = [torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8,
          torch.bool]


# ---- pack / unpack ----------------------------------------------------------------------------------------

def _random_tensor(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    """``n`` entries of ``dtype`` with random bits (NaNs, infinities and subnormals included for floats)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8).bool()
    raw = torch.randint(0, 256, (n * dtype.itemsize,), generator=g, dtype=torch.uint8)
    return raw.view(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` (NaN-safe equality)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


@SETTINGS
@given(specs=st.lists(st.tuples(st.sampled_from(DTYPES), st.integers(0, 50)), min_size=1, max_size=4),
       seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_round_trip_is_bit_identical(specs, seed):
    tensors = [_random_tensor(dtype, n, seed + i) for i, (dtype, n) in enumerate(specs)]
    originals = [t.clone() for t in tensors]
    sections = [(t.dtype, t.numel()) for t in tensors]

    message = pack(tensors)

    assert message.dtype == torch.uint8 and message.dim() == 1, "a message is a flat uint8 tensor"
    assert message.numel() == message_nbytes(sections), "message_nbytes disagrees with the packed size"
    assert message.numel() % 8 == 0, f"message of {message.numel()} bytes is not 8-byte aligned"
    assert message.numel() >= sum(n * d.itemsize for d, n in sections), "message too small for its sections"
    for t, o in zip(tensors, originals):
        assert torch.equal(_bits(t), _bits(o)), "pack modified its input"

    out = unpack(message, sections)
    assert len(out) == len(tensors), "unpack returned the wrong number of sections"
    for i, (got, want) in enumerate(zip(out, tensors)):
        assert got.dtype == want.dtype, f"section {i}: dtype {got.dtype}, expected {want.dtype}"
        assert got.shape == (want.numel(),), f"section {i}: shape {tuple(got.shape)}, expected ({want.numel()},)"
        assert torch.equal(_bits(got), _bits(want)), f"section {i} ({want.dtype}, {want.numel()}) changed bits"


@SETTINGS
@given(specs=st.lists(st.tuples(st.sampled_from(DTYPES), st.integers(0, 50)), min_size=1, max_size=4))
def test_message_nbytes_pads_every_section_to_8_bytes(specs):
    expected = sum(-(-n * d.itemsize // 8) * 8 for d, n in specs)
    assert message_nbytes(specs) == expected, f"message_nbytes({specs}) is not the sum of 8-byte-padded sections"


def test_pack_flattens_multidimensional_tensors():
    a = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    b = torch.tensor([[1.5], [-2.0]], dtype=torch.float64)
    ia, ib = unpack(pack([a, b]), [(torch.int32, 6), (torch.float64, 2)])
    assert torch.equal(ia, a.reshape(-1)) and torch.equal(ib, b.reshape(-1)), "2-D tensors did not round-trip"


def test_unpack_views_into_the_message():
    message = pack([torch.tensor([1, 2, 3], dtype=torch.int64)])
    (view,) = unpack(message, [(torch.int64, 3)])
    view[0] = 7
    assert unpack(message, [(torch.int64, 3)])[0][0].item() == 7, "unpack should return views, not copies"


@pytest.mark.parametrize("sections", [
    [(torch.int64, 3)],  # needs 24 bytes
    [(torch.int64, 2), (torch.float32, 1)],  # needs 16 + 8 = 24
    [(torch.int32, 5)],  # needs 24 (20 padded)
    [(torch.int64, 4)],  # needs 32 (too large)
    [],  # needs nothing
])
def test_unpack_rejects_sections_that_do_not_fill_the_message(sections):
    message = pack([torch.arange(2, dtype=torch.int64)])  # 16 bytes
    assert message.numel() == 16
    with pytest.raises(ValueError):
        unpack(message, sections)


# ---- programs ---------------------------------------------------------------------------------------------

def _int_message(value: int) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int64).view(torch.uint8)


def _int_of(message: torch.Tensor) -> int:
    return int(message.view(torch.int64)[0])


def ring_shift(rank: int, world: int, payload: int | None = None):
    """One round: send ``payload`` (default: the rank id) to rank + 1, return what rank - 1 sent."""
    if world == 1:
        return rank if payload is None else payload
    value = rank if payload is None else payload
    src, dst = (rank - 1) % world, (rank + 1) % world
    got = yield Round({dst: _int_message(value)}, {src: 8})
    assert set(got) == {src}, f"rank {rank} got messages from {sorted(got)}, expected only {src}"
    return _int_of(got[src])


def ring_allgather(rank: int, world: int):
    """world - 1 rounds of passing ids along the ring; returns every rank's id, in rank order."""
    ids = {rank: rank}
    carry = rank
    for step in range(1, world):
        src, dst = (rank - 1) % world, (rank + 1) % world
        got = yield Round({dst: _int_message(carry)}, {src: 8})
        carry = _int_of(got[src])
        ids[(rank - step) % world] = carry
    return [ids[r] for r in range(world)]


def no_rounds(rank: int):
    return ("done", rank)
    yield  # unreachable: makes this a generator


@pytest.mark.parametrize("world", range(1, 9))
def test_run_locally_ring_shift(world):
    results = run_locally([ring_shift(r, world) for r in range(world)])
    assert results == [(r - 1) % world for r in range(world)], f"ring shift over {world} ranks: {results}"


@pytest.mark.parametrize("world", range(1, 9))
def test_run_locally_multi_round_ring(world):
    results = run_locally([ring_allgather(r, world) for r in range(world)])
    assert results == [list(range(world))] * world, f"ring all-gather over {world} ranks: {results}"


@pytest.mark.parametrize("world", [1, 2, 5])
def test_run_locally_programs_without_rounds(world):
    results = run_locally([no_rounds(r) for r in range(world)])
    assert results == [("done", r) for r in range(world)], f"zero-round programs returned {results}"


def test_run_locally_received_messages_are_copies():
    sent = _int_message(5)

    def sender():
        yield Round({1: sent})

    def receiver():
        got = yield Round(recvs={0: 8})
        got[0].zero_()
        return None

    run_locally([sender(), receiver()])
    assert _int_of(sent) == 5, "the receiver's message aliases the sender's tensor"


def _one_round(sends=None, recvs=None, result=None):
    yield Round(sends or {}, recvs or {})
    return result


def _rounds(n):
    for _ in range(n):
        yield Round()
    return n


def test_run_locally_rejects_a_send_nobody_receives():
    with pytest.raises(RuntimeError, match="never received"):
        run_locally([_one_round(sends={1: _int_message(1)}), _one_round()])


def test_run_locally_rejects_a_receive_nobody_sends():
    with pytest.raises(RuntimeError, match="sends nothing"):
        run_locally([_one_round(), _one_round(recvs={0: 8})])


def test_run_locally_rejects_a_size_mismatch():
    with pytest.raises(RuntimeError, match="expects"):
        run_locally([_one_round(sends={1: _int_message(1)}), _one_round(recvs={0: 16})])


def test_run_locally_rejects_sending_to_oneself():
    with pytest.raises(RuntimeError, match="sends to rank 0"):
        run_locally([_one_round(sends={0: _int_message(1)}, recvs={0: 8}), _one_round()])


def test_run_locally_rejects_sending_outside_the_world():
    with pytest.raises(RuntimeError, match="sends to rank 2"):
        run_locally([_one_round(sends={2: _int_message(1)}), _one_round()])


@pytest.mark.parametrize("counts", [(0, 1), (1, 0), (1, 2), (3, 2), (2, 2, 3)])
def test_run_locally_rejects_programs_of_different_lengths(counts):
    with pytest.raises(RuntimeError, match="finished"):
        run_locally([_rounds(n) for n in counts])


def test_run_locally_accepts_programs_of_equal_lengths():
    assert run_locally([_rounds(3) for _ in range(4)]) == [3] * 4, "equal-length empty rounds should just run"


# ---- run_program on gloo ----------------------------------------------------------------------------------

def _ring_job():
    rank, world = dist.get_rank(), dist.get_world_size()
    shift = run_program(ring_shift(rank, world))
    gather = run_program(ring_allgather(rank, world))
    return shift, gather


@pytest.mark.parametrize("world", [2, 3, 5])
def test_run_program_matches_run_locally(world):
    out = run_ranks(world, _ring_job)
    local_shift = run_locally([ring_shift(r, world) for r in range(world)])
    local_gather = run_locally([ring_allgather(r, world) for r in range(world)])
    for rank, ((shift, s_bytes, s_msgs), (gather, g_bytes, g_msgs)) in enumerate(out):
        assert shift == local_shift[rank], f"rank {rank}: ring shift gave {shift}, run_locally {local_shift[rank]}"
        assert (s_bytes, s_msgs) == (8, 1), f"rank {rank}: one 8-byte message expected, got {(s_bytes, s_msgs)}"
        assert gather == local_gather[rank], f"rank {rank}: ring gather gave {gather}"
        assert (g_bytes, g_msgs) == (8 * (world - 1), world - 1), \
            f"rank {rank}: {world - 1} 8-byte messages expected, got {(g_bytes, g_msgs)}"


def _zero_byte_program(rank: int, world: int):
    """A round of empty messages both ways, then one real message to the next rank."""
    peer = 1 - rank
    got = yield Round({peer: torch.empty(0, dtype=torch.uint8)}, {peer: 0})
    empty = (got[peer].dtype, got[peer].numel())
    value = yield from ring_shift(rank, world, payload=100 + rank)
    return empty, value


def _zero_byte_job():
    rank = dist.get_rank()
    return run_program(_zero_byte_program(rank, 2))


def test_run_program_skips_zero_byte_messages():
    out = run_ranks(2, _zero_byte_job)
    local = run_locally([_zero_byte_program(r, 2) for r in range(2)])
    for rank, (result, sent, messages) in enumerate(out):
        assert result == local[rank], f"rank {rank}: {result}, run_locally gave {local[rank]}"
        assert result[0] == (torch.uint8, 0), f"rank {rank}: the empty message came back as {result[0]}"
        assert result[1] == 100 + (1 - rank), f"rank {rank}: real message after the empty round was {result[1]}"
        assert (sent, messages) == (8, 1), f"rank {rank}: the empty message was counted: {(sent, messages)}"


SUBGROUP = [0, 2, 4]


def _subgroup_job():
    rank = dist.get_rank()
    group = dist.new_group(SUBGROUP)  # every rank must take part in creating it
    if rank not in SUBGROUP:
        return None
    me, size = dist.get_rank(group), dist.get_world_size(group)
    return me, run_program(ring_shift(me, size, payload=rank), group=group)


def test_run_program_in_a_subgroup_uses_group_ranks():
    out = run_ranks(5, _subgroup_job)
    for rank, res in enumerate(out):
        if rank not in SUBGROUP:
            assert res is None, f"rank {rank} is outside the group but returned {res}"
            continue
        me, (value, sent, messages) = res
        assert me == SUBGROUP.index(rank), f"rank {rank} has group rank {me}"
        expected = SUBGROUP[(me - 1) % len(SUBGROUP)]  # the global id of the previous group member
        assert value == expected, f"group rank {me}: received {value}, expected {expected}"
        assert (sent, messages) == (8, 1), f"group rank {me}: {(sent, messages)}"
