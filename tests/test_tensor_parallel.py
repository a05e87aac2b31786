"""Tensor (+ sequence) parallelism on 2 gloo ranks against the single-process module.

Each rank builds the same randomly initialised model (every parameter non-zero, including the
adaLN tables and the zero-initialised projections, so every path carries gradient), parallelizes
a deep copy with tp=2, and compares: the forward output, every parameter gradient (DTensors
gathered with full_tensor(), the partial-grad sync applied), the clipped gradient norm, and the
parameters after one AdamW step on the clipped gradients.

Tolerances: float64 rtol 1e-10, atol 1e-12 everywhere. float32 rtol 1e-5 with atol 1e-5 x the
tensor's largest |entry| (summation-order noise of near-zero entries scales with the tensor, not
the entry; measured <= 2e-6 of it). The float32 AdamW step uses eps 1e-3: Adam's first update is
lr * g / (|g| + eps), which amplifies gradient noise on near-zero entries by up to lr / eps
(1e6 with the default eps 1e-8, i.e. fp32 noise becomes O(1e-4) parameter differences); float64
checks the default eps. All cases run in one launch to pay process start-up once.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dist_harness import run_ranks

TOL = {torch.float64: dict(rtol=1e-10, atol=1e-12, scaled_atol=0.0, adam_eps=1e-8),
       torch.float32: dict(rtol=1e-5, atol=0.0, scaled_atol=1e-5, adam_eps=1e-3)}
LR, CLIP = 1e-2, 0.5


class DiTStack(nn.Module):
    """Replicated parts around a DiT block stack, so gradients flowing out of the stack
    (x, t0, context) are checked through the upstream parameters too."""

    def __init__(self, hidden=32, heads=4, depth=2, in_dim=6, ctx_dim=12):
        super().__init__()
        from common.nn import DiTBlock, FinalLayer
        self.embed = nn.Linear(in_dim, hidden)
        self.t_block = nn.Linear(hidden, 6 * hidden)
        self.ctx_proj = nn.Linear(ctx_dim, ctx_dim)
        self.blocks = nn.ModuleList(DiTBlock(hidden, heads, mlp_ratio=2.0, context_dim=ctx_dim) for _ in range(depth))
        self.final = FinalLayer(hidden, in_dim)

    def forward(self, x, temb, ctx, ctx_mask, rope):
        h, t0, c = self.embed(x), self.t_block(temb), self.ctx_proj(ctx)
        for block in self.blocks:
            h = block(h, t0, c, ctx_mask, rope)
        return self.final(h, temb)


def _randomize(model: nn.Module) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))


def _full(t):
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def _compare(tag, name, ref, got, rtol, atol, report, failures):
    """Record the max error relative to the tensor's scale; fail outside rtol/atol."""
    ref, got = ref.detach(), got.detach()
    err = (got - ref).abs().max().item()
    scale = ref.abs().max().item()
    report[tag] = max(report.get(tag, 0.0), err / max(scale, 1e-30))
    if not torch.allclose(got, ref, rtol=rtol, atol=atol):
        failures.append(f"{tag} {name}: max abs err {err:.3e} (max |ref| {scale:.3e})")


