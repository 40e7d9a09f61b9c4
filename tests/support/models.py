"""Small deterministic models that exercise what sharding must get right.

Sizes are odd on purpose, so that flat buffers need padding and shards split parameters.
Weights come from the default RNG: seed it and build a model once, then deep-copy it for the
reference and for each rank (see ``tests/support/ranks.py`` on why ranks must not seed themselves).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

__all__ = [
    "GPT",
    "Block",
    "Branch",
    "Branchy",
    "WithBatchNorm",
    "ComplexLayer",
    "WithComplex",
    "LoRALinear",
    "FrozenPart",
    "make_batch",
    "tiny_gpt2_config",
    "tiny_llama_config",
]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused qkv projection."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not divisible by heads {heads}")
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:  # x: (B, T, C)
        q, k, v = rearrange(self.qkv(x), "b t (qkv h d) -> qkv b h t d", qkv=3, h=self.heads)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(rearrange(y, "b h t d -> b t (h d)"))


class Block(nn.Module):
    """Pre-norm transformer block: the natural unit to wrap."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: Tensor) -> Tensor:  # x: (B, T, C)
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A tiny GPT-2. With ``tied=True`` the output head shares the token embedding's weight.

    ``forward(idx)`` returns logits ``(B, T, vocab)``; ``forward(idx, targets)`` returns the mean
    cross-entropy loss, a scalar.
    """

    def __init__(
        self,
        vocab: int = 67,
        width: int = 36,
        heads: int = 3,
        depth: int = 3,
        context: int = 16,
        tied: bool = False,
    ) -> None:
        super().__init__()
        self.context = context
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> Tensor:  # idx: (B, T) int64
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(rearrange(logits, "b t v -> (b t) v"), targets.flatten())


class Branch(nn.Module):
    """A residual MLP layer, its own class so that a policy can wrap it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:  # x: (B, C)
        return x + torch.tanh(self.linear(self.norm(x)))


class Branchy(nn.Module):
    """Control flow that sharding must survive.

    1. ``branch`` runs only when the input sums to more than zero, so with different inputs,
       ranks run different modules in the same step (a rank may skip it, or all may).
    2. ``shared_block`` runs twice in every forward.

    Both are ``Branch``, so ``auto_wrap=Branch`` makes each a unit. The condition is evaluated
    per call, so a single-process reference must run the model once per rank's input.

    ``forward(x)`` maps ``(B, width)`` floats to ``(B,)``.
    """

    def __init__(self, width: int = 11) -> None:
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.shared_block = Branch(width)
        self.branch = Branch(width)
        self.head = nn.Linear(width, 1)

    def forward(self, x: Tensor) -> Tensor:  # x: (B, C)
        h = self.shared_block(self.stem(x))
        if x.sum() > 0:
            h = self.branch(h)
        return self.head(self.shared_block(h)).squeeze(-1)


class WithBatchNorm(nn.Module):
    """An MLP with BatchNorm1d, which carries buffers (running statistics, batch count).

    In training mode the batch statistics are those of the local batch, as with DDP without
    SyncBatchNorm, so a reference must run each rank's batch separately.

    ``forward(x)`` maps ``(B, width)`` floats to ``(B, classes)`` logits.
    """

    def __init__(self, width: int = 13, hidden: int = 22, classes: int = 5) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(width, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Linear(hidden, classes),
        )

    def forward(self, x: Tensor) -> Tensor:  # x: (B, C)
        return self.net(x)


