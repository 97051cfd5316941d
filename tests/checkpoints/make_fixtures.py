"""Regenerate every checkpoint fixture: ``python -m tests.checkpoints.make_fixtures`` from the repository root.

Each case (``CASES`` below; written to ``data/cases.json`` for the loader) trains a small model for a few steps on
gloo ranks, through the public API (``recipes.Run``), then saves ``state.gather_state_dict()`` (every rank's part
in one object) with ``torch.save`` to ``data/<label>.pt`` on rank 0. ``data/inventory.txt`` lists what each file
holds (the key tree, tensors by dtype and shape), for whoever changes the checkpoint code.

The files are the contract that ``test_fixtures_load.py`` holds gcomp to; regenerate them only to add cases.
"""
from __future__ import annotations

import io
import json
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import gcomp
from tests.checkpoints import recipes
from tests.checkpoints.recipes import label

DDP = {"bucket_cap_mb": 0.002}  # 2 KB buckets: the MLP splits into several buckets after DDP's rebuild
STEPS = 8  # past every stateful method's warm-up (DDP's rebuild after step 1; pactrain packs after one more)


def _ddp(method: str, params: dict | None = None, model: str = "mlp", steps: int = STEPS, world: int = 2,
         suffix: str = "", ddp: dict | None = None) -> dict:
    params = params or {}
    return {"label": label("ddp", method, params, suffix), "kind": "ddp", "method": method, "params": params,
            "world": world, "model": model, "steps": steps, "ddp": DDP if ddp is None else ddp}


# the model each method needs: pactrain reads pruning masks; prunex filter-pruned masks across 2 nodes
MODEL_OF = {"pactrain": "pruned_mlp", "prunex": "structured_cnn"}


def _cases() -> list[dict]:
    cases = []
    for name in gcomp.available():
        if name == "prunex":  # two nodes of two ranks: the state lives on the node leaders
            cases.append(_ddp(name, {"ranks_per_node": 2}, model=MODEL_OF[name], world=4, ddp={}))
        else:
            cases.append(_ddp(name, model=MODEL_OF.get(name, "mlp")))
    cases += [
        _ddp("pactrain", {"ternary": True}, model="pruned_mlp"),
        _ddp("pactrain", {"ternary": True, "error_feedback": True}, model="pruned_mlp"),
        _ddp("pactrain", {"ternary": True, "rounds": 2}, model="pruned_mlp"),
        _ddp("mx", {"format": "mxfp4"}),
        _ddp("mx", {"format": "nvfp4"}),
        _ddp("fp8", {"error_feedback": False}),
        _ddp("topk", {"positions": "raw"}),
        _ddp("topk", {"values": "bf16"}),
        _ddp("signsgd", {"aggregate": "mean"}),
        _ddp("powersgd", {"error_feedback": False}),
        _ddp("terngrad", {"collective": "allreduce"}),
        _ddp("threshold", {"threshold": 0.002}),
        _ddp("dgc", {"warmup_steps": 3, "warmup_stages": 2}),  # the density warm-up done by step 5 of 8
        _ddp("auto", {"allow": "half", "trials": 1}, steps=12),  # identity, fp16, bf16 measured, a choice made
        _ddp("auto", {}, model="pruned_mlp", steps=12, suffix="-on-pruned_mlp"),  # 'exact' adds pactrain
        _ddp("hierarchical", {"inner": "topk", "ranks_per_node": 2}, world=4),  # top-k's residuals on leaders
        _ddp("prunex", {"ranks_per_node": 2, "ternary": True, "error_feedback": True}, model="structured_cnn",
             world=4, ddp={}),
    ]
    cases.append({"label": label("comm_hook", "topk", {}, "-no-model"), "kind": "comm_hook", "method": "topk",
                  "params": {}, "world": 2, "model": "mlp", "steps": STEPS, "ddp": DDP})
    fsdp = [(name, {}) for name in gcomp.available(fsdp=True)] + [("pactrain", {"ternary": True})]
    for name, params in fsdp:
        cases.append({"label": label("fsdp", name, params), "kind": "fsdp", "method": name, "params": params,
                      "world": 2, "model": "fsdp_pruned_mlp" if name == "pactrain" else "fsdp_mlp",
                      "steps": STEPS})
    cases.append({"label": label("hsdp", "topk", {}, "-replica-over-fp8-shards"), "kind": "hsdp",
                  "method": "topk", "params": {}, "shard_method": "fp8", "shard_params": {}, "replicas": 2,
                  "world": 4, "model": "fsdp_mlp", "steps": STEPS})
    outer = {"sync_every": 2, "fragments": 1, "overlap": 0, "bucket_mb": 0.002}
    streaming = {"sync_every": 4, "fragments": 2, "overlap": 1, "bucket_mb": 0.002}
    for method, settings, suffix, steps in (("topk", outer, "", 6), ("fp16", outer, "", 6),
                                            ("topk", streaming, "-streaming", 6)):
        # streaming: fragment 1 launches at inner step 6 and applies at 7, so the checkpoint holds it in flight
        cases.append({"label": label("diloco", method, {}, suffix), "kind": "diloco", "method": method,
                      "params": {}, "world": 2, "model": "mlp", "steps": steps, "diloco": settings})
    labels = [c["label"] for c in cases]
    assert len(set(labels)) == len(labels), sorted(labels)
    return cases


CASES = _cases()


# --- the rank job ---------------------------------------------------------------------------------------------

