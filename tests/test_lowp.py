"""fp8 (torchao) and int8 training of the linears: numerics against fp32, the roofline filter,
probe-row recording, conversion reports and checkpoints. Single process, CPU: fp8 GEMMs run in
torch._scaled_mm and int8 GEMMs in torch._int_mm, as they would on a GPU."""
from __future__ import annotations

import functools
import io

import pytest
import torch
from torch import nn

from common.kernels import rope_frequencies
from common.nn import DiTBlock
from common.nn.llama import LlamaBlock, LlamaConfig
from common.precision.convert import LowPrecisionReport, record_linear_rows
from common.precision.fp8 import convert_fp8, fp8_after_optimizer_step
from common.precision.hardware import DEVICES
from common.precision.int8 import Int8MixedLinear, convert_int8, int8_matmul
from common.precision.roofline import predict, should_convert

H100 = DEVICES["h100-sxm"]


def sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (torchao's compute_error)."""
    return (20 * torch.log10(ref.norm() / (ref - x).norm())).item()


# ---------------------------------------------------------------- numerics of whole blocks
# One DiT block (hidden 128, 4 heads, 2 x 32 image tokens, 2 x 8 text tokens of width 64 through
# cross-attention, 2-D RoPE, QK-norm) and one Llama block (dim 128, 4 heads / 2 kv heads, SwiGLU
# 512, 2 x 32 tokens), every linear converted (force=True), against the same block in fp32.
# Loss: <out, g> with a fixed random g, so every output element sends a gradient of its own.
#
# Measured SQNR (dB; output / min over linear weight grads / input grad), this file's draw:
#                    fp8 tensorwise       fp8 rowwise          int8
#   DiT block        26.4 / 18.9 / 23.9   26.5 / 20.6 / 25.9   38.9 / 33.2 / 37.7
#   Llama block      40.9 / 20.1 / 35.2   40.5 / 22.4 / 38.2   52.1 / 37.4 / 49.8
# torchao's bar is 20 dB for the output and every gradient (measured there on a Llama FFN with
# loss = sum, i.e. a constant output gradient). Output and input gradient clear it everywhere
# here, and int8 (127 steps per sign, per-row scales) clears it by 10+ dB on every weight
# gradient. fp8 weight gradients do not, for two reasons, so their floors are lower:
# * tensorwise casts the output gradient to e5m2 (2 mantissa bits, ~25 dB per cast at best);
#   over six draws of the DiT block (weights and input perturbed) its weight gradients measured
#   17.5-19.9 dB, the Llama block's 19.5-20.6 dB: floor 17 dB.
# * the attention query/key projections' gradients pass through the softmax backward (and
#   QK-norm in the DiT), whose subtractions cancel most of the signal but not the rounding of
#   the fp8 GEMMs upstream. Rowwise (e4m3 everywhere): q/k 19.1-20.4 dB over the six draws,
#   every other linear 21.6+ dB: floor 18.5 dB for q/k, 20 dB for the rest.
MIN_SQNR_DB = 20.0
FP8_TENSORWISE_WEIGHT_GRAD_MIN_DB = 17.0
FP8_QK_PROJ_MIN_DB = 18.5
QK_PROJECTIONS = ("attn.to_q", "attn.to_k", "cross_attn.to_q", "cross_attn.to_k",
                  "attention.to_q", "attention.to_k")


def _weight_grad_floor(mode: str, linear: str) -> float:
    if mode == "tensorwise":
        return FP8_TENSORWISE_WEIGHT_GRAD_MIN_DB
    if mode == "rowwise" and linear in QK_PROJECTIONS:
        return FP8_QK_PROJ_MIN_DB
    return MIN_SQNR_DB


D, HEADS, BATCH = 128, 4, 2


def _dit_case():
    torch.manual_seed(0)
    blk = DiTBlock(D, HEADS, context_dim=64)
    with torch.no_grad():  # the zero inits (adaLN table, cross-attn output) would hide gradients
        for p in blk.parameters():
            p.add_(0.02 * torch.randn(p.shape))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 32, D, generator=g)
    t0 = torch.randn(BATCH, 6 * D, generator=g)
    context = torch.randn(BATCH, 8, 64, generator=g)
    rows, cols = torch.meshgrid(torch.arange(4), torch.arange(8), indexing="ij")
    rope = rope_frequencies(torch.stack([rows.flatten(), cols.flatten()], -1), (D // HEADS // 2,) * 2)
    return blk, x, lambda block, inp: block(inp, t0, context, None, rope)


def _llama_case():
    torch.manual_seed(0)
    cfg = LlamaConfig(dim=D, n_heads=HEADS, n_kv_heads=2, n_layers=1)
    blk = LlamaBlock(cfg)
    x = torch.randn(BATCH, 32, D, generator=torch.Generator().manual_seed(1))
    rope = rope_frequencies(torch.arange(32), (cfg.head_dim,))
    return blk, x, lambda block, inp: block(inp, rope)


CASES = {"dit": _dit_case, "llama": _llama_case}


def _forward_backward(block, x, run):
    x = x.clone().requires_grad_()
    out = run(block, x)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out * g).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in block.named_parameters()}


