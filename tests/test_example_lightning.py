"""examples/lightning_train.py on 2 CPU processes: the hook ran (fewer bytes than dense), the replicas agree,
and resuming from the first epoch's checkpoint ends bit-identical to the uninterrupted run (topk: its residuals
travel in Lightning's checkpoint, every rank's own). And Lightning's own ``DDPStrategy(ddp_comm_hook=...,
ddp_comm_state=...)`` registration takes ``gcomp.comm_hook``'s pair."""
from __future__ import annotations

import csv
import re
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

from tests.distributed import run_ranks  # noqa: E402
from tests.models import assert_same_parameters, ddp, flat_params, mlp, run_example, train  # noqa: E402

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "lightning_train.py"


def _run(folder: Path, *extra: str) -> str:
    return run_example([sys.executable, str(EXAMPLE), "--dir", str(folder), "--epochs", "2", *extra], cwd=folder.parent)


@pytest.mark.slow
def test_lightning_example_compresses_and_resumes_bit_identically(tmp_path):
    whole = _run(tmp_path / "whole")
    sent, dense, steps = map(int, re.search(r"BYTES sent=(\d+) dense=(\d+) steps=(\d+)", whole).groups())
    assert steps > 0 and 0 < sent < dense / 4, whole[-2000:]
    assert_same_parameters(*(tmp_path / "whole" / f"final_rank{r}.pt" for r in range(2)))
    with open(tmp_path / "whole" / "logs" / "version_0" / "metrics.csv") as f:
        logged = list(csv.DictReader(f))
    ratios = [float(row["gcomp_ratio"]) for row in logged if row.get("gcomp_ratio")]
    per_step = [float(row["gcomp_bytes_per_step"]) for row in logged if row.get("gcomp_bytes_per_step")]
    assert ratios and all(r > 1 for r in ratios) and per_step and all(0 < b < dense / steps for b in per_step[1:])
    checkpoint = torch.load(tmp_path / "whole" / "epoch=0.ckpt", weights_only=True)
    assert sorted(checkpoint["callbacks"]["GcompCallback"]["gcomp"]["ranks"]) == ["rank0", "rank1"]
    _run(tmp_path / "resumed", "--resume", str(tmp_path / "whole" / "epoch=0.ckpt"))
    assert_same_parameters(*(tmp_path / "resumed" / f"final_rank{r}.pt" for r in range(2)))
    assert_same_parameters(tmp_path / "whole" / "final_rank0.pt", tmp_path / "resumed" / "final_rank0.pt")


def _through_lightnings_registration() -> dict:
    """What DDPStrategy does with ddp_comm_hook/ddp_comm_state where it registers hooks (CUDA only), on CPU."""
    import gcomp
    from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook

    model = ddp(mlp(0))
    state, hook = gcomp.comm_hook("topk", ratio=0.05)
    _register_ddp_comm_hook(model=model, ddp_comm_state=state, ddp_comm_hook=hook)
    train(model, 3)
    return {"stats": dict(state.stats), "params": flat_params(model)}


def test_lightnings_own_registration_takes_comm_hooks_pair():
    results = run_ranks(2, _through_lightnings_registration)
    for r in results:
        assert r["stats"]["steps"] == 3 and r["stats"]["bytes_sent"] < r["stats"]["bytes_dense"]
    assert torch.equal(results[0]["params"], results[1]["params"])


def test_gcomp_install_on_a_lightning_module_names_the_callback():
    import lightning as L

    import gcomp

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 2)

    with pytest.raises(TypeError, match=r"got Tiny\. This is a LightningModule: Lightning builds the DDP model when "
                                        r"fitting starts; pass callbacks=\[gcomp.integrations.lightning."
                                        r"GcompCallback\('topk', ratio=0.01\)\] to L.Trainer"):
        gcomp.install(Tiny(), "topk", ratio=0.05)


def test_on_one_process_the_callback_installs_nothing_and_says_so(tmp_path):
    import lightning as L

    from gcomp.integrations.lightning import GcompCallback

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, _):
            return self.layer(batch).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    callback = GcompCallback("topk", ratio=0.05)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, callbacks=[callback], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path)
    trainer.fit(Tiny(), torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=4))
    assert str(callback.state) == ("gcomp: not distributed: nothing compressed (topk; one process: Lightning made "
                                   "no DistributedDataParallel)")
    assert callback.state.stats["bytes_sent"] == 0 and callback.state_dict() == {}
