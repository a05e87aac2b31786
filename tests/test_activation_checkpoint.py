"""Activation checkpointing (none / full / selective / offload) and per-block compile on a small DiT.

Every mode must give the loss and every parameter gradient of the plain model bit for bit (fp32;
the recompute runs the same kernels on the same inputs), keep
parameter names and state_dict keys, and measurably reduce what forward holds for backward.
"""
from __future__ import annotations

import copy

import pytest
import torch

from common.parallel.activation_checkpoint import SavedTensorMeter, apply_activation_checkpointing
from common.parallel.compile import compile_blocks
from pipelines.text2image.model import DiT, dit_config


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny matmuls: a second OpenMP thread only adds spinning, which on a loaded 2-core machine
    # turned a 10 ms step into seconds. Restored afterwards for the other test modules.
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


AC_CASES = [("full", 1), ("selective", 2), ("selective", 3), ("offload", 1)]


def _model(seed: int = 0) -> DiT:
    torch.manual_seed(seed)
    model = DiT(dit_config("tiny", hidden=32, depth=4, heads=2, text_dim=16))
    # DiT's init zeroes the adaLN gates, the cross-attention output and the final layer, which
    # would make the blocks the identity and most gradients zero: perturb every parameter.
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 32, 32, generator=g)
    t = torch.rand(2, generator=g)
    ctx = torch.randn(2, 8, 16, generator=g)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, 5:] = False
    target = torch.randn(2, 3, 32, 32, generator=g)
    return x, t, ctx, mask, target


def _loss_and_grads(model: DiT, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    x, t, ctx, mask, target = batch
    model.zero_grad(set_to_none=True)
    loss = ((model(x, t, ctx, mask) - target) ** 2).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(ref, got, rtol, atol):
    (ref_loss, ref_grads), (loss, grads) = ref, got
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=atol)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        assert g.abs().max() > 0, f"{name}: zero gradient, the test would prove nothing"
        torch.testing.assert_close(grads[name], g, rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("mode,every", AC_CASES, ids=[f"{m}{k}" for m, k in AC_CASES])
def test_ac_matches_plain_model_and_keeps_names(mode, every):
    ref_model = _model()
    model = copy.deepcopy(ref_model)
    batch = _batch()
    ref = _loss_and_grads(ref_model, batch)
    apply_activation_checkpointing(model.blocks, mode, every)
    _assert_same(ref, _loss_and_grads(model, batch), rtol=0, atol=0)
    # Names: state_dict, named_parameters (EMA, optimizer) and DCP's view are all unchanged.
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    assert list(model.state_dict()) == list(ref_model.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref_model.named_parameters()]
    assert list(get_model_state_dict(model)) == list(get_model_state_dict(ref_model))
    assert all(type(b) is type(rb) for b, rb in zip(model.blocks, ref_model.blocks))
    # Inference (no grad) bypasses the recompute machinery and gives the same output.
    x, t, ctx, mask, _ = batch
    with torch.no_grad():
        torch.testing.assert_close(model(x, t, ctx, mask), ref_model(x, t, ctx, mask), rtol=0, atol=0)


def test_ac_copy_is_bound_to_the_copy():
    model = _model()
    apply_activation_checkpointing(model.blocks, "full")
    clone = copy.deepcopy(model)
    assert all(b.forward.inner.__self__ is b for b in clone.blocks)
    batch = _batch()
    _assert_same(_loss_and_grads(model, batch), _loss_and_grads(clone, batch), rtol=0, atol=0)


@pytest.mark.parametrize("mode,every,match", [("everything", 1, "not one of"), ("selective", 0, "every"),
                                              ("full", -1, "every"), ("selective", 1.5, "every")])
def test_bad_arguments_refused(mode, every, match):
    with pytest.raises(ValueError, match=match):
        apply_activation_checkpointing(_model().blocks, mode, every)


def test_applying_twice_refused():
    model = _model()
    apply_activation_checkpointing(model.blocks, "full")
    with pytest.raises(ValueError, match="already"):
        apply_activation_checkpointing(model.blocks, "selective", 2)


def _saved_bytes(mode: str, every: int = 1) -> SavedTensorMeter:
    model = _model()
    apply_activation_checkpointing(model.blocks, mode, every)
    x, t, ctx, mask, target = _batch()
    with SavedTensorMeter(model) as meter:
        loss = ((model(x, t, ctx, mask) - target) ** 2).mean()
    loss.backward()  # the graph is still sound after metering
    return meter


def test_saved_activation_bytes_full_lt_selective_lt_none():
    none, sel, full = _saved_bytes("none"), _saved_bytes("selective", 2), _saved_bytes("full")
    assert full.device_bytes < sel.device_bytes < none.device_bytes
    # Selective k=2 drops about half of the blocks' activations, full nearly all of them.
    assert full.device_bytes < 0.5 * none.device_bytes
    # On CPU, offload runs its hooks but keeps everything where it is.
    off = _saved_bytes("offload")
    assert (off.device_bytes, off.host_bytes) == (none.device_bytes, 0)


def _fsdp_rank(rank: int, world_size: int, compiled: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world_size,))
    batch = _batch()  # the same batch on both ranks: the averaged gradient is the local one
    ref = _loss_and_grads(_model(), batch)
    out = {}
    for mode, every in (("full", 1), ("selective", 2), ("offload", 1)):
        model = _model()
        apply_activation_checkpointing(model.blocks, mode, every)  # the documented order:
        if compiled:                                                # AC, compile, then FSDP
            # aot_eager: dynamo's capture of the checkpointed block under FSDP2's hooks and AOT
            # autograd's recompute partition are what compose here; inductor's code generation of
            # the same blocks is checked in one process (test_compiled_blocks_match_eager), at a
            # fraction of this test's former four CPU-minutes.
            compile_blocks(model.blocks, backend="aot_eager")
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for step in range(2):  # the second step runs on parameters FSDP resharded after step one
            loss, grads = _loss_and_grads(model, batch)
            grads = {n: g.full_tensor() for n, g in grads.items()}
            tol = (COMPILE_RTOL, COMPILE_ATOL) if compiled else (1e-5, 1e-7)
            _assert_same(ref, (loss, grads), *tol)
        out[mode] = list(model.state_dict()) == list(ref[1])
    return out