@functools.cache
def _fp32_reference(case: str):
    block, x, run = CASES[case]()
    return _forward_backward(block, x, run)


def _convert(block, mode: str, rows) -> LowPrecisionReport:
    if mode == "int8":
        return convert_int8(block, rows=rows, force=True)
    return convert_fp8(block, mode, rows=rows, force=True)


@pytest.mark.parametrize("mode", ["tensorwise", "rowwise", "int8"])
@pytest.mark.parametrize("case", ["dit", "llama"])
def test_block_sqnr_against_fp32(case, mode):
    ref_out, ref_dx, ref_grads = _fp32_reference(case)
    block, x, run = CASES[case]()
    rows = record_linear_rows(block, lambda: run(block, x))
    report = _convert(block, mode, rows)
    linears = sorted(rows)
    assert sorted(report.converted) == linears and not report.skipped, report.summary()

    out, dx, grads = _forward_backward(block, x, run)
    weight_sqnr = {name: sqnr(ref_grads[f"{name}.weight"], grads[f"{name}.weight"]) for name in linears}
    print(f"\n{case} {mode}: output {sqnr(ref_out, out):.1f} dB, input grad {sqnr(ref_dx, dx):.1f} dB, "
          "weight grads " + ", ".join(f"{n} {v:.1f}" for n, v in weight_sqnr.items()))
    assert sqnr(ref_out, out) >= MIN_SQNR_DB
    assert sqnr(ref_dx, dx) >= MIN_SQNR_DB
    for name, value in weight_sqnr.items():
        floor = _weight_grad_floor(mode, name)
        assert value >= floor, f"{name}: weight grad SQNR {value:.1f} dB < {floor} dB"


def test_int8_matmul_pads_small_and_unaligned_shapes():
    # M=3 <= 16 rows and K=20, N=12 not multiples of 8: what torch._int_mm on CUDA refuses.
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 20, generator=g), torch.randn(12, 20, generator=g)
    out = int8_matmul(a, b)
    assert out.shape == (3, 12)
    assert sqnr(a @ b.t(), out) >= 35.0  # measured 44.7 dB: one int8 rounding per operand


# ---------------------------------------------------------------- roofline
@pytest.mark.parametrize("mode", ["tensorwise", "rowwise", "int8"])
def test_roofline_converts_large_square_gemm(mode):
    ok, reason = should_convert(8192, 8192, 8192, mode, H100)
    assert ok, reason  # compute-bound: predicted 1.69x (tensorwise), 1.47x (rowwise), 1.16x (int8)


@pytest.mark.parametrize("mode", ["tensorwise", "rowwise", "int8"])
@pytest.mark.parametrize("shape", [(256, 128, 128), (8, 1152, 6 * 1152)], ids=["small", "adaln-rows=batch"])
def test_roofline_keeps_memory_bound_gemms_bf16(shape, mode):
    ok, reason = should_convert(*shape, mode, H100)
    assert not ok and reason.startswith("predicted slower"), reason


def test_roofline_refuses_unaligned_dims():
    ok, reason = should_convert(8192, 8200, 8192, "tensorwise", H100)
    assert not ok and reason.startswith("K/N not multiple of 16"), reason
    assert not should_convert(8192, 8192, 8200, "int8", H100)[0]


def test_roofline_int8_keeps_weight_grad_in_bf16():
    p8, pi = predict(8192, 8192, 8192, "tensorwise", H100), predict(8192, 8192, 8192, "int8", H100)
    # 2 of 3 GEMMs at twice the rate: at most 3 / (0.5 + 0.5 + 1) = 1.5x, below fp8's ~2x ceiling.
    assert pi["speedup"] < 1.5 < p8["speedup"] < 2.0
    assert should_convert(8192, 8192, 8192, "tensorwise", DEVICES["a100-sxm"]) == (
        False, "no fp8 peak: a100-sxm has no fp8 GEMMs")


# ---------------------------------------------------------------- rows, filter, reports
class _TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.token_proj = nn.Linear(32, 48)
        self.pooled_proj = nn.Linear(32, 48)
        self.unused = nn.Linear(32, 32)

    def forward(self, tokens, pooled):
        return self.token_proj(tokens).sum() + self.pooled_proj(pooled).sum()


