"""GELU with the tanh approximation (the DiT / PixArt MLP activation).

Under torch.compile on CPU the function is written as x * sigmoid(2c (x + 0.044715 x^3)),
c = sqrt(2/pi): 0.5 (1 + tanh z) = sigmoid(2z) exactly, and Inductor's CPU code computes a
sigmoid from one vectorised exp, where its tanh is a vectorised libm-style tanh costing several
times more (`python bench/cpu_gelu.py` prints both, fused forward + backward). Eager keeps ATen's
one-pass kernel (the sigmoid form there would be five passes), and so does compile on GPUs,
whose tanh is cheap.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

_TWO_C = 2.0 * math.sqrt(2.0 / math.pi)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """F.gelu(x, approximate="tanh"): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    if torch.compiler.is_compiling() and x.device.type == "cpu":
        return gelu_tanh_sigmoid_form(x)
    return F.gelu(x, approximate="tanh")


def gelu_tanh_sigmoid_form(x: torch.Tensor) -> torch.Tensor:
    """The same function as x * sigmoid(2c (x + 0.044715 x^3)); meant for code Inductor fuses."""
    return x * torch.sigmoid(_TWO_C * (x + 0.044715 * (x * x * x)))
