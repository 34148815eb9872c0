"""Small models shared by the demo and the tests (plain PyTorch code, nothing
dtshard-specific: the same code runs on plain tensors, on dtshard's DTensors and on PyTorch's).

``unet``: a UNet-like CNN written functionally over a parameter dict, so the same function runs on
plain tensors and on DTensors: two down levels (conv3x3 + batch_norm + relu, max_pool 2), a
bottleneck, two up levels (nearest upsampling to the skip's size, concat of the skip over
channels, conv3x3 + batch_norm + relu), a 1x1 head.  ``python -m dtshard.demo --model cnn`` trains
it with the images sharded on H.

``Transformer``: a tiny Llama 2/3-style decoder as ``torch.nn`` modules (``LlamaConfig``): token
embedding, ``n_layers`` blocks of ``x + attention(attention_norm(x))`` and
``h + feed_forward(ffn_norm(h))`` with RMSNorm (``nn.RMSNorm``), rotary position embeddings,
grouped-query attention (``n_kv_heads`` < ``n_heads``: k/v heads repeated to the query heads, then
``F.scaled_dot_product_attention`` causal), a SwiGLU MLP, a final norm and an LM head, untied from
the embedding or tied to it.  Head counts are taken from the tensors (``view(..., -1, head_dim)``),
as torchtitan does, so the same code runs on full tensors, on local shards and on DTensors.
``tp_plan(tp, ...)`` builds torchtitan's tensor + sequence parallel plan with the styles of a given
module ``tp`` (``torch.distributed.tensor.parallel`` or ``dtshard.parallel``: the same code for
both) and ``parallelize(model, mesh, tp)`` applies it.  ``python -m dtshard.demo --model llama``
trains it with AdamW.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "ResidualMLP",
    "unet", "unet_params", "unet_stats", "train_unet",
    "UNet3d", "ResNet18", "BasicBlock", "MonaiUNet3d", "ResidualUnit3d",
    "LlamaConfig", "Transformer", "tp_plan", "parallelize",
]


# ---------------------------------------------------------------------------------------------
# UNet
# ---------------------------------------------------------------------------------------------


class ResidualMLP(torch.nn.Module):
    """``x + b(relu(a(x)))``: the residual MLP block the FSDP tests and benchmarks stack."""

    def __init__(self, d: int, h: int):
        super().__init__()
        self.a = torch.nn.Linear(d, h)
        self.b = torch.nn.Linear(h, d)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))


def unet_params(c_in: int = 3, c_out: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def conv(o, i, k):
        return (torch.randn(o, i, k, k, generator=g) * (2.0 / (i * k * k)) ** 0.5,
                torch.randn(o, generator=g) * 0.1)

    p = {}
    for name, (o, i, k) in {"enc1": (4, c_in, 3), "enc2": (8, 4, 3), "mid": (8, 8, 3), "dec2": (8, 16, 3),
                            "dec1": (4, 12, 3), "head": (c_out, 4, 1)}.items():
        p[f"{name}.w"], p[f"{name}.b"] = conv(o, i, k)
        if name != "head":
            p[f"{name}.gamma"] = 1 + 0.1 * torch.randn(o, generator=g)
            p[f"{name}.beta"] = 0.1 * torch.randn(o, generator=g)
    return p


def unet_stats() -> dict[str, torch.Tensor]:
    """Batch-norm running statistics (updated in place by training-mode batch_norm)."""
    out = {}
    for name, c in (("enc1", 4), ("enc2", 8), ("mid", 8), ("dec2", 8), ("dec1", 4)):
        out[f"{name}.mean"], out[f"{name}.var"] = torch.zeros(c), torch.ones(c)
    return out


def _block(x, p, s, name):
    x = F.conv2d(x, p[f"{name}.w"], p[f"{name}.b"], padding=1)
    x = F.batch_norm(x, s[f"{name}.mean"], s[f"{name}.var"], p[f"{name}.gamma"], p[f"{name}.beta"],
                     training=True, momentum=0.1, eps=1e-5)
    return F.relu(x)


def unet(x, p, s, up: str = "size"):
    """``up="x2"``: upsample by scale_factor 2 (sizes divisible by 4); ``"size"``: to the skip's size."""
    e1 = _block(x, p, s, "enc1")                    # H
    e2 = _block(F.max_pool2d(e1, 2), p, s, "enc2")  # H/2
    m = _block(F.max_pool2d(e2, 2), p, s, "mid")    # H/4
    if up == "x2":
        u2 = F.interpolate(m, scale_factor=2, mode="nearest")
    else:
        u2 = F.interpolate(m, size=tuple(e2.shape[-2:]), mode="nearest")
    d2 = _block(torch.cat([u2, e2], dim=1), p, s, "dec2")
    if up == "x2":
        u1 = F.interpolate(d2, scale_factor=2, mode="nearest")
    else:
        u1 = F.interpolate(d2, size=tuple(e1.shape[-2:]), mode="nearest")
    d1 = _block(torch.cat([u1, e1], dim=1), p, s, "dec1")
    return F.conv2d(d1, p["head.w"], p["head.b"])


