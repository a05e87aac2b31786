"""The per-caption cache of a frozen text tower's features (common/diffusion/text_conditioned.py)."""
import torch

from common.diffusion.text_conditioned import CachedTextFeatures
from common.nn.text_encoder import TextEncoder, TextEncoderConfig


def _tower():
    torch.manual_seed(0)
    return TextEncoder(TextEncoderConfig(width=32, layers=1, heads=2, context_length=16, layer_scale=1e-3))


def test_cached_features_equal_the_towers_and_repeats_skip_it():
    tower = _tower()
    cache = CachedTextFeatures(tower)
    first = ["a red circle", "a blue square", "", "a red circle"]
    ctx, mask = cache(first)
    ref_ctx, ref_mask = tower(first)
    torch.testing.assert_close(ctx, ref_ctx, rtol=1e-6, atol=1e-6)
    assert torch.equal(mask, ref_mask)
    assert (cache.misses, cache.hits) == (3, 1)  # the repeated caption in one batch is encoded once
    second = ["", "a green cross", "a blue square"]
    ctx2, mask2 = cache(second)
    torch.testing.assert_close(ctx2, tower(second)[0], rtol=1e-6, atol=1e-6)
    assert torch.equal(mask2, tower(second)[1])
    assert (cache.misses, cache.hits) == (4, 3)


def test_cache_stays_under_its_byte_budget_and_keeps_the_batch_in_use():
    tower = _tower()
    row_bytes = 16 * 32 * 4 + 16  # features (L, width) fp32 + bool mask
    cache = CachedTextFeatures(tower, max_bytes=3 * row_bytes)
    for i in range(10):
        ctx, _ = cache([f"caption {i}", f"caption {i + 100}"])
        torch.testing.assert_close(ctx, tower([f"caption {i}", f"caption {i + 100}"])[0], rtol=1e-6, atol=1e-6)
        assert cache.bytes <= 3 * row_bytes
    assert list(cache.rows) == ["caption 9", "caption 109"] or len(cache.rows) == 3
    assert "caption 0" not in cache.rows


def test_a_trainable_tower_is_called_every_time():
    tower = _tower()
    tower.tower.token_embedding.weight.requires_grad_(True)
    cache = CachedTextFeatures(tower)
    cache(["a red circle"])
    with torch.no_grad():
        tower.tower.token_embedding.weight.add_(1.0)
    ctx, _ = cache(["a red circle"])
    torch.testing.assert_close(ctx, tower(["a red circle"])[0])
    assert cache.rows == {} and cache.hits == 0


def test_features_do_not_depend_on_the_batch_that_first_met_a_caption():
    # A resumed run starts with an empty cache and meets its captions in other batches; its
    # features must be bitwise those of the uninterrupted run. 20 new captions at once span two
    # tower calls of 16; met later one or a few at a time, in another order, each sits at another
    # row of another call with other companions.
    tower = _tower()
    captions = ["a red circle", "a blue square in the top left corner", "", "a green cross"] + \
        [f"a small shape number {i} at the bottom" for i in range(16)]
    a, b = CachedTextFeatures(tower), CachedTextFeatures(tower)
    a(captions)
    b(["a green cross"])
    b(["", "a red circle"])
    b(captions[::-1][:7])
    b(captions)
    assert set(a.rows) == set(b.rows) == set(captions)
    for caption in captions:
        assert torch.equal(a.rows[caption][0], b.rows[caption][0]), caption
        assert torch.equal(a.rows[caption][1], b.rows[caption][1]), caption


class _CountingTower(torch.nn.Module):
    def __init__(self, tower):
        super().__init__()
        self.tower, self.batch_sizes = tower, []

    def forward(self, texts):
        self.batch_sizes.append(len(texts))
        return self.tower(texts)


def test_new_captions_are_encoded_in_calls_of_a_fixed_batch_and_held_without_their_padding():
    """Rarely repeating captions (most real data) cost ceil(new / encode_batch) tower calls a
    step, each of exactly encode_batch captions, not one call per caption."""
    tower = _CountingTower(_tower())
    cache = CachedTextFeatures(tower, encode_batch=8)
    batch = [f"caption {i}" for i in range(19)]
    ctx, mask = cache(batch)
    assert tower.batch_sizes == [8, 8, 8]
    ref_ctx, ref_mask = tower.tower(batch)
    torch.testing.assert_close(ctx, ref_ctx, rtol=1e-6, atol=1e-6)
    assert torch.equal(mask, ref_mask)
    cache(batch[:5] + ["caption 19"])
    assert tower.batch_sizes == [8, 8, 8, 8]
    row_bytes = 16 * 32 * 4 + 16
    assert cache.bytes == 20 * row_bytes
    # each cached row owns its storage: the byte budget counts what the cache keeps alive
    assert sum(r.untyped_storage().nbytes() + m.untyped_storage().nbytes() for r, m in cache.rows.values()) \
        == cache.bytes


def test_open_clip_tower_imports_without_its_optional_backends():
    """The frozen tower imports open_clip without transformers / timm (seconds of every process's
    start-up), builds the same tower as a full open_clip import, and leaves both importable."""
    import subprocess
    import sys
    code = """
import sys, torch
from common.nn.text_encoder import TextEncoder, TextEncoderConfig
cfg = TextEncoderConfig(width=32, layers=1, heads=2, context_length=16, layer_scale=1e-3)
torch.manual_seed(0)
lean = TextEncoder(cfg)
assert 'transformers' not in sys.modules and 'timm' not in sys.modules, 'optional backends were imported'
import transformers, timm
from transformers import CLIPTextConfig
torch.manual_seed(0)
again = TextEncoder(cfg)
for a, b in zip(lean.state_dict().values(), again.state_dict().values()):
    assert torch.equal(a, b)
tokens, mask = lean(['a red circle', 'a blue square in the top left'])
print(tuple(tokens.shape), int(mask.sum()))
"""
    from tests.conftest import ROOT
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[0].startswith("(2, 16, 32)"), proc.stdout


def test_stored_rows_skip_the_tower_and_other_towers_features_are_refused():
    """Rows with precomputed features (data.precompute) are taken as stored, the others go through
    the tower (cached); features of another tower, or a trainable tower, stop the run in one line."""
    import pytest

    from common.data.shards import DataError
    from common.nn.text_encoder import text_features_id
    tower = _tower()
    captions = ["a red circle", "", "a blue square"]
    ref_ctx, ref_mask = tower(captions)
    own = text_features_id(tower)
    stored = [(ref_ctx[0].half().float(), ref_mask[0], own), None, (ref_ctx[2].half().float(), ref_mask[2], own)]
    cache = CachedTextFeatures(tower)
    ctx, mask = cache(captions, stored)
    assert torch.equal(ctx[0], stored[0][0]) and torch.equal(ctx[2], stored[2][0])
    torch.testing.assert_close(ctx[1], ref_ctx[1], rtol=1e-6, atol=1e-6)  # the empty caption: the tower's
    assert torch.equal(mask, ref_mask)
    assert (cache.misses, cache.stored) == (1, 2)
    assert not torch.equal(ctx[0], ref_ctx[0])  # float16-rounded: the stored row was used, not recomputed
    other = TextEncoder(TextEncoderConfig(width=32, layers=1, heads=2, context_length=16, layer_scale=1e-3))
    assert text_features_id(other) != own  # another seed's random tower
    with pytest.raises(DataError, match="another text tower"):
        CachedTextFeatures(other)(captions, stored)
    tower.tower.token_embedding.weight.requires_grad_(True)
    with pytest.raises(DataError, match="data.text_features=false"):
        CachedTextFeatures(tower)(captions, stored)