class ComplexLayer(nn.Module):
    """A complex weight (a spectral filter's, say) between real activations: ``(B, 8)`` in and
    out, in the input's dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.w = nn.Parameter(0.3 * torch.randn(8, 8, dtype=torch.complex64))

    def forward(self, x: Tensor) -> Tensor:
        z = torch.tanh(self.lin(x)).to(torch.complex64) @ self.w
        return (z.real + z.imag).to(x.dtype)


class WithComplex(nn.Module):
    """Two ``ComplexLayer``s, a real head and a complex scalar gain: wrapped with the layers as
    units, the root unit's only complex parameter is one element, so one rank's piece of it is
    empty. ``forward(x)`` maps ``(B, 8)`` to ``(B, 3)``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(ComplexLayer(), ComplexLayer())
        self.gain = nn.Parameter(torch.ones((), dtype=torch.complex64))
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.layers(x)) * self.gain.abs()


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update: one module, both kinds of
    parameter (``base.*`` frozen, ``lora_a`` and ``lora_b`` trainable)."""

    def __init__(self, width: int, rank: int = 3) -> None:
        super().__init__()
        self.base = nn.Linear(width, width)
        self.base.requires_grad_(False)
        # Unlike LoRA's zero init of B, both factors start non-zero so that both get gradients.
        self.lora_a = nn.Parameter(torch.randn(rank, width) / width**0.5)
        self.lora_b = nn.Parameter(torch.randn(width, rank) / rank**0.5)

    def forward(self, x: Tensor) -> Tensor:  # x: (..., C)
        return self.base(x) + x @ self.lora_a.T @ self.lora_b.T


class FrozenPart(nn.Module):
    """A frozen embedding backbone, a LoRA-adapted layer and a trainable head.

    ``forward(idx)`` returns logits ``(B, T, vocab)``; ``forward(idx, targets)`` returns the mean
    cross-entropy loss, as ``GPT`` does.
    """

    def __init__(self, vocab: int = 29, width: int = 14, rank: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.embed.requires_grad_(False)
        self.adapter = LoRALinear(width, rank)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> Tensor:  # idx: (B, T) int64
        logits = self.head(self.norm(torch.relu(self.adapter(self.embed(idx)))))
        if targets is None:
            return logits
        return F.cross_entropy(rearrange(logits, "b t v -> (b t) v"), targets.flatten())


def make_batch(seed: int, batch: int, context: int = 16, vocab: int = 67) -> tuple[Tensor, Tensor]:
    """Random token sequences and their next tokens, from a private generator.

    Returns:
        ``(idx, targets)``, both ``(batch, context)`` int64; ``targets`` is ``idx`` shifted left
        by one position.
    """
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(vocab, (batch, context + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


# Hugging Face transformers: tiny configurations, random weights, nothing downloaded -------

HF_VOCAB = 97


def tiny_gpt2_config(**overrides: Any) -> Any:
    """GPT-2 (head tied to the embedding), 2 layers of width 36, no dropout; ``overrides``
    replace or add config fields."""
    import transformers

    fields = dict(
        vocab_size=HF_VOCAB,
        n_positions=32,
        n_embd=36,
        n_layer=2,
        n_head=3,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2Config(**{**fields, **overrides})


# A decoder of grouped-query attention (3 heads, 1 key-value head), 2 layers of width 36.
_TINY_DECODER = dict(
    vocab_size=HF_VOCAB,
    hidden_size=36,
    intermediate_size=52,
    num_hidden_layers=2,
    num_attention_heads=3,
    num_key_value_heads=1,
    max_position_embeddings=32,
)


def tiny_llama_config() -> Any:
    """Llama with grouped-query attention (3 heads, 1 key-value head), 2 layers of width 36."""
    import transformers

    return transformers.LlamaConfig(**_TINY_DECODER)


def tiny_clip_config() -> Any:
    """CLIP: a text and a vision tower of 2 layers of width 16 (images 8 x 8, patches of 4),
    projected to 8; its ``logit_scale`` is a 0-d parameter."""
    import transformers

    tower = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2}
    return transformers.CLIPConfig(
        text_config={
            **tower,
            "vocab_size": HF_VOCAB,
            "num_attention_heads": 2,
            "max_position_embeddings": 16,
            "bos_token_id": 0,
            "eos_token_id": 1,
        },
        vision_config={**tower, "num_attention_heads": 2, "image_size": 8, "patch_size": 4},
        projection_dim=8,
    )


def tiny_t5_config() -> Any:
    """T5 encoder-decoder, 2 + 2 layers of width 32, no dropout; the encoder, the decoder and the
    head share one embedding (``tie_word_embeddings``, T5's default)."""
    import transformers

    return transformers.T5Config(
        vocab_size=HF_VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=48,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )


def tiny_bert_config() -> Any:
    """BERT (masked-LM head tied to the word embedding), 2 layers of width 32, no dropout."""
    import transformers

    return transformers.BertConfig(
        vocab_size=HF_VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )


def tiny_qwen2_config() -> Any:
    """Qwen2 (grouped-query attention with biases, head tied to the embedding), 2 layers."""
    import transformers

    return transformers.Qwen2Config(**_TINY_DECODER, tie_word_embeddings=True)


def hf_gpt2_lm() -> tuple[nn.Module, type]:
    """A seeded tiny ``GPT2LMHeadModel`` and its layer class (what ``auto_wrap`` takes)."""
    import transformers

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(tiny_gpt2_config())
    return model, transformers.models.gpt2.modeling_gpt2.GPT2Block


def hf_bert_mlm() -> tuple[nn.Module, type]:
    """A seeded tiny ``BertForMaskedLM`` and its layer class."""
    import transformers

    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(tiny_bert_config())
    return model, transformers.models.bert.modeling_bert.BertLayer


def hf_ids(step: int, batch: int, length: int) -> Tensor:
    """Token ids for step ``step``, the same on every rank (each takes its slice)."""
    g = torch.Generator().manual_seed(step)
    return torch.randint(2, HF_VOCAB, (batch, length), generator=g)