def train_unet(x, y, p, s, up: str, steps: int, lr: float = 0.05, on_step=None) -> list[torch.Tensor]:
    """Plain SGD on the parameter dict; returns the detached loss of each step."""
    losses = []
    for step in range(steps):
        loss = F.mse_loss(unet(x, p, s, up), y)
        for t in p.values():
            t.grad = None
        loss.backward()
        with torch.no_grad():
            for t in p.values():
                t.sub_(lr * t.grad)
        losses.append(loss.detach())
        if on_step is not None:
            on_step(step)
    return losses


# ---------------------------------------------------------------------------------------------
# A small 3-D UNet (volumes: segmentation, cosmology, weather)
# ---------------------------------------------------------------------------------------------


class ConvBlock3d(nn.Module):
    """conv3d 3x3x3 -> GroupNorm -> SiLU, twice."""

    def __init__(self, c_in: int, c_out: int, groups: int = 2):
        super().__init__()
        self.conv1 = nn.Conv3d(c_in, c_out, 3, padding=1)
        self.norm1 = nn.GroupNorm(groups, c_out)
        self.conv2 = nn.Conv3d(c_out, c_out, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, c_out)

    def forward(self, x):
        x = F.silu(self.norm1(self.conv1(x)))
        return F.silu(self.norm2(self.conv2(x)))


class UNet3d(nn.Module):
    """A two-level 3-D UNet: encoder blocks, strided-conv downsampling, a bottleneck,
    transposed-conv (``up="tconv"``) or trilinear (``up="trilinear"``) upsampling, skip
    concatenation, a 1x1x1 head.  Volume sides divisible by 4.

    With the volume sharded on D and H (``Shard(2)``, ``Shard(3)``) and the parameters
    replicated, every op is spatially sharded: the convolutions exchange halos, GroupNorm
    reduces its statistics as Partial sums, and the weight gradients are Partial sums."""

    def __init__(self, c_in: int = 1, c_out: int = 2, width: int = 4, up: str = "tconv"):
        super().__init__()
        w = width
        self.up = up
        self.enc1 = ConvBlock3d(c_in, w)
        self.down1 = nn.Conv3d(w, w, 2, stride=2)
        self.enc2 = ConvBlock3d(w, 2 * w)
        self.down2 = nn.Conv3d(2 * w, 2 * w, 2, stride=2)
        self.mid = ConvBlock3d(2 * w, 2 * w)
        if up == "tconv":
            self.up2 = nn.ConvTranspose3d(2 * w, 2 * w, 2, stride=2)
            self.up1 = nn.ConvTranspose3d(2 * w, w, 2, stride=2)
        else:
            self.up2 = nn.Conv3d(2 * w, 2 * w, 1)
            self.up1 = nn.Conv3d(2 * w, w, 1)
        self.dec2 = ConvBlock3d(4 * w, 2 * w)
        self.dec1 = ConvBlock3d(2 * w, w)
        self.head = nn.Conv3d(w, c_out, 1)

    def _up(self, layer, x):
        if self.up == "tconv":
            return layer(x)
        return layer(F.interpolate(x, scale_factor=2, mode="trilinear", align_corners=False))

    def forward(self, x):
        e1 = self.enc1(x)                          # D
        e2 = self.enc2(self.down1(e1))             # D/2
        m = self.mid(self.down2(e2))               # D/4
        d2 = self.dec2(torch.cat([self._up(self.up2, m), e2], dim=1))
        d1 = self.dec1(torch.cat([self._up(self.up1, d2), e1], dim=1))
        return self.head(d1)


# ---------------------------------------------------------------------------------------------
# ResNet-18 (torchvision's layout) and a MONAI-style 3-D UNet: third-party architectures, our own
# definitions (no torchvision / MONAI dependency)
# ---------------------------------------------------------------------------------------------