def _check_model(ref, par, run, sync, dtype, report, failures):
    """Forward/backward on both, then one AdamW step; record max relative errors per kind."""
    from torch.distributed.tensor import DTensor, Partial

    from common.parallel.tensor_parallel import clip_grad_norm_
    tol = TOL[dtype]

    def close(tag, name, r, g, atol=None):
        a = tol["atol"] + tol["scaled_atol"] * r.detach().abs().max().item() if atol is None else atol
        _compare(tag, name, r, g, tol["rtol"], a, report, failures)
    out_ref, loss_ref = run(ref)
    norm = par.blocks[0].norm_cross if hasattr(par.blocks[0], "norm_cross") else par.blocks[0].ffn_norm
    seen = []
    handle = norm.register_forward_hook(lambda _m, args, _out: seen.append(tuple(args[0].shape)))
    out_par, loss_par = run(par)
    handle.remove()
    report["stream_len"] = seen[0][1]  # L/tp under sequence parallelism, L otherwise
    close("output", "", out_ref, _full(out_par))
    loss_ref.backward()
    loss_par.backward()
    sync()  # what the trainer does after backward, before clipping
    ref_params = dict(ref.named_parameters())
    for name, p in par.named_parameters():
        if isinstance(p.grad, DTensor) and any(isinstance(pl, Partial) for pl in p.grad.placements):
            failures.append(f"{name}: gradient left Partial {p.grad.placements}")
        close("grad", name, ref_params[name].grad, _full(p.grad))
    # Clipping (active: max_norm below the norm) with mixed plain/DTensor gradients.
    norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
    norm_par = clip_grad_norm_(par.parameters(), CLIP)
    close("grad_norm", "", norm_ref, norm_par)
    assert norm_ref > CLIP
    opts = [torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.1, eps=tol["adam_eps"]) for m in (ref, par)]
    for o in opts:
        o.step()
    for name, p in par.named_parameters():
        close("param_after_step", name, ref_params[name], _full(p))


def _dit_case(mesh, dtype, sp):
    from common.kernels import rope_frequencies
    from common.parallel.tensor_parallel import apply_tensor_parallel
    torch.manual_seed(0)
    ref = DiTStack().to(dtype)
    _randomize(ref)
    par = copy.deepcopy(ref)
    sync = apply_tensor_parallel(par, mesh, plan="dit", sequence_parallel=sp)
    b, gh, gw = 2, 2, 4
    x = torch.randn(b, gh * gw, 6, dtype=dtype)
    temb = torch.randn(b, 32, dtype=dtype)
    ctx = torch.randn(b, 5, 12, dtype=dtype)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool)
    rows, cols = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
    rope = rope_frequencies(torch.stack([rows.flatten(), cols.flatten()], -1), (4, 4))
    w = torch.randn(b, gh * gw, 6, dtype=dtype)

    def run(m):
        out = m(x, temb, ctx, mask, rope)
        return out, (out * w).sum()
    report, failures = {}, []
    _check_model(ref, par, run, sync, dtype, report, failures)
    report["partial_params"] = len(sync)
    return report, failures


def _llama_case(mesh, dtype, sp, loss_parallel=False):
    from common.nn import Llama, LlamaConfig
    from common.parallel.tensor_parallel import apply_tensor_parallel
    from torch.distributed.tensor.parallel import loss_parallel as loss_parallel_ctx
    torch.manual_seed(1)
    cfg = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_hidden=48, max_seq_len=16,
                      qk_norm=dtype == torch.float64)
    ref = Llama(cfg).to(dtype)
    _randomize(ref)
    par = copy.deepcopy(ref)
    sync = apply_tensor_parallel(par, mesh, plan="llama", sequence_parallel=sp, loss_parallel=loss_parallel)
    tokens = torch.randint(0, 64, (2, 8))
    targets = torch.randint(0, 64, (2, 8))

    def run(m):
        logits = m(tokens)
        if m is par and loss_parallel:
            with loss_parallel_ctx():
                loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
                # backward must also run under loss_parallel: wrap it.
            return logits, _LossParallelBackward(loss)
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    report, failures = {}, []
    _check_model(ref, par, run, sync, dtype, report, failures)
    report["partial_params"] = len(sync)
    return report, failures


class _LossParallelBackward:
    """A loss whose backward runs inside loss_parallel(), as that context requires."""

    def __init__(self, loss):
        self.loss = loss

    def backward(self):
        from torch.distributed.tensor.parallel import loss_parallel
        with loss_parallel():
            self.loss.backward()


