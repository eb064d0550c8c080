"""Image filter: a learned 3x3 filter bank over single-channel images.

image [B, H, W] float32 -> Conv2d(1 -> hidden_channels, 3x3, padding="same")
-> ReLU -> Conv2d(hidden_channels -> 1, 1x1) -> filtered [B, H, W] float32.

Only ONE spatial (3x3) layer is used on purpose.  Batches are right/bottom
zero-padded, and a 3x3 "same" conv with zero padding sees zeros beyond an
item's border whether those zeros come from the conv's own padding or from the
batch padding, so real pixels are unaffected.  A second 3x3 layer would break
this even without biases: the first layer's output just outside the real
region is generally nonzero (it sees real neighbours), whereas unpadded it
would be the second conv's zero padding.  Everything after the first conv is
pointwise (ReLU, 1x1 conv), so it cannot leak across pixels.  Output values in
the padded region are unspecified and are sliced off.
Self-contained: imports only torch.
"""

import torch
from torch import nn


class Model(nn.Module):
    def __init__(self, hidden_channels: int = 8) -> None:
        super().__init__()
        self.spatial = nn.Conv2d(1, hidden_channels, kernel_size=3, padding="same")
        self.act = nn.ReLU()
        self.mix = nn.Conv2d(hidden_channels, 1, kernel_size=1)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = image.unsqueeze(1)  # [B, 1, H, W]
        x = self.mix(self.act(self.spatial(x)))
        return x.squeeze(1)