class BasicBlock(nn.Module):
    """torchvision's ResNet ``BasicBlock``: conv3x3 (stride) -> BN -> ReLU -> conv3x3 -> BN, plus
    the identity or a 1x1 strided conv + BN, then ReLU."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet18(nn.Module):
    """torchvision's ``resnet18`` layout (same modules, names and shapes for ``width=64``): a 7x7
    stride-2 stem conv, BN, ReLU, 3x3 stride-2 max pool, four stages of two :class:`BasicBlock`
    (``width``, 2, 4, 8 times ``width`` channels, stride 2 from the second stage on), global average
    pooling and a linear head.  20 BatchNorm2d layers.  ``width`` shrinks it for tests."""

    def __init__(self, num_classes: int = 1000, width: int = 64, c_in: int = 3):
        super().__init__()
        w = width
        self.conv1 = nn.Conv2d(c_in, w, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(w)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = nn.Sequential(BasicBlock(w, w), BasicBlock(w, w))
        self.layer2 = nn.Sequential(BasicBlock(w, 2 * w, 2), BasicBlock(2 * w, 2 * w))
        self.layer3 = nn.Sequential(BasicBlock(2 * w, 4 * w, 2), BasicBlock(4 * w, 4 * w))
        self.layer4 = nn.Sequential(BasicBlock(4 * w, 8 * w, 2), BasicBlock(8 * w, 8 * w))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8 * w, num_classes)

    def forward(self, x):
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class ResidualUnit3d(nn.Module):
    """MONAI's ``ResidualUnit`` (two subunits of conv -> InstanceNorm -> PReLU, the first with the
    stride; the residual path a strided 3x3x3 conv when the shape changes, else the identity)."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv3d(c_in, c_out, 3, stride=stride, padding=1)
        self.norm1 = nn.InstanceNorm3d(c_out, affine=False)
        self.act1 = nn.PReLU()
        self.conv2 = nn.Conv3d(c_out, c_out, 3, padding=1)
        self.norm2 = nn.InstanceNorm3d(c_out, affine=False)
        self.act2 = nn.PReLU()
        self.residual = None
        if stride != 1 or c_in != c_out:
            self.residual = nn.Conv3d(c_in, c_out, 3 if stride != 1 else 1, stride=stride, padding=1 if stride != 1 else 0)

    def forward(self, x):
        y = self.act1(self.norm1(self.conv1(x)))
        y = self.act2(self.norm2(self.conv2(y)))
        return y + (x if self.residual is None else self.residual(x))


