"""The draft head's training options (`TrainConfig`) and the names a run's output directory holds.

A run has three rooms: data.py (prompts, the model's continuations and features, other runs' data),
training.py (the head's losses and the resumable training loop) and evaluation.py (accuracy on held-out
replies and MT-Bench, the loss summary); train.py runs them in order (`run_training`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .corpus import CORPUS_VERSIONS

DATA = "data.pt"
PARTIAL = "data.partial.pt"  # the batches generated so far, while collecting
# The options that shape the data (the rest only shape training, and may change on a resume).
DATA_FIELDS = ("tokens", "prompts", "first_prompt", "seed", "device", "max_new_tokens", "generate_batch", "sampled_share", "generate_dtype",
               "corpus", "source", "max_len", "fuse")
GENERATE_DTYPES = ("float32", "bfloat16", "float16")
SOURCES = ("templates", "sharegpt", "sharegpt-replies")
TEACHER = "teacher"  # the teacher-forced shards' directory under the output (source sharegpt)
# path_top_k: any value trains the same on the model's own continuations, all that heads before it saw.
# What data (and heads) made before an option existed were made with (cosine used no schedule option).
DATA_BEFORE = {"generate_dtype": "float32", "corpus": 1, "source": "templates", "max_len": 1024, "path_top_k": 4,
               "schedule": "cosine", "warmup_steps": 240, "decay_share": 0.2, "fuse": False, "first_prompt": 0,
               "with_data": ""}
MANIFEST = "manifest.json"
REPORTED_DEPTH = 3  # draft depths the manifest's held-out accuracy covers


def made_with(config: dict, keys=DATA_FIELDS) -> dict:
    """The options of saved data (or a manifest's config), an option added since read as DATA_BEFORE says."""
    return {k: config.get(k, DATA_BEFORE.get(k)) for k in keys}


@dataclass(frozen=True)
class TrainConfig:
    tokens: int = 400_000  # generated tokens (continuations) to train on
    prompts: int = 4800  # prompts drawn; generation stops at `tokens`, so a larger target only goes further
    # where the drawn prompts start in ShareGPT's shuffled first turns (source sharegpt-replies): a second run
    # from the first's first_prompt + prompts draws prompts the first did not (train on both with --with-data)
    first_prompt: int = 0
    steps: int = 4800
    seed: int = 0
    device: str = "cpu"
    max_new_tokens: int = 128  # per continuation
    generate_batch: int = 32  # prompts per batched generate (similar lengths together)
    sampled_share: float = 0.5  # share of batches sampled (drafter/generate.py: Sampling) rather than greedy
    # The copy of the model that generates the data: bfloat16 generates about twice as fast on a CPU with
    # AVX512-BF16 (drafter notes section 14). Training, its readout and the held-out replies stay float32.
    generate_dtype: str = "float32"
    corpus: int = CORPUS_VERSIONS[-1]  # version of the offline prompt corpus (drafter/corpus.py)
    # templates: the model's continuations of the offline corpus's prompts; sharegpt: real conversations,
    # teacher-forced (drafter/chat.py, drafter/teacher.py; `make chat-data` installs them); sharegpt-replies:
    # the model's own continuations of ShareGPT's first user turns (held-out conversations left out)
    source: str = "templates"
    max_len: int = 1024  # tokens per teacher-forced conversation (source sharegpt)
    # GRIFFIN's loss mask: a row is not trained where a token on its path is outside the model's top
    # path_top_k (teacher-forced text only: the model's own continuations are its own path); 0: off
    path_top_k: int = 4
    batch: int = 4  # windows per step
    window: int = 144  # rows per window: a whole reply of max_new_tokens and the prompt rows before it
    prompt_rows: int = 16  # prompt rows a window starts with, as context for the reply's first drafts
    lr: float = 1.5e-3  # peak learning rate
    # drafter/schedule.py: wsd (warm-up, held, decay over the last decay_share of steps: a run extended with a
    # larger --steps resumes from its last checkpoint before the decay) or cosine (the shipped head's)
    schedule: str = "wsd"
    warmup_steps: int = 240  # wsd's warm-up (cosine warms up over steps // 20)
    decay_share: float = 0.2
    draft_vocab_size: int = 8192
    intermediate_size: int = 768
    noise: float = 0.05  # uniform input-feature noise, relative to each row's RMS
    depth: int = 2  # passes of the head on its own predictions per window (training-time test)
    depth_decay: float = 0.8  # weight of pass e's loss: depth_decay ** e
    ce_weight: float = 1.0  # weight of the cross-entropy against the model's readout, beside the feature loss
    heldout_every: int = 25  # every n-th generated sequence is held out of training and measures it
    checkpoint_every: int = 50
    # EAGLE-3's feature fusion: the hidden states that cross the wire (after the head layers, after the cloud
    # layers) added to the head's depth-1 input; the session hands them to the head at run time
    fuse: bool = False
    # other finished runs' data trained on beside this run's (comma-separated output directories of runs of the
    # same model, fuse alike): a larger data set grown run by run (first_prompt) or tiers mixed
    with_data: str = ""

    def __post_init__(self):
        if self.generate_dtype not in GENERATE_DTYPES:
            raise ValueError(f"generate_dtype must be one of {', '.join(GENERATE_DTYPES)}, not {self.generate_dtype!r}.")
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {', '.join(SOURCES)}, not {self.source!r}.")
        if self.first_prompt and self.source != "sharegpt-replies":
            raise ValueError("first_prompt applies to source sharegpt-replies only.")
        if self.corpus not in CORPUS_VERSIONS:
            raise ValueError(f"corpus must be one of {', '.join(map(str, CORPUS_VERSIONS))}, not {self.corpus!r}.")