def job_save(cases: list[dict]) -> dict:
    """Every case of this world size: build, train ``steps`` steps, gather, save on rank 0; a summary per case."""
    out = {}
    for case in cases:
        run = recipes.Run(case)
        run.train(0, case["steps"])
        gathered = run.saved()
        if dist.get_rank() == 0:
            torch.save(gathered, recipes.DATA / f"{case['label']}.pt")
        out[case["label"]] = {"iteration": run.state.iteration, "stats": dict(run.state.stats)}
        run.close()
    return out


# --- what each file holds -------------------------------------------------------------------------------------

def _tree(value, indent: str, lines: list[str], depth: int = 0) -> None:
    """``value`` as indented lines: dicts key by key, a dict of more than 3 tensors (per parameter) or a list by
    its count and its first entry, tensors by dtype and shape, bytes by length, the rest by repr."""
    if isinstance(value, dict):
        if not value:
            lines[-1] += "  {}"
            return
        if len(value) > 3 and all(isinstance(v, torch.Tensor) for v in value.values()):
            kinds = sorted({str(v.dtype).removeprefix("torch.") for v in value.values()})
            lines[-1] += f"  {{{len(value)} tensors ({', '.join(kinds)}), e.g. {next(iter(value))!r}}}"
            return
        for k, v in value.items():
            lines.append(f"{indent}{k!s}:")
            _tree(v, indent + "  ", lines, depth + 1)
    elif isinstance(value, (list, tuple)) and value and isinstance(value[0], (dict, list, tuple, torch.Tensor)):
        lines[-1] += f"  [{len(value)} x {type(value[0]).__name__}], the first:"
        lines.append(f"{indent}[0]:")
        _tree(value[0], indent + "  ", lines, depth + 1)
    elif isinstance(value, torch.Tensor):
        lines[-1] += f"  tensor {str(value.dtype).removeprefix('torch.')} {tuple(value.shape)}"
    elif isinstance(value, bytes):
        lines[-1] += f"  bytes ({len(value):,})"
    else:
        text = repr(value)
        lines[-1] += f"  {text if len(text) < 80 else text[:77] + '...'}"


def inventory(case: dict) -> list[str]:
    """The key tree of one file, each rank's part unpacked (rank 0's shown; the others' keys are alike)."""
    state = torch.load(recipes.DATA / f"{case['label']}.pt", weights_only=True)
    if case["kind"] == "hsdp":  # one state per shard index: the first shown
        lines = [f"== {case['label']}: {{{', '.join(map(repr, state))}}}, each a gathered replica state; "
                 "'shard0' shown"]
        state = state["shard0"]
    else:
        lines = []
    header = {k: v for k, v in state.items() if k != "ranks"}
    lines += [f"== {case['label']}  ({(recipes.DATA / (case['label'] + '.pt')).stat().st_size:,} bytes)"]
    lines.append("file:")
    _tree({**header, "ranks": {k: v for k, v in state["ranks"].items()}}, "  ", lines)
    first = sorted(state["ranks"])[0]
    part = torch.load(io.BytesIO(state["ranks"][first]), weights_only=True)
    lines.append(f"{first} (unpacked; stats omitted):")
    _tree({k: v for k, v in part.items() if k != "stats"}, "  ", lines)
    return lines


def main() -> None:
    from tests.distributed import close_pools, run_ranks

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=recipes.DATA.parent).stdout.strip()
    recipes.DATA.mkdir(exist_ok=True)
    for old in recipes.DATA.glob("*.pt"):
        old.unlink()
    worlds = sorted({c["world"] for c in CASES})
    summary = {}
    try:
        for world in worlds:
            cases = [c for c in CASES if c["world"] == world]
            began = time.monotonic()
            ranks = run_ranks(world, job_save, cases, fresh=True, timeout=600)
            print(f"world {world}: {len(cases)} cases in {time.monotonic() - began:.1f} s", flush=True)
            summary.update(ranks[0])
    finally:
        close_pools()
    for case in CASES:
        got = summary[case["label"]]
        assert got["iteration"] == case["steps"], (case["label"], got["iteration"], case["steps"])
    header = {
        "about": "checkpoint fixtures: each case's recipe (tests/checkpoints/recipes.py) and steps taken; files "
                 "data/<label>.pt hold state.gather_state_dict() after those steps (hsdp: one per shard index)",
        "captured_with": {"gcomp_commit": commit, "torch": torch.__version__.split("+")[0],
                          "python": sys.version.split()[0]},
        "models": {name: " ".join(build.__doc__.split()) for name, build in recipes.MODELS.items()},
        "training": f"SGD lr {recipes.LR} (no momentum) on recipes.batch(model, step, rank), steps 0 .. steps-1; "
                    "DiLoCo: outer.step() after each inner step"}
    text = json.dumps(header, indent=1)[:-2]  # one case a line, for diffs
    text += ',\n "cases": [\n' + ",\n".join("  " + json.dumps(c) for c in CASES) + "\n ]\n}\n"
    assert json.loads(text)["cases"] == CASES
    recipes.CASES_FILE.write_text(text)
    lines = []
    for case in CASES:
        lines += inventory(case) + [""]
    (recipes.DATA / "inventory.txt").write_text("\n".join(lines))
    total = sum(p.stat().st_size for p in recipes.DATA.iterdir())
    for case in CASES:
        stats = summary[case["label"]]["stats"]
        print(f"{case['label']:60s} it={summary[case['label']]['iteration']:3d} "
              f"ratio={stats['bytes_dense'] / max(stats['bytes_sent'], 1):7.2f} "
              f"{', '.join(f'{k}={stats[k]}' for k in ('warmup_steps', 'packed_buckets', 'freezes') if k in stats)}")
    print(f"{len(CASES)} fixtures, data/ holds {total:,} bytes")


if __name__ == "__main__":
    main()
