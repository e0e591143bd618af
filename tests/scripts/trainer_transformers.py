"""A Hugging Face Transformers Trainer job on CPU, 2 processes under torchrun: a tiny BERT built from
a BertConfig (nothing downloaded), fine-tuned for a few steps on fixed random token ids and labels.

Trainer's `ddp_backend` takes a fixed list (nccl, gloo, mpi, xccl, hccl, cncl, mccl: its argparse
choices), and on CPU (`use_cpu=True`) Accelerate refuses any backend but gloo/mpi. What works is
the process group initialised first and `ddp_backend` left unset: Trainer's Accelerate state then
finds the group initialised and keeps it, and wraps the model in DDP over it. Nothing of
reduction_server is imported: torch's `torch.backends` entry point registers the backend.

Each rank writes its final parameters, the backend its process group has, what Trainer made of
it, and the labels it saw, to OUT/rank<r>.json.

argv: mode, OUT. mode: "gloo" (`ddp_backend="gloo"`, Trainer's own way: the reference); any other
backend name (e.g. "reduction_server"): the recipe, init_process_group(name) first;
"ddp_backend:<name>": Trainer's documented way, `TrainingArguments(ddp_backend=<name>, use_cpu=True)`,
refused on CPU by Accelerate (the error is then written instead of parameters) unless Accelerate is
patched (docs/frameworks.md); beside it, what HfArgumentParser says to `--ddp_backend <name>`.
"""

import contextlib
import io
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from rank_end import end_rank
from torch.utils.data import Dataset
from transformers import BertConfig, BertForSequenceClassification, HfArgumentParser, Trainer, TrainingArguments

SAMPLES, BATCH, SEQ, VOCAB = 32, 4, 8, 64  # 2 ranks x 4 per batch: 4 steps per epoch


class Tokens(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)
        self.labels = torch.randint(0, 2, (SAMPLES,), generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": self.labels[i]}


def arguments(out: Path, **extra) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(out / "trainer"),
        use_cpu=True,
        per_device_train_batch_size=BATCH,
        num_train_epochs=2,
        learning_rate=1e-3,
        seed=1234,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        **extra,
    )


def parsed(out: Path, name: str):
    """`--ddp_backend <name>` through HfArgumentParser, as a script's command line: None if taken,
    else argparse's error."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
                ["--output_dir", str(out / "trainer"), "--use_cpu", "--ddp_backend", name]
            )
        return None
    except SystemExit:
        return stderr.getvalue().strip().splitlines()[-1]


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    extra = {}
    if mode == "gloo":
        args = arguments(out, ddp_backend="gloo")
    elif mode.startswith("ddp_backend:"):  # Trainer's documented way
        name = mode.split(":", 1)[1]
        extra["parser"] = parsed(out, name)
        try:
            args = arguments(out, ddp_backend=name)
            args.device  # noqa: B018 - the distributed state (and Accelerate's check) is made on first use
        except Exception as exc:  # refused on CPU: reported, the test checks what is said
            rank = int(os.environ["RANK"])
            (out / f"rank{rank}.json").write_text(
                json.dumps({"rank": rank, **extra, "error": f"{type(exc).__name__}: {exc}"})
            )
            return
    else:
        dist.init_process_group(mode)  # first; ddp_backend stays unset
        args = arguments(out)
    torch.manual_seed(1234)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=SEQ,
        num_labels=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = BertForSequenceClassification(config)
    seen = []

    class Seen(Trainer):  # the labels each rank trained on: the ranks' data differ
        def compute_loss(self, model, inputs, *rest, **kwargs):
            seen.extend(inputs["labels"].tolist())
            return super().compute_loss(model, inputs, *rest, **kwargs)

    trainer = Seen(model=model, args=args, train_dataset=Tokens())
    result = trainer.train()
    rank = dist.get_rank()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "world": dist.get_world_size(),
                "backend": dist.get_backend(),
                "trainer": {
                    "parallel_mode": str(args.parallel_mode),
                    "world_size": args.world_size,
                    "wrapped": type(trainer.model_wrapped).__name__,
                },
                "steps": result.global_step,
                "seen": seen,
                "params": params.tolist(),
                **extra,
            }
        )
    )
    end_rank(dist.get_backend())


if __name__ == "__main__":
    main()
