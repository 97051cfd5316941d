"""The GRACE transcription (gcomp.bench.grace_reference) runs and decodes signs as GRACE does, and the side-by-side
timing runs on a small tensor."""
import torch

from gcomp.bench import grace_reference as grace


def test_grace_sign_codecs_decode_signs():
    x = torch.tensor([1.5, -2.0, 0.0, -0.0, -1e-3, 4.0])
    signs = torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0, 1.0])  # GRACE sends x >= 0: zeros go as +1
    sign = grace.SignSGDCompressor()
    tensors, ctx = sign.compress(x.view(2, 3), "t")
    assert tensors[0].dtype == torch.uint8
    decoded = sign.decompress(tensors, ctx)
    assert decoded.shape == (2, 3) and torch.equal(decoded.reshape(-1), signs)
    assert torch.equal(sign.aggregate([decoded, -decoded, decoded]).reshape(-1), signs)  # sign of the sum
    ef = grace.EFSignSGDCompressor(lr=0.5)
    tensors, ctx = ef.compress(x, "t")
    torch.testing.assert_close(ef.decompress(tensors, ctx), x.abs().mean() * signs)
    signum = grace.SignumCompressor(momentum=0.9)
    signum.compress(x, "t")
    tensors, ctx = signum.compress(-x, "t")  # momentum 0.9 * x + 0.1 * (-x) keeps x's signs
    assert torch.equal(signum.decompress(tensors, ctx)[x != 0], signs[x != 0])


def test_side_by_side_timing_runs_and_both_steps_decode_alike_in_sign():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    for name in grace.METHODS:
        ours, theirs = grace.gcomp_step(name, x)(), grace.grace_step(name, x)()
        assert ours.shape == theirs.shape == x.shape
        if name == "signsgd":  # one rank: GRACE's bare sign, gcomp's scaled sign
            assert torch.equal(ours.sign(), theirs)
    rows = grace.compare(1000, repeats=1)
    assert [r["method"] for r in rows] == list(grace.METHODS)
    assert all(r["grace_s"] > 0 and r["gcomp_s"] > 0 and r["ratio"] > 0 for r in rows)
