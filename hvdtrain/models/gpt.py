"""A decoder-only transformer language model in nanoGPT's shape (Karpathy's model.py): token and
position embeddings, pre-norm blocks of causal self-attention and a GELU MLP, a final LayerNorm and
a head tied to the token embedding. Attention is torch's scaled_dot_product_attention (flash or
memory-efficient kernels where the device has them)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)
        self.heads, self.dropout = heads, dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, positions, width = x.shape
        q, k, v = self.c_attn(x).split(width, dim=2)
        q, k, v = (
            t.view(batch, positions, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v)
        )
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(batch, positions, width)))


class MLP(nn.Module):
    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.c_fc = nn.Linear(width, 4 * width)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * width, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, dropout)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = MLP(width, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(
        self, vocab: int, block_size: int, layers: int, heads: int, width: int, dropout: float = 0.0
    ) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        self.block_size = block_size
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(vocab, width),
                "wpe": nn.Embedding(block_size, width),
                "drop": nn.Dropout(dropout),
                "h": nn.ModuleList(Block(width, heads, dropout) for _ in range(layers)),
                "ln_f": nn.LayerNorm(width),
            }
        )
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying (Press and Wolf, 2017)
        self.apply(self._init)
        for name, parameter in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith("c_proj.weight"):
                nn.init.normal_(parameter, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """(batch, positions) token ids -> (batch, positions, vocab) logits of the next token."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.transformer.drop(self.transformer.wte(tokens) + self.transformer.wpe(positions))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def decayed_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """nanoGPT's AdamW groups: weight decay on the matrices (linear and embedding weights), none on
    biases and LayerNorm gains. A tied weight is one parameter, in one group."""
    parameters = {id(p): p for p in model.parameters() if p.requires_grad}
    decay = [p for p in parameters.values() if p.dim() >= 2]
    no_decay = [p for p in parameters.values() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def sequence_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of every position's next-token prediction."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