@pytest.mark.dist
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_ac_composes_with_fsdp2(compiled):
    from tests.dist_harness import run_ranks
    for result in run_ranks(_fsdp_rank, world_size=2, args=(compiled,), timeout=600):
        assert all(result.values()), result


def test_compile_keeps_names_and_refuses_twice(monkeypatch):
    import common.parallel.compile as compile_mod
    model = _model()
    keys = list(model.state_dict())
    compile_blocks(model.blocks, backend="eager")  # no codegen: names and plumbing only
    assert list(model.state_dict()) == keys
    assert all(b.forward.inner.__self__ is b for b in copy.deepcopy(model).blocks)
    with pytest.raises(ValueError, match="already compiled"):
        compile_blocks(model.blocks, backend="eager")
    monkeypatch.setattr(compile_mod, "_cpp_compiler", lambda: None)
    with pytest.raises(RuntimeError, match="C\\+\\+ compiler"):
        compile_blocks(_model().blocks)


class _DataDependent(torch.nn.Module):
    def forward(self, x):
        return x * 2 if bool(x.sum() > 0) else x  # a branch on a value: no single graph


class _DataDependentStrict(torch.nn.Module):
    # Its own code object: dynamo caches per code, so a graph-broken entry for the class above
    # would be reused here without the fullgraph check.
    def forward(self, x):
        return x * 2 if bool(x.sum() > 0) else x


def test_compile_falls_back_from_fullgraph_only_when_not_requested():
    blocks = torch.nn.ModuleList([_DataDependent()])
    compile_blocks(blocks, backend="eager")
    with pytest.warns(UserWarning, match="not one graph"):
        assert torch.equal(blocks[0](torch.ones(3)), torch.full((3,), 2.0))
    strict = torch.nn.ModuleList([_DataDependentStrict()])
    compile_blocks(strict, backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="(?i)data-dependent|graph break|unsupported"):
        strict[0](torch.ones(3))


def _eager_and_compiled_copy():
    """(a DiT, a copy with compiled blocks, the tensor shapes each compiled block graph was traced with)."""
    torch._dynamo.reset()  # blocks share one code object with other tests' compiled DiTs
    graph_inputs = []

    def backend(gm, example_inputs):
        graph_inputs.append([tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)])
        return gm.forward

    ref = _model()
    model = copy.deepcopy(ref)
    compile_blocks(model.blocks, backend=backend)
    return ref, model, graph_inputs