def _validation_case(mesh):
    from common.nn import DiTBlock, Llama, LlamaConfig
    from common.parallel.tensor_parallel import apply_tensor_parallel
    msgs = {}
    for key, fn in {
        "dit_heads": lambda: apply_tensor_parallel([DiTBlock(24, 3)], mesh, plan="dit"),
        "llama_kv_heads": lambda: apply_tensor_parallel(
            Llama(LlamaConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=1, vocab_size=64, ffn_hidden=48)),
            mesh, plan="llama"),
        "wrong_plan": lambda: apply_tensor_parallel([DiTBlock(32, 4)], mesh, plan="llama"),
    }.items():
        try:
            fn()
            msgs[key] = None
        except ValueError as e:
            msgs[key] = str(e)
    # Sequence length 7 is only known at forward time (checked before any collective runs).
    model = Llama(LlamaConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_hidden=48))
    apply_tensor_parallel(model.blocks, mesh, plan="llama", sequence_parallel=True)
    try:
        model(torch.randint(0, 64, (1, 7)))
        msgs["seq_len"] = None
    except ValueError as e:
        msgs["seq_len"] = str(e)
    return msgs


def _all_cases(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    torch.use_deterministic_algorithms(True)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    results = {}
    for dtype in (torch.float64, torch.float32):
        for sp in (False, True):
            tag = f"{str(dtype).removeprefix('torch.')}-{'sp' if sp else 'tp'}"
            results[f"dit-{tag}"] = _dit_case(mesh, dtype, sp)
            results[f"llama-{tag}"] = _llama_case(mesh, dtype, sp)
    results["llama-float64-sp-loss_parallel"] = _llama_case(mesh, torch.float64, True, loss_parallel=True)
    results["validation"] = _validation_case(mesh)
    return results


@pytest.fixture(scope="module")
def tp_results():
    return run_ranks(_all_cases, 2, timeout=240)


CASES = [f"{m}-{d}-{s}" for m in ("dit", "llama") for d in ("float64", "float32") for s in ("tp", "sp")]
CASES.append("llama-float64-sp-loss_parallel")


@pytest.mark.dist
@pytest.mark.parametrize("case", CASES)
def test_matches_single_process(tp_results, case):
    for rank, results in enumerate(tp_results):
        report, failures = results[case]
        print(f"rank {rank} {case}: " + ", ".join(f"{k}={v:.1e}" if isinstance(v, float) else f"{k}={v}"
                                                   for k, v in report.items()))
        assert not failures, f"rank {rank} {case}:\n" + "\n".join(failures[:20])
        assert report["stream_len"] == (4 if "-sp" in case else 8)  # L = 8 tokens, tp = 2


@pytest.mark.dist
def test_validation_names_the_numbers(tp_results):
    msgs = tp_results[0]["validation"]
    assert msgs["dit_heads"] and "heads 3" in msgs["dit_heads"] and "degree 2" in msgs["dit_heads"]
    assert msgs["llama_kv_heads"] and "kv heads 1" in msgs["llama_kv_heads"] and "degree 2" in msgs["llama_kv_heads"]
    assert msgs["wrong_plan"] and "LlamaBlock" in msgs["wrong_plan"]
    assert msgs["seq_len"] and "sequence length 7" in msgs["seq_len"] and "degree 2" in msgs["seq_len"]


def test_trainer_clip_matches_torch_and_counts_copies_once():
    # The trainer's clip (common.parallel.grads) against torch's, in float64; a stage held by 2
    # ranks holds every plain gradient twice, so the rank-local norm is sqrt(1/2) of the sum.
    from common.parallel.grads import clip_grads, grad_norm
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s, dtype=torch.float64)) for s in ((7, 5), (5,), (3, 4, 2))]
    for p in params:
        p.grad = torch.randn_like(p) * 3
    ref = [p.detach().clone().requires_grad_() for p in params]
    for r, p in zip(ref, params):
        r.grad = p.grad.clone()
    exact = torch.cat([p.grad.flatten() for p in params]).norm().item()
    assert grad_norm(params, ranks_per_stage=2) == pytest.approx(exact / 2 ** 0.5, rel=1e-12)
    norm = clip_grads(params, CLIP)
    norm_ref = torch.nn.utils.clip_grad_norm_(ref, CLIP)
    assert norm == pytest.approx(float(norm_ref), rel=1e-12) and norm > CLIP
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-12, atol=0)
