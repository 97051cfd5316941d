"""Bad input, one row each: what is called, what it must raise (or warn), and the words the message must hold:
the parameter, key or thing it names, and where useful the fix. A table to scan; add a row for every new check.

Rows that need a DDP model run in one rank job (tests/bad_input_jobs.py); the others run here.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import gcomp
from gcomp.cli import main as cli
from gcomp.pruning import StructuredADMM, prune
from gcomp.bucket import BucketInfo
from gcomp.core import LayoutState as BucketState
from gcomp.registry import from_spec
from tests import bad_input_jobs as jobs
from tests import load_check_jobs
from tests.distributed import run_ranks_once


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Conv2d(4, 8, 3), nn.Flatten(), nn.Linear(8 * 4 * 4, 3))


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _data(width: int = 4, n: int = 12) -> tuple:
    return torch.randn(n, width), torch.arange(n) % 3


def _frozen_first() -> nn.Module:
    """``_mlp`` with its first layer frozen (DDP's buckets do not hold it)."""
    model = _mlp()
    model[0].requires_grad_(False)
    return model


def _admm_pruned_twice():
    admm = StructuredADMM(_cnn())
    admm.prune()
    admm.prune()


def _results_file(tmp, content: str) -> str:
    path = tmp / "results.json"
    path.write_text(content)
    return str(path)


# (label, call, what it must raise or "warns"/"ok", words its message must hold)
LOCAL = [
    ("create: an unknown name", lambda: gcomp.create("topkk"), gcomp.UnknownMethodError, ["topkk", "'topk'"]),
    ("create: ratio 0", lambda: gcomp.create("topk", ratio=0), ValueError, ["'ratio'", "(0, 1]"]),
    ("create: ratio 1.5", lambda: gcomp.create("topk", ratio=1.5), ValueError, ["'ratio'", "1.5"]),
    ("create: ratio 'abc'", lambda: gcomp.create("topk", ratio="abc"), ValueError, ["topk", "'ratio'", "'abc'"]),
    ("create: an unknown parameter", lambda: gcomp.create("topk", ratioo=0.1), ValueError, ["ratioo", "ratio"]),
    ("create: ternary='yes'", lambda: gcomp.create("pactrain", ternary="yes"), ValueError,
     ["pactrain", "'ternary'", "bool"]),
    ("create: a collective terngrad has not", lambda: gcomp.create("terngrad", collective="p2p"), ValueError,
     ["'collective'", "allgather"]),
    ("create: qsgd with 0 levels", lambda: gcomp.create("qsgd", levels=0), ValueError, ["'levels'"]),
    ("create: hierarchical inside hierarchical", lambda: gcomp.create("hierarchical", inner="hierarchical"),
     ValueError, ["'inner'"]),
    ("create: an unknown inner method", lambda: gcomp.create("hierarchical", inner="nosuch"), ValueError,
     ["'inner' must name a registered method", "nosuch"]),
    ("create: dgc with 0 warm-up stages", lambda: gcomp.create("dgc", warmup_stages=0), ValueError,
     ["'warmup_stages'"]),
    ("create: spardl with density 0", lambda: gcomp.create("spardl", density=0), ValueError, ["'density'"]),
    ("create: powersgd with rank 0", lambda: gcomp.create("powersgd", rank=0), ValueError, ["'rank'"]),
    ("create: an unknown aggregation", lambda: gcomp.create("signsgd", aggregate="avg"), ValueError,
     ["'aggregate'", "majority"]),
    ("create: a negative seed", lambda: gcomp.create("terngrad", seed=-1), ValueError, ["'seed'"]),
    ("create: a negative check_every", lambda: gcomp.create("pactrain", check_every=-1), ValueError,
     ["'check_every'"]),
    ("create: seed=2**70 (hashed into a stream)", lambda: gcomp.create("terngrad", seed=2**70), "ok", []),
    ("create: clip without ternary", lambda: gcomp.create("pactrain", clip=2.5), "warns",
     ["'clip'", "no effect without ternary=True"]),
    ("create: error_feedback without ternary", lambda: gcomp.create("pactrain", error_feedback=True), "warns",
     ["'error_feedback'", "no effect"]),
    ("register: an empty name", lambda: gcomp.register("")(lambda: None), ValueError, ["non-empty"]),
    ("auto: allow='fast'", lambda: gcomp.create("auto", allow="fast"), ValueError,
     ["allow entry 'fast'", "neither a preset (exact, half) nor a registered method", "the preset 'exact'"]),
    ("auto: allow='Exact'", lambda: gcomp.create("auto", allow="Exact"), ValueError,
     ["allow entry 'Exact'", "preset (exact, half)", "did you mean the preset 'exact'", "case-sensitive"]),
    ("auto: a spec with allow=fast", lambda: from_spec("auto:allow=fast"), ValueError,
     ["allow entry 'fast'", "preset (exact, half)"]),
    ("auto: allow='identity|' (an empty entry)", lambda: gcomp.create("auto", allow="identity|"), ValueError,
     ["allow entry 2 of 'identity|' is empty", "identity|fp16"]),
    ("auto: an empty entry in a list", lambda: gcomp.create("auto", allow=["identity", " "]), ValueError,
     ["allow entry 2 of ['identity', ' '] is empty"]),
    ("auto: a preset inside a list", lambda: gcomp.create("auto", allow="identity|half"), ValueError,
     ["allow entry 'half' is a preset", "stands alone (allow='half')"]),
    ("spec: a parameter twice", lambda: from_spec("topk:ratio=0.1,ratio=0.2"), ValueError,
     ["'topk:ratio=0.1,ratio=0.2'", "parameter 'ratio' of topk is given twice"]),
    ("spec: an empty parameter", lambda: from_spec("topk:ratio=0.1,,"), ValueError,
     ["'topk:ratio=0.1,,'", "an empty parameter", "topk:key=value,key=value"]),
    ("spec: a parameter twice in a nested spec",
     lambda: gcomp.create("hierarchical", inner="topk:ratio=0.1,ratio=0.2"), ValueError,
     ["'inner'", "parameter 'ratio' of topk is given twice"]),
    ("spec: a parameter twice in an allow entry", lambda: gcomp.create("auto", allow=["topk:ratio=0.1,ratio=0.2"]),
     ValueError, ["allow entry 'topk:ratio=0.1,ratio=0.2'", "parameter 'ratio' of topk is given twice"]),
    ("create: a spec for a name", lambda: gcomp.create("topk:ratio=0.1"), gcomp.UnknownMethodError,
     ["'topk:ratio=0.1' is a method spec", "as keywords ('topk', ratio=0.1)", "from_spec"]),
    ("create: a spec for a name, a parameter twice", lambda: gcomp.create("topk:ratio=0.1,ratio=0.2"),
     gcomp.UnknownMethodError, ["is a method spec", "parameter 'ratio' of topk is given twice"]),
    ("prune: ratio 1", lambda: prune(_mlp(), 1.0, "magnitude"), ValueError, ["ratio", "[0, 1)"]),
    ("prune: a negative ratio", lambda: prune(_mlp(), -0.1, "magnitude"), ValueError, ["ratio"]),
    ("prune: a ratio that empties a layer", lambda: prune(_mlp(), 0.999999, "magnitude"), ValueError,
     ["ratio=0.999999", "all 56 of the model's prunable weights"]),
    ("prune: a ratio that empties a layer (layer scope)",
     lambda: prune(nn.Sequential(nn.Linear(4, 100), nn.ReLU(), nn.Linear(100, 3)), 0.9985, "magnitude",
                   scope="layer"), ValueError, ["ratio=0.9985", "all 300 of layer '2''s weights"]),
    ("prune: an unknown method", lambda: prune(_mlp(), 0.5, "nosuch"), ValueError, ["unknown pruning method"]),
    ("prune: an unknown scope", lambda: prune(_mlp(), 0.5, "magnitude", scope="net"), ValueError,
     ["scope", "'net'"]),
    ("prune: GraSP without data", lambda: prune(_mlp(), 0.5, "grasp"), ValueError, ["needs data"]),
    ("prune: GraSP data of the wrong shape", lambda: prune(_mlp(), 0.5, "grasp", data=_data(5)), ValueError,
     ["GraSP data", "shape (5,)"]),
    ("prune: GraSP inputs and targets of other lengths",
     lambda: prune(_mlp(), 0.5, "grasp", data=(torch.randn(6, 4), torch.arange(7) % 3)), ValueError,
     ["differ in length", "6 vs 7"]),
    ("prune: enter_timeout 0", lambda: prune(_mlp(), 0.5, "magnitude", enter_timeout=0), ValueError,
     ["enter_timeout", "> 0", "got 0"]),
    ("prune: temperature 0", lambda: prune(_mlp(), 0.5, "grasp", data=_data(), temperature=0), ValueError,
     ["temperature"]),
    ("StructuredADMM: sparsity 1", lambda: StructuredADMM(_cnn(), sparsity=1.0), ValueError, ["sparsity"]),
    ("StructuredADMM: an unknown structure", lambda: StructuredADMM(_cnn(), structure="rows"), ValueError,
     ["structure 'rows'", "filters"]),
    ("StructuredADMM: an unknown layer", lambda: StructuredADMM(_cnn(), layers=["nosuch"]), ValueError,
     ["'layers'", "nosuch"]),
    ("StructuredADMM: a negative rho", lambda: StructuredADMM(_cnn(), rho=-1), ValueError, ["rho"]),
    ("StructuredADMM: interval 0", lambda: StructuredADMM(_cnn(), interval=0), ValueError, ["interval"]),
    ("StructuredADMM: prune twice", _admm_pruned_twice, RuntimeError, ["already called"]),
    ("comm_hook: a dense= pattern that matches nothing", lambda: gcomp.comm_hook("topk", model=_mlp(), dense="*.bais"),
     ValueError, ["pattern '*.bais' matches no trained parameter", "0.weight, 0.bias", "fix the pattern"]),
    ("comm_hook: a dense= pattern that matches a frozen parameter only", lambda: gcomp.comm_hook(
        "topk", model=_frozen_first(), dense="0.bias"), ValueError, ["'0.bias' matches no trained parameter",
                                                                    "requires_grad", "2.weight"]),
    ("comm_hook: dense= without a model", lambda: gcomp.comm_hook("topk", dense="*.bias"), ValueError,
     ["dense=['*.bias']", "needs the model", "model=ddp_model"]),
    ("comm_hook: dense_below=0", lambda: gcomp.comm_hook("topk", model=_mlp(), dense_below=0), ValueError,
     ["dense_below must be a positive number of entries", "got 0"]),
    ("comm_hook: dense_below=-5", lambda: gcomp.comm_hook("topk", model=_mlp(), dense_below=-5), ValueError,
     ["dense_below", "got -5"]),
    ("comm_hook: a dense= predicate that is not callable", lambda: gcomp.comm_hook("topk", model=_mlp(), dense=3),
     TypeError, ["predicate (name, param) -> bool", "got int", "not callable"]),
    ("comm_hook: dense=[]", lambda: gcomp.comm_hook("topk", model=_mlp(), dense=[]), ValueError,
     ["dense=[] names no parameter"]),
    ("comm_hook: a dense_below that keeps nothing dense", lambda: gcomp.comm_hook("topk", model=_mlp(),
                                                                                  dense_below=2),
     "warns", ["dense_below=2 keeps no parameter", "no effect"]),
]

# (label, argv, words on stderr); every one exits with 2 before any worker or pre-training starts
CLI = [
    ("describe: an unknown name", ["describe", "nosuch"], ["nosuch"]),
    ("bench: 0 workers", ["bench", "--workers", "0"], ["--workers", "at least 1", "got 0"]),
    ("bench: -1 workers", ["bench", "--workers", "-1"], ["--workers", "got -1"]),
    ("bench: 0 steps", ["bench", "--steps", "0"], ["--steps", "got 0"]),
    ("bench: batch 0", ["bench", "--batch", "0"], ["--batch", "got 0"]),
    ("bench: an unknown model", ["bench", "--model", "nosuch"], ["unknown model 'nosuch'", "mlp"]),
    ("bench: MLP widths that are not numbers", ["bench", "--model", "mlp:3,x"], ["mlp:3,x", "widths"]),
    ("bench: ratio 'abc'", ["bench", "--method", "topk:ratio=abc"], ["parameter 'ratio' of topk", "'abc'"]),
    ("bench: ternary='yes'", ["bench", "--method", "pactrain:ternary=yes"],
     ["parameter 'ternary' of pactrain", "'yes'"]),
    ("bench: an unknown method", ["bench", "--method", "nosuch"], ["nosuch"]),
    ("bench: an unknown parameter", ["bench", "--method", "topk:ratioo=0.1"], ["ratioo", "ratio"]),
    ("bench: a prune ratio of 1", ["bench", "--prune-ratio", "1"], ["--prune-ratio", "[0, 1)"]),
    ("bench: a parameter twice", ["bench", "--method", "topk:ratio=0.1,ratio=0.2"],
     ["parameter 'ratio' of topk is given twice"]),
    ("bench: auto:allow=fast", ["bench", "--method", "auto:allow=fast"],
     ["allow entry 'fast'", "neither a preset (exact, half) nor a registered method"]),
    ("bench: auto:allow=identity|", ["bench", "--method", "auto:allow=identity|"],
     ["allow entry 2 of 'identity|' is empty"]),
    ("bench --fsdp: spardl with 2 teams", ["bench", "--fsdp", "--method", "spardl:teams=2"],
     ["--fsdp", "spardl under FSDP2 cannot take teams=2", "FSDP2: 1"]),
    ("bench: workers that are not a number", ["bench", "--workers", "two"], ["--workers", "whole number", "got two"]),
    ("bench: seeds 0", ["bench", "--seeds", "0"], ["--seeds", "at least 1", "got 0"]),
    ("bench: eval every 0 steps", ["bench", "--eval-every", "0"], ["--eval-every", "at least 1", "got 0"]),
    ("bench: -1 pre-training epochs", ["bench", "--pretrain-epochs", "-1"],
     ["--pretrain-epochs", "at least 0", "got -1"]),
    ("bench: lr 0", ["bench", "--lr", "0"], ["--lr", "above 0", "got 0"]),
    ("bench: lr nan", ["bench", "--lr", "nan"], ["--lr", "above 0", "got nan"]),
    ("bench --overhead: -1 warm-up steps", ["bench", "--overhead", "--warmup", "-1"],
     ["--warmup", "at least 0", "got -1"]),
    ("bench --overhead: 0 profiled steps", ["bench", "--overhead", "--profile-steps", "0"],
     ["--profile-steps", "at least 1", "got 0"]),
    ("bench --codec: a size of 0 MB", ["bench", "--codec", "--sizes-mb", "0"], ["--sizes-mb", "above 0", "got 0"]),
    ("bench --codec: a negative size", ["bench", "--codec", "--sizes-mb", "1", "-4"],
     ["--sizes-mb", "above 0", "got -4"]),
    ("bench --codec: a size below one row", ["bench", "--codec", "--sizes-mb", "0.0001"],
     ["--sizes-mb 0.0001", "one row of 256 fp32 entries", "1 KiB"]),
    ("bench: --out under a file", ["bench", "--out", "{file}/sub"], ["--out", "file/sub", "is a file"]),
    ("bench --codec: --out under a file", ["bench", "--codec", "--out", "{file}/sub"], ["--out", "is a file"]),
    ("bench --overhead: --out under a file", ["bench", "--overhead", "--out", "{file}/sub"], ["--out", "is a file"]),
    ("bench: --out where nothing may be created", ["bench", "--out", "/proc/x"],
     ["--out /proc/x", "cannot write there", "in /proc"]),
    ("simulate: 0 workers", ["simulate", "--workers", "0"], ["--workers", "at least 1", "got 0"]),
    ("simulate: 0 ranks per node", ["simulate", "--ranks-per-node", "0"], ["--ranks-per-node", "got 0"]),
    ("simulate: a negative latency", ["simulate", "--alpha-us", "-5"], ["--alpha-us", "at least 0", "got -5"]),
]

# (label, --out, words): gcomp simulate's own refusals (SystemExit with the message: status 1), before any work
SIMULATE_OUT = [
    ("simulate: --out under a file", "{file}/sub", ["--out", "file/sub", "is a file"]),
    ("simulate: --out where nothing may be created", "/proc/x", ["--out /proc/x", "cannot write there", "in /proc"]),
]

# (label, results file content, words): gcomp simulate stops with a message, never a traceback
SIMULATE = [
    ("simulate: not JSON", "not json", ["cannot read", "as JSON"]),
    ("simulate: an empty file", "", ["cannot read"]),
    ("simulate: no runs", json.dumps({"rows": 3}), ["has no runs"]),
    ("simulate: runs that are not objects", json.dumps({"runs": [1]}), ["are not JSON objects"]),
    ("simulate: a run without figures", json.dumps({"runs": [{"method": "topk"}]}),
     ["method 'topk' lacks", "bytes_sent_per_step"]),
]

# (label, expected outcome: an exception type's name or "warns"/"ok", words)
IN_A_RANK = [
    ("install: a model that is not DDP", "TypeError", ["DistributedDataParallel", "Sequential"]),
    ("install: a second hook", "RuntimeError", ["already installed", "identity"]),
    ("install: parameters with a Method", "ValueError", ["ratio", "gcomp.create"]),
    ("install: neither name nor Method", "TypeError", ["name_or_method", "int"]),
    ("install: an unknown name", "UnknownMethodError", ["topkk"]),
    ("install: seed=2**70", "ok", []),
    ("install: pactrain on a model with no masks", "warns", ["no pruning masks", "dense"]),
    ("install: powersgd whose rank leaves every matrix dense", "warns", ["rank=64", "no parameter", "dense"]),
    ("install: hierarchical on one node", "warns", ["one node", "ranks_per_node"]),
    ("load: not a dict (an empty file)", "ValueError", ["expected a dict", "NoneType"]),
    ("load: not a gcomp state", "ValueError", ["not a gcomp state", "something else", "gcomp.ddp/4"]),
    ("load: a missing key", "ValueError", ["has no 'iteration'"]),
    ("load: a negative iteration", "ValueError", ["'iteration' must be at least 0", "-1"]),
    ("load: an iteration of the wrong type", "ValueError", ["'iteration' must be an int", "str"]),
    ("load: a world size of 0", "ValueError", ["'world_size' must be at least 1"]),
    ("load: a truncated rank state", "ValueError", ["rank0", "cannot be read", "truncated"]),
    ("load: another rank's state", "ValueError", ["rank1", "not of rank 0", "gather_state_dict()"]),
    ("load: another method's state", "ValueError", ["checkpoint is for topk", "randomk"]),
    ("load: other parameters", "ValueError", ["0.05", "0.5"]),
    ("load: a residual of the wrong size", "ValueError", ["'residuals'", "3 entries, the parameter has"]),
    ("load: a non-finite residual", "ValueError", ["'residuals'", "non-finite"]),
    ("load: a residual for a parameter the model lacks", "ValueError", ["'head.weight'", "no such parameter"]),
    ("load: residuals missing", "ValueError", ["(ResidualMemory) has no 'residuals'"]),
    ("load: a negative statistic", "ValueError", ["statistic 'steps'", "-2"]),
    ("load: an unknown tracker mode", "ValueError", ["'mode' must be one of", "'frozen'"]),
    ("install: a second install on an FSDP child after the root", "RuntimeError",
     ["already installed", "fp16", "installed on a module that contains it", "install once, on the root"]),
    ("install: an install on the root after one on an FSDP child", "RuntimeError",
     ["already installed", "its FSDP module '0'", "installed on its submodule '0'", "install once, on the root"]),
    ("load: FSDP2 pactrain saved on 2 ranks, resumed on 1", "ValueError",
     ["saved at world size 2, this run has 1", "pactrain under FSDP2 keeps its mask tracker", "resume on 2 ranks",
      "start pactrain's state afresh", "skip load_state_dict"]),
    ("install: dense= on an FSDP2 model", "ValueError", ["dense= / dense_below= is for DDP", "not yet under FSDP2"]),
    ("load: signum saved on 2 ranks, resumed on 1", "ValueError",
     ["saved at world size 2, this run has 1", "signum cannot move its state", "resume on 2 ranks",
      "start signum's state afresh"]),
]


def _check_words(message: str, words: list[str]) -> None:
    for word in words:
        assert word in message, f"{word!r} not in: {message}"


@pytest.mark.parametrize("label, call, expected, words", LOCAL, ids=[row[0] for row in LOCAL])
def test_library_input(label, call, expected, words):
    if expected == "ok":
        call()
    elif expected == "warns":
        with pytest.warns(UserWarning) as caught:
            call()
        _check_words(" | ".join(str(w.message) for w in caught), words)
    else:
        with pytest.raises(expected) as err:
            call()
        _check_words(str(err.value), words)


def _exit_status(argv: list[str], capsys) -> tuple[int, str]:
    """The command's exit status and what it printed on stderr (argparse and ``gcomp simulate`` end with
    ``SystemExit``; a message given to it is what Python prints, with status 1)."""
    try:
        code = cli(argv)
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    return (1, err + code) if isinstance(code, str) else (code, err)


def _a_file(tmp) -> str:
    (tmp / "file").write_text("a file, not a folder")
    return str(tmp / "file")


def _nothing_made(tmp) -> None:
    assert {p.name for p in tmp.iterdir()} <= {"file", "results.json"}  # no output folder: nothing was started


@pytest.mark.parametrize("label, argv, words", CLI, ids=[row[0] for row in CLI])
def test_command_line_input(label, argv, words, tmp_path, capsys):
    if "/proc/x" in argv and not os.path.isdir("/proc"):
        pytest.skip("needs a /proc where nothing may be created")
    argv = [a.replace("{file}", _a_file(tmp_path)) for a in argv]
    if argv[0] in ("bench", "simulate") and "--out" not in argv:
        argv += ["--out", str(tmp_path / "out")]
    argv += ["--bandwidth", "none"] if argv[0] == "bench" else []
    argv += ["--results", _results_file(tmp_path, "{}")] if argv[0] == "simulate" else []
    code, err = _exit_status(argv, capsys)
    assert code == 2, err
    _check_words(err, words)
    assert "Traceback" not in err
    _nothing_made(tmp_path)


@pytest.mark.parametrize("label, out, words", SIMULATE_OUT, ids=[row[0] for row in SIMULATE_OUT])
def test_simulate_output_folder(label, out, words, tmp_path, capsys):
    if out.startswith("/proc") and not os.path.isdir("/proc"):
        pytest.skip("needs a /proc where nothing may be created")
    results = _results_file(tmp_path, "not json: the folder is checked first")
    code, err = _exit_status(["simulate", "--results", results, "--out", out.replace("{file}", _a_file(tmp_path))],
                             capsys)
    assert code == 1 and err.startswith("gcomp simulate: "), err
    _check_words(err, words)
    _nothing_made(tmp_path)


@pytest.mark.parametrize("label, content, words", SIMULATE, ids=[row[0] for row in SIMULATE])
def test_simulate_input(label, content, words, tmp_path):
    with pytest.raises(SystemExit) as err:
        cli(["simulate", "--results", _results_file(tmp_path, content), "--out", str(tmp_path)])
    _check_words(str(err.value.code), words)


@pytest.mark.parametrize("label, expected, words", IN_A_RANK, ids=[row[0] for row in IN_A_RANK])
def test_install_and_load_input(label, expected, words):
    outcome, message = run_ranks_once("bad-input", 1, jobs.install_and_load_cases)[0][label]
    assert outcome == expected, (label, outcome, message)
    _check_words(message, words)


# a checkpoint part that does not fit the live model, refused at load_state_dict (label, words the ValueError must hold)
LOAD_CHECKS = [
    ("pactrain: a generator state of the wrong size", ["pactrain", "generator state for device 'cpu'", "100 bytes",
                                                       "5056"]),
    ("terngrad: a generator state that is not uint8", ["terngrad", "1-D torch.uint8", "torch.float32"]),
    ("dgc: a generator state of the wrong size", ["dgc", "generator state", "100 bytes", "5056"]),
    ("randomk: a generator state of the wrong size", ["randomk", "generator state", "100 bytes", "5056"]),
    ("powersgd: a generator state of the wrong size", ["powersgd", "generator state", "100 bytes", "5056"]),
    ("powersgd: a query of the wrong shape", ["'queries' of parameter '2.weight'", "(16, 2)", "(32, 1)"]),
    ("powersgd: an error of the wrong size", ["'errors' of parameter '2.weight'", "1000 entries", "1024"]),
    ("pactrain: a ternary residual of the wrong size", ["tracker entry", "parameters 4.bias, 4.weight", "'residual'",
                                                        "holds 7 entries", "its support keeps"]),
    ("pactrain: a ternary residual of the wrong dtype", ["'residual' must be a 1-D torch.float32", "torch.float64"]),
    ("pactrain: carried exponents of the wrong size", ["'exponents' holds 9 entries", "one per parameter",
                                                       "which has 6"]),
    # an older checkpoint records no names: the live layout checks the exponents when it takes them up
    ("pactrain: carried exponents of the wrong size, no names saved", ["'exponents' holds 9 entries", "which has 6",
                                                                       "the checkpoint is of another model"]),
    ("spardl: a union of two entries", ["spardl budget", "'union' must be one integer", "2 entries"]),
    ("layouts: not a list of layouts", ["'layouts'[0]", "'index'", "'names'"]),
    ("comm_hook: a state bound to another model", ["bound to another model", "One state serves one DDP model",
                                                   "model=ddp_model", "state.bind(ddp_model)"]),
]


@pytest.mark.parametrize("label, words", LOAD_CHECKS, ids=[row[0] for row in LOAD_CHECKS])
def test_a_part_that_does_not_fit_is_refused_at_load(label, words):
    outcome, message = run_ranks_once("load-checks", 1, load_check_jobs.load_cases)[0][label]
    assert outcome == "ValueError", (label, outcome, message)
    for word in words:
        assert word in message, f"{word!r} not in: {message}"


def test_every_load_check_runs():
    done = run_ranks_once("load-checks", 1, load_check_jobs.load_cases)[0]
    assert {label for label, _ in LOAD_CHECKS} == set(done)


def test_residuals_made_for_another_model_name_the_cause():
    """A state's pieces that do not fit the bucket they are taken up by (a checkpoint of another model loaded
    into a state that knows no model): the message says why and what to do."""
    state = BucketState(("residuals",), owner="ResidualMemory")
    state.load_state_dict({"residuals": {"bucket0.param0": torch.zeros(640)}})
    bucket = BucketInfo.from_layout(0, torch.float32, ["bucket0.param0"], [10])
    with pytest.raises(ValueError) as err:
        state.get(bucket, torch.zeros(10))
    for word in ("hold 640 elements", "holds 10", "made for another model", "One state serves one model"):
        assert word in str(err.value), str(err.value)


def test_the_table_is_complete():
    """The issue asks for at least 40 rows across create, install, prune, StructuredADMM, load_state_dict and
    the command line; every row above runs (a row missing from the rank job fails its own test)."""
    assert len(LOCAL) + len(CLI) + len(SIMULATE) + len(SIMULATE_OUT) + len(IN_A_RANK) >= 40
    assert set(label for label, *_ in IN_A_RANK) == set(run_ranks_once("bad-input", 1,
                                                                          jobs.install_and_load_cases)[0])