def _padded_text(used: int):
    """40 text positions: sample 0 uses the first `used`, sample 1 the first 3."""
    ctx = torch.randn(2, 40, 16, generator=torch.Generator().manual_seed(3))
    mask = torch.zeros(2, 40, dtype=torch.bool)
    mask[0, :used] = True
    mask[1, :3] = True
    return ctx, mask


def test_compiled_blocks_get_trimmed_text_keys_in_one_graph():
    # run_blocks drops the text keys no sample uses before the per-block compiled code (which
    # cannot: a data-dependent length); the lengths a run sees (trimmed to 16 or 32, or padded up
    # to 48) share one graph with a dynamic key length, and each output equals eager's.
    ref, model, graph_inputs = _eager_and_compiled_copy()
    x, t, _, _, _ = _batch()
    for used in (5, 20, 40):  # keys kept: 16, 32, and 48 (padded past the context's 40)
        ctx, mask = _padded_text(used)
        with torch.no_grad():
            torch.testing.assert_close(model(x, t, ctx, mask), ref(x, t, ctx, mask), rtol=1e-5, atol=1e-6)
    assert len(graph_inputs) == 1, graph_inputs
    hidden = ref.cfg.hidden
    assert (2, 16, hidden) in graph_inputs[0] and not any(s[1:] == (40, hidden) for s in graph_inputs[0])
    torch._dynamo.reset()


def test_pipeline_stage_trims_text_keys_once_for_its_compiled_blocks():
    # A pipeline stage runs its own block loop: it trims the keys as run_blocks does, so its
    # compiled blocks see 16 keys of the 40, while its output matches the eager model's.
    from common.nn.dit_parallel import DiTStage
    ref, model, graph_inputs = _eager_and_compiled_copy()
    stage = DiTStage(model, range(len(model.blocks)), first=True, last=True, grid=model.default_grid())
    x, t, _, _, _ = _batch()
    ctx, mask = _padded_text(5)
    with torch.no_grad():
        torch.testing.assert_close(stage(x, t, ctx, mask), ref(x, t, ctx, mask), rtol=1e-5, atol=1e-6)
    hidden = ref.cfg.hidden
    assert graph_inputs and all((2, 16, hidden) in g and (2, 40, hidden) not in g for g in graph_inputs), graph_inputs
    torch._dynamo.reset()


# Inductor fuses and reorders reductions (LayerNorm, softmax): results differ from eager in the
# last bits. Gradients here span ~2e-4..0.3 in magnitude; measured max |diff| was 3e-8.
COMPILE_RTOL, COMPILE_ATOL = 1e-5, 1e-6


# Inductor's C++ code generation takes 30-100 s per distinct block graph on a cold cache: it runs
# for the plain blocks (and in the grid's fsdp-compile and pp2-compile runs). With AC, what can go
# wrong is dynamo tracing the checkpointed region and AOTAutograd partitioning it, which
# aot_eager exercises in the same way without the code generation.
@pytest.mark.slow
@pytest.mark.parametrize("mode,backend", [("none", "inductor"), ("full", "aot_eager"), ("offload", "aot_eager")])
def test_compiled_blocks_match_eager(mode, backend):
    ref_model = _model()
    model = copy.deepcopy(ref_model)
    batch = _batch()
    ref = _loss_and_grads(ref_model, batch)
    apply_activation_checkpointing(model.blocks, mode)
    compile_blocks(model.blocks, backend=backend)
    for _ in range(2):  # the second call runs the cached graph
        _assert_same(ref, _loss_and_grads(model, batch), rtol=COMPILE_RTOL, atol=COMPILE_ATOL)
    assert list(model.state_dict()) == list(ref_model.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref_model.named_parameters()]
    if mode == "offload":
        # The offload hooks stay eager around the compiled block and still see what the compiled
        # graph saves (on CUDA they would move it): nearly all of the plain model's saved bytes.
        with SavedTensorMeter(model) as meter:
            model(*batch[:4]).sum()
        assert meter.device_bytes > 0.5 * _saved_bytes("none").device_bytes
