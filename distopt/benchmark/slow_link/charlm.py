"""The real task's model: a small character-level transformer language model.

A GPT-shaped model on :mod:`.text`'s bytes: token and learned position embeddings,
pre-norm ``nn.TransformerEncoder`` layers under a causal mask, a final norm and a
linear head over the 128-byte alphabet; no dropout, so every step is deterministic.
The defaults (d_model 128, 4 layers, 4 heads, context 64; 0.83 M parameters, 3.2 MiB
of float32 gradients) keep a step at about 90 ms on one core for a batch of 16
windows, so that at 200 Mbit/s sending the gradients (about 0.14 s) costs more than
computing them: the regime where compression and local steps matter.
"""
from __future__ import annotations

from torch import Tensor, nn

from .text import VOCAB

__all__ = ["CharTransformer", "char_loss"]


class CharTransformer(nn.Module):
    """Next-byte prediction over :data:`~.text.VOCAB` symbols.

    Args:
        d_model: width.
        layers: transformer layers.
        heads: attention heads.
        context: the longest input, in tokens.
        vocab: alphabet size.
    """

    def __init__(self, d_model: int = 128, layers: int = 4, heads: int = 4, context: int = 64,
                 vocab: int = VOCAB) -> None:
        super().__init__()
        self.context = context
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(context, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``(batch, length, vocab)`` for tokens ``x`` ``(batch, length)``, ``length <= context``."""
        length = x.shape[1]
        h = self.tokens(x) + self.positions.weight[:length]
        h = self.blocks(h, mask=self.mask[:length, :length], is_causal=True)
        return self.head(self.norm(h))


def char_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy in nats per byte of ``logits`` ``(batch, length, vocab)`` against ``targets``."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