class MonaiUNet3d(nn.Module):
    """A MONAI-style ``UNet`` (``monai.networks.nets.UNet(spatial_dims=3, channels=(w, 2w, 4w),
    strides=(2, 2), num_res_units=2)``'s structure): encoder residual units that downsample with
    a stride-2 convolution, a bottom residual unit, a decoder of transposed convolutions (stride 2)
    -> InstanceNorm -> PReLU, concatenation with the skip and a residual unit; a 1x1x1 head.
    InstanceNorm without affine parameters (MONAI's default), PReLU with one weight.  Volume
    sides divisible by 4."""

    def __init__(self, c_in: int = 1, c_out: int = 2, width: int = 4):
        super().__init__()
        w = width
        self.enc1 = ResidualUnit3d(c_in, w)            # D
        self.down1 = ResidualUnit3d(w, 2 * w, 2)       # D/2
        self.down2 = ResidualUnit3d(2 * w, 4 * w, 2)   # D/4
        self.bottom = ResidualUnit3d(4 * w, 4 * w)
        self.up2 = nn.ConvTranspose3d(4 * w, 2 * w, 2, stride=2)
        self.up2_norm, self.up2_act = nn.InstanceNorm3d(2 * w), nn.PReLU()
        self.dec2 = ResidualUnit3d(4 * w, 2 * w)
        self.up1 = nn.ConvTranspose3d(2 * w, w, 2, stride=2)
        self.up1_norm, self.up1_act = nn.InstanceNorm3d(w), nn.PReLU()
        self.dec1 = ResidualUnit3d(2 * w, w)
        self.head = nn.Conv3d(w, c_out, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.down1(e1)
        b = self.bottom(self.down2(e2))
        d2 = self.dec2(torch.cat([self.up2_act(self.up2_norm(self.up2(b))), e2], dim=1))
        d1 = self.dec1(torch.cat([self.up1_act(self.up1_norm(self.up1(d2))), e1], dim=1))
        return self.head(d1)


# ---------------------------------------------------------------------------------------------
# Llama
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaConfig:
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 64
    ffn_hidden: int = 64
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 16
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def rope_tables(head_dim: int, seq_len: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (seq_len, head_dim) of the rotary embedding (rotate-half convention)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)  # (S, hd/2)
    angles = torch.cat([angles, angles], dim=-1)  # (S, hd)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, S, H, hd); cos/sin (S, hd)."""
    cos = cos.unsqueeze(0).unsqueeze(2)
    sin = sin.unsqueeze(0).unsqueeze(2)
    return x * cos + rotate_half(x) * sin


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, S, Hkv, hd) -> (B, S, Hkv * n_rep, hd): each k/v head serves n_rep query heads."""
    if n_rep == 1:
        return x
    b, s, h, d = x.shape
    return x.unsqueeze(3).expand(b, s, h, n_rep, d).reshape(b, s, h * n_rep, d)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.n_rep = cfg.n_heads // cfg.n_kv_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq = apply_rotary(xq, cos, sin)
        xk = apply_rotary(xk, cos, sin)
        keys = repeat_kv(xk, self.n_rep)
        values = repeat_kv(xv, self.n_rep)
        q, k, v = (t.transpose(1, 2) for t in (xq, keys, values))  # (B, H, S, hd)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return self.wo(out)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList([TransformerBlock(cfg) for _ in range(cfg.n_layers)])
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._init_weights()

    def _init_weights(self) -> None:
        g = torch.Generator().manual_seed(1234)
        for name, p in self.named_parameters():
            if p.dim() == 2:  # linear/embedding: small normal; norms stay ones (SequenceParallel's assumption)
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seqlen = tokens.shape[1]
        cos, sin = self.rope_cos[:seqlen], self.rope_sin[:seqlen]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


def tp_plan(tp, *, embedding: str = "rowwise", local_output: bool = True):
    """The tensor-parallel + sequence-parallel plan of :class:`Transformer`, with the styles of
    module ``tp``.  Norms run on sequence shards (``SequenceParallel``), the residual stream is
    sequence-sharded, and each block gathers the sequence before its projections.

    ``local_output=True`` is torchtitan's plan: the projections hand LOCAL shards to the attention
    and MLP bodies (so ``n_kv_heads`` must divide by the mesh size) and the residual stream is the
    local sequence shard.  ``local_output=False`` keeps DTensors everywhere (the rope tables are
    annotated as replicated), so attention runs as DTensor ops (``scaled_dot_product_attention``
    with the heads sharded) and any head count works.  ``embedding``: "rowwise" (vocab rows
    sharded) or "colwise" (embedding dim sharded).  Returns ``(model_plan, layer_plan)``.
    """
    from torch.distributed.tensor.placement_types import Replicate, Shard

    seq = Shard(1)
    keep = not local_output  # use_local_output=False keeps DTensors
    emb_style = tp.RowwiseParallel if embedding == "rowwise" else tp.ColwiseParallel
    model_plan = {
        "tok_embeddings": emb_style(input_layouts=Replicate(), output_layouts=seq, use_local_output=local_output),
        "norm": tp.SequenceParallel(),
        "output": tp.ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    rope = Replicate() if keep else None
    layer_plan = {
        "attention_norm": tp.SequenceParallel(),
        "attention": tp.PrepareModuleInput(
            input_layouts=(seq, rope, rope),
            desired_input_layouts=(Replicate(), rope, rope),
            use_local_output=False,
        ),
        "attention.wq": tp.ColwiseParallel(use_local_output=local_output),
        "attention.wk": tp.ColwiseParallel(use_local_output=local_output),
        "attention.wv": tp.ColwiseParallel(use_local_output=local_output),
        "attention.wo": tp.RowwiseParallel(output_layouts=seq, use_local_output=local_output),
        "ffn_norm": tp.SequenceParallel(),
        "feed_forward": tp.PrepareModuleInput(
            input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=False
        ),
        "feed_forward.w1": tp.ColwiseParallel(use_local_output=local_output),
        "feed_forward.w2": tp.RowwiseParallel(output_layouts=seq, use_local_output=local_output),
        "feed_forward.w3": tp.ColwiseParallel(use_local_output=local_output),
    }
    return model_plan, layer_plan


def parallelize(model: Transformer, mesh, tp, **plan_kwargs) -> Transformer:
    """Apply :func:`tp_plan` with ``tp.parallelize_module`` (re-tying a tied LM head)."""
    model_plan, layer_plan = tp_plan(tp, **plan_kwargs)
    for layer in model.layers:
        tp.parallelize_module(layer, mesh, layer_plan)
    tp.parallelize_module(model, mesh, model_plan)
    if model.cfg.tie_embeddings:  # the two styles made two parameters: tie them again
        model.output.weight = model.tok_embeddings.weight
    return model