def test_record_linear_rows_counts_all_leading_dims():
    model = _TwoLinears()

    def probe():
        model(torch.randn(3, 5, 32), torch.randn(3, 32))
        model(torch.randn(2, 7, 32), torch.randn(2, 32))  # max over calls: 15 vs 14 token rows
    rows = record_linear_rows(model, probe)
    assert rows == {"token_proj": 15, "pooled_proj": 3}
    assert not any(m._forward_pre_hooks for m in model.modules())  # hooks removed


def test_convert_without_force_keeps_tiny_model_high_precision():
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.Linear(64, 24), nn.Linear(64, 64))
    x = torch.randn(4, 16, 64)
    rows = record_linear_rows(model, lambda: model[3](model[2](model[1](model[0](x)))))
    fp8 = convert_fp8(model, "rowwise", rows=rows)
    int8 = convert_int8(model, rows=rows)
    assert all(type(m) is nn.Linear for m in model if not isinstance(m, nn.GELU))
    for report in (fp8, int8):
        assert report.converted == []
        assert report.skipped["4"] == "not run in the probe forward"
        assert report.skipped["3"].startswith("K/N not multiple of 16")
        assert report.skipped["0"].startswith("predicted slower")
    assert fp8.summary() == ("fp8 rowwise: 0 of 4 linears converted (4 kept: 2 predicted slower, "
                             "1 K/N not multiple of 16, 1 not run in the probe forward)")


def test_force_and_exclude():
    model = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 24), nn.Linear(24, 64))
    report = convert_int8(model, rows={}, force=True, exclude=("0",))
    assert report.converted == [] and report.skipped["0"] == "excluded: matches '0'"
    assert report.summary() == "int8: 0 of 3 linears converted (3 kept: 2 K/N not multiple of 16, 1 excluded)"
    model = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64))
    assert convert_int8(model, rows={}, force=True).converted == ["0", "1"]
    assert all(isinstance(m, Int8MixedLinear) for m in model)
    again = convert_fp8(model, "tensorwise", rows={}, force=True)  # converted layers are left alone
    assert again.converted == [] and again.skipped["0"] == "not a plain nn.Linear: Int8MixedLinear"


def test_rowwise_fp8_all_gather_is_refused():
    with pytest.raises(ValueError, match="tensorwise"):
        convert_fp8(nn.Sequential(nn.Linear(64, 64)), "rowwise", rows={}, force=True, fsdp_all_gather=True)


def test_after_optimizer_step_is_a_noop_without_fp8_all_gather():
    model = nn.Sequential(nn.Linear(64, 64))
    convert_fp8(model, "tensorwise", rows={}, force=True)
    fp8_after_optimizer_step(model)  # no FSDP, no fp8 all-gather: nothing to precompute


# ---------------------------------------------------------------- checkpoints
def test_int8_linear_state_dict_matches_nn_linear():
    torch.manual_seed(0)
    plain = nn.Linear(64, 32)
    int8 = Int8MixedLinear(64, 32)
    assert list(int8.state_dict()) == list(plain.state_dict())
    int8.load_state_dict(plain.state_dict())
    plain2 = nn.Linear(64, 32)
    plain2.load_state_dict(int8.state_dict())
    x = torch.randn(2, 20, 64)
    assert torch.equal(plain2(x), plain(x))
    assert sqnr(plain(x), int8(x)) >= 30.0


def test_int8_linear_under_autocast():
    # The non-FSDP layouts run forward under autocast: the layer computes in bf16 and the fp32
    # master weight gets an fp32 gradient, as with F.linear.
    torch.manual_seed(0)
    plain, int8 = nn.Linear(64, 32), Int8MixedLinear(64, 32)
    int8.load_state_dict(plain.state_dict())
    x = torch.randn(2, 20, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = int8(x)
    assert out.dtype == torch.bfloat16
    out.float().square().sum().backward()
    assert int8.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    plain(x).square().sum().backward()
    assert sqnr(plain.weight.grad, int8.weight.grad) >= MIN_SQNR_DB


@pytest.mark.parametrize("recipe,all_gather", [("tensorwise", True), ("rowwise", False)])
def test_fp8_state_dict_round_trip(recipe, all_gather):
    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
        convert_fp8(model, recipe, rows={}, force=True, fsdp_all_gather=all_gather)
        return model
    trained = build()
    with torch.no_grad():
        for p in trained.parameters():
            p.mul_(1.5).add_(0.1)
    buf = io.BytesIO()
    torch.save(trained.state_dict(), buf)
    buf.seek(0)
    fresh = build()
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    assert torch.equal(fresh(x), trained(x))
    assert not torch.equal(build()(x), trained(x))
    plain = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))  # same keys as unconverted
    buf.seek(0)
    plain.load_state_dict(torch.load(buf, weights_only=True))
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), trained.parameters()))
