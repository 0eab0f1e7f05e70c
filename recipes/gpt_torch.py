"""A small decoder-only transformer language model (nanoGPT's shape, hvdtrain.models.gpt) on the
English documentation every Python ships: the standard library's `pydoc_data.topics` (79 topics,
466 KB), byte-level, the last tenth of the text held out for validation.

AdamW with weight decay on matrices only, a cosine learning rate after a warmup, gradients clipped to
norm 1; reports test_loss (nats per byte) and test_perplexity. `unigram_loss` is the baseline a
model that ignores context reaches; the debug variant gets at least 20 % below it in seconds. The
gpt2-small variant has GPT-2 small's shape and compute (12 layers, 12 heads, 768 wide, 1024 bytes of
context, the vocabulary padded to 50,304 as nanoGPT pads GPT-2's: 124M parameters).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Literal

import numpy as np

from hvdtrain import data
from hvdtrain.config import TrainConfig, bounded
from hvdtrain.registry import Recipe, debug_variant

VOCAB = 256
"""Bytes."""


@dataclass(kw_only=True)
class Config(TrainConfig):
    epochs: int = 10
    batch_size: int = 32
    lr: float = 1e-3
    scale_lr: bool = False
    warmup_epochs: float = 0.5
    lr_schedule: Literal["constant", "step", "cosine", "linear"] = "cosine"
    min_lr: float = 1e-4
    clip_grad_norm: float | None = 1.0
    block_size: int = bounded(128, minimum=2)
    """Bytes of context; each sample is that many bytes and the ones that follow them."""
    layers: int = bounded(4, minimum=1)
    heads: int = bounded(4, minimum=1)
    width: int = bounded(128, minimum=1)
    """The embedding width, a multiple of heads."""
    vocab: int = bounded(VOCAB, minimum=VOCAB)
    """Rows of the embedding and the output layer: the 256 bytes, or more, padded (rows no byte uses,
    whose logits training pushes down), to give a model a tokenizer's vocabulary size and cost."""
    dropout: float = bounded(0.0, minimum=0, maximum=1)
    weight_decay: float = bounded(0.1, minimum=0)
    """AdamW's decoupled weight decay, on the matrices only."""
    beta2: float = bounded(0.99, above=0, maximum=1)
    """AdamW's second-moment decay (nanoGPT's for small data)."""
    validation_fraction: float = bounded(0.1, above=0, maximum=0.5)

    def __post_init__(self) -> None:
        if self.width % self.heads:
            raise ValueError(f"width ({self.width}) must be a multiple of heads ({self.heads})")


def corpus() -> bytes:
    """The topics in name order, as UTF-8, blank-line separated: the same bytes on every rank."""
    from pydoc_data.topics import topics

    return b"\n\n".join(topics[name].encode() for name in sorted(topics))


def windows(text: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Consecutive samples of `block` bytes, each with the `block` bytes one position later."""
    count = (len(text) - 1) // block
    x = text[: count * block].reshape(count, block)
    y = text[1 : count * block + 1].reshape(count, block)
    return x.astype(np.int64), y.astype(np.int64)


def split(config: Config) -> data.Split:
    text = np.frombuffer(corpus(), dtype=np.uint8)
    cut = int(len(text) * (1 - config.validation_fraction))
    train, validation = windows(text[:cut], config.block_size), windows(text[cut:], config.block_size)
    return data.Split(*train, *validation)


def unigram_loss(config: Config) -> float:
    """Cross-entropy (nats per byte) of the validation bytes under the training bytes' frequencies
    (add-one smoothed): what predicting each byte without context reaches."""
    text = np.frombuffer(corpus(), dtype=np.uint8)
    cut = int(len(text) * (1 - config.validation_fraction))
    counts = np.bincount(text[:cut], minlength=VOCAB) + 1.0
    probabilities = counts / counts.sum()
    held_out = windows(text[cut:], config.block_size)[1].reshape(-1)
    return float(-np.log(probabilities[held_out]).mean())


def build(config: Config):
    import torch

    from hvdtrain.models.gpt import GPT, decayed_groups, sequence_loss
    from hvdtrain.runtime.torch import TorchTask, named

    model = GPT(config.vocab, config.block_size, config.layers, config.heads, config.width, config.dropout)
    return TorchTask(
        model=model,
        data=split(config),
        optimizer=partial(torch.optim.AdamW, betas=(0.9, config.beta2)),
        param_groups=partial(decayed_groups, weight_decay=config.weight_decay),
        loss_fn=sequence_loss,
        metrics=named("loss", "perplexity"),
        blocks=lambda gpt: list(gpt.transformer.h),  # fsdp: the tied embedding stays in the root's group
        tokens_per_sample=config.block_size,
        flops_per_sample=training_flops(model, config),
    )


def training_flops(model, config: Config) -> float:
    """FLOPs of one sample's forward and backward as nanoGPT and the PaLM paper count them: 6 per
    parameter (the position embedding aside, a lookup) per token, plus attention's 12 x layers x
    width x context per token, over the sample's tokens."""
    parameters = sum(p.numel() for p in model.parameters()) - model.transformer.wpe.weight.numel()
    per_token = 6 * parameters + 12 * config.layers * config.width * config.block_size
    return float(per_token * config.block_size)


RECIPE = Recipe(
    name="gpt-torch",
    framework="torch",
    dataset="pydoc_data.topics, the English documentation every Python ships (466 KB, bytes)",
    description="nanoGPT-shaped transformer LM; AdamW, cosine lr, clipping; test_loss and test_perplexity",
    config=Config,
    build=build,
    variants={
        "debug": debug_variant(
            epochs=2, steps_per_epoch=50, block_size=64, layers=2, heads=2, width=64, lr=3e-3, min_lr=3e-4
        ),
        "gpt2-small": debug_variant(
            block_size=1024, layers=12, heads=12, width=768, vocab=50304, batch_size=16, lr=6e-4, min_lr=6e-5
        ),
    },
    metrics=("loss", "perplexity"),
)
