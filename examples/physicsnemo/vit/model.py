"""The hybrid ViT of the PhysicsNeMo ShardTensor tutorial (ShardTensorExamples 5_vit_training_loop/model): a
convolutional patch embedding, a learned positional embedding, pre-norm transformer blocks, mean pooling and a
linear head. Plain torch: the same module runs on a single device and on a sharded image."""
import torch
from einops import rearrange
from torch import nn


class PatchEmbedding2d(nn.Module):
    """A strided convolution that cuts the image into patches and embeds them, then a LayerNorm and a ReLU on the
    tokens (B, H/p * W/p, embed_dim)."""

    def __init__(self, img_size, patch_size: int = 16, in_channels: int = 3, embed_dim: int = 768) -> None:
        super().__init__()
        for side in img_size:
            assert side % patch_size == 0, f"image size {side} is not a multiple of the patch size {patch_size}"
        self.num_patches = (img_size[0] // patch_size) * (img_size[1] // patch_size)
        self.conv = nn.Conv2d(in_channels, embed_dim, kernel_size=patch_size, stride=patch_size)
        self.norm = nn.LayerNorm(embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        x = rearrange(x, "b c h w -> b (h w) c")
        return nn.functional.relu(self.norm(x))


class PatchEmbedding3d(nn.Module):
    """The volumetric patch embedding: tokens (B, D/p * H/p * W/p, embed_dim)."""

    def __init__(self, img_size, patch_size: int = 16, in_channels: int = 3, embed_dim: int = 768) -> None:
        super().__init__()
        for side in img_size:
            assert side % patch_size == 0, f"image size {side} is not a multiple of the patch size {patch_size}"
        self.num_patches = (img_size[0] // patch_size) * (img_size[1] // patch_size) * (img_size[2] // patch_size)
        self.conv = nn.Conv3d(in_channels, embed_dim, kernel_size=patch_size, stride=patch_size)
        self.norm = nn.LayerNorm(embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        x = rearrange(x, "b c d h w -> b (d h w) c")
        return nn.functional.relu(self.norm(x))


class MultiHeadAttention(nn.Module):
    """Self-attention with one fused QKV projection and torch's scaled_dot_product_attention."""

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = False) -> None:
        super().__init__()
        assert dim % num_heads == 0, f"dim {dim} is not a multiple of num_heads {num_heads}"
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]  # each (B, heads, N, head_dim)
        x = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)
        x = x.transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


class MLP(nn.Module):
    def __init__(self, in_features: int, hidden_features: int, out_features: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features or in_features)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_features or in_features, out_features or in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = False) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = MultiHeadAttention(dim, num_heads=num_heads, qkv_bias=qkv_bias)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, int(dim * mlp_ratio), dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class HybridViT(nn.Module):
    def __init__(self, img_size=(256, 256), patch_size: int = 8, in_channels: int = 3, num_classes: int = 1000,
                 embed_dim: int = 768, num_heads: int = 6, depth: int = 16, mlp_ratio: float = 4.0,
                 qkv_bias: bool = True) -> None:
        super().__init__()
        embed = PatchEmbedding2d if len(img_size) == 2 else PatchEmbedding3d
        self.patch_embed = embed(img_size=img_size, patch_size=patch_size, in_channels=in_channels,
                                 embed_dim=embed_dim)
        # One learned vector per patch (no class token): the parameter the training script shards.
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.num_patches, embed_dim))
        self.stages = nn.ModuleList([TransformerBlock(embed_dim, num_heads, mlp_ratio, qkv_bias)
                                     for _ in range(depth)])
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x) + self.pos_embed
        for stage in self.stages:
            x = stage(x)
        return x.mean(dim=(1,))  # the mean over all tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.forward_features(x))
