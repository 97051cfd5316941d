"""The Hugging Face Trainer with gcomp: a tiny GPT-2 built from a config (no download), random token data.

    torchrun --nproc_per_node 2 examples/hf_trainer.py --dir /tmp/hf
    torchrun --nproc_per_node 2 examples/hf_trainer.py --dir /tmp/hf --resume /tmp/hf/checkpoint-4

The gcomp line is the callback: ``Trainer(..., callbacks=[GcompCallback("topk", ratio=0.05)])`` installs the
method on the DDP model the Trainer builds, adds ``gcomp_ratio`` to its logs, and keeps every rank's state in
its checkpoints (``checkpoint-N/gcomp-rank{R}.pt``), which ``train(resume_from_checkpoint=...)`` loads. Rank 0
prints ``GCOMP sent=S dense=D steps=N iteration=I`` and ``LOGGED ratio=...`` (the last logged ``gcomp_ratio``).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import gcomp
from gcomp.integrations.transformers import GcompCallback


class RandomTokens(torch.utils.data.Dataset):
    """Sequences of random tokens, the same on every rank (the Trainer's sampler splits them)."""

    def __init__(self, count: int, length: int, vocab: int):
        self.ids = torch.randint(0, vocab, (count, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2() -> GPT2LMHeadModel:
    """A one-layer GPT-2 of 32 dimensions over 64 tokens, from a config: nothing downloaded."""
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                      bos_token_id=0, eos_token_id=0))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="the Trainer's output_dir")
    p.add_argument("--method", default="topk:ratio=0.05", type=gcomp.registry.spec_argument)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--save-steps", type=int, default=4, dest="save_steps")
    p.add_argument("--resume", default=None, help="a checkpoint folder this script saved")
    args = p.parse_args(argv)

    model = tiny_gpt2()
    training = TrainingArguments(output_dir=args.dir, max_steps=args.steps, save_steps=args.save_steps,
                                 logging_steps=2, per_device_train_batch_size=4, learning_rate=1e-3,
                                 use_cpu=True, ddp_backend="gloo", ddp_find_unused_parameters=False, report_to=[],
                                 disable_tqdm=True, seed=0)
    name, params = args.method
    callback = GcompCallback(name, **params)
    trainer = Trainer(model=model, args=training, train_dataset=RandomTokens(64, 16, model.config.vocab_size),
                      callbacks=[callback])
    trainer.train(resume_from_checkpoint=args.resume)

    if trainer.is_world_process_zero():
        stats = callback.state.stats
        print(f"GCOMP sent={stats['bytes_sent']} dense={stats['bytes_dense']} steps={stats['steps']} "
              f"iteration={getattr(callback.state, 'iteration', 0)}", flush=True)
        logged = [row["gcomp_ratio"] for row in trainer.state.log_history if "gcomp_ratio" in row]
        print(f"LOGGED ratio={logged[-1] if logged else None}", flush=True)


if __name__ == "__main__":
    main()
    # Leave without the interpreter's shutdown: a gloo worker thread that still drops a finished collective's
    # tensors then needs the GIL and can abort the process (a hazard of gloo at exit, with or without gcomp).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
