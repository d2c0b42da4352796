"""Llama 3.1 / 3.2 RoPE scaling in GGUF files: the ``rope_freqs.weight`` factors eqjax writes and reads back.

Oracles: transformers' own ``llama3`` RoPE initialisation (``ROPE_INIT_FUNCTIONS``) for the factors, eqjax's
model (``rope_inv_freq``) for the scaling recovered from them, and a float model written to GGUF and loaded
back for the end-to-end case. Tolerances: the factors are float32, recomputed from float64, so 64 float32 ulps.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eqjax.io.gguf import (
    ROPE_FREQS,
    GGUFError,
    load_gguf,
    rope_freq_factors,
    scaling_from_factors,
)
from eqjax.io.gguf_write import export_gguf
from eqjax.models import LlamaConfig, Model
from eqjax.models.config import RopeScaling
from eqjax.models.llama import rope_inv_freq

TOL = 64 * float(np.finfo(np.float32).eps)


def _cfg(head_dim: int = 64, theta: float = 500000.0, **scaling: float) -> LlamaConfig:
    rs = None if not scaling else RopeScaling(type="llama3", **scaling)
    return LlamaConfig(vocab=64, hidden=2 * head_dim, intermediate=32, n_layers=1, n_heads=2, n_kv_heads=1,
                       head_dim=head_dim, rope_theta=theta, rope_scaling=rs, max_position_embeddings=131072)


LLAMA_32 = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
LLAMA_31 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


@pytest.mark.parametrize("head_dim, scaling", [(64, LLAMA_32), (128, LLAMA_31)])
def test_factors_are_transformers_llama3_frequencies(head_dim, scaling):
    """base frequency / factor is transformers' llama3 inverse frequency (Llama 3.2-1B's and 3.1-8B's configs)."""
    from transformers import LlamaConfig as HFConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = HFConfig(hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim, rope_theta=500000.0,
                  max_position_embeddings=131072, rope_scaling={"rope_type": "llama3", **scaling})
    inv, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    cfg = _cfg(head_dim, **scaling)
    f = rope_freq_factors(cfg)
    base = rope_inv_freq(dataclasses.replace(cfg, rope_scaling=None)).astype(np.float64)
    assert f.dtype == np.float32 and f.shape == (head_dim // 2,)
    np.testing.assert_allclose(base / f, inv.double().numpy(), rtol=TOL, atol=0)
    assert f.min() == 1.0 and f.max() == scaling["factor"]  # both plateaus present
    assert scaling_from_factors(dataclasses.replace(cfg, rope_scaling=None), f, source="m").rope_scaling == cfg.rope_scaling


def test_no_factors_without_llama3_scaling():
    assert rope_freq_factors(_cfg()) is None
    assert rope_freq_factors(dataclasses.replace(_cfg(), rope_scaling=RopeScaling(type="linear", factor=2.0))) is None


@settings(max_examples=60, deadline=None)
@given(factor=st.floats(2.0, 64.0), low=st.floats(0.5, 2.0), width=st.floats(1.0, 8.0),
       old=st.integers(1024, 16384), theta=st.sampled_from([1e4, 5e5, 1e6]), head_dim=st.sampled_from([64, 128]))
def test_scaling_is_recovered_from_its_factors(factor, low, width, old, theta, head_dim):
    """The scaling read from the factors gives the model the same RoPE frequencies (64 float32 ulps), and with the
    same pre-scaling context the same parameters (to their float32 rounding); any other context gives the same
    frequencies. Llama 3's own round parameters come back exactly (the parametrized cases above and below)."""
    cfg = _cfg(head_dim, theta, factor=factor, low_freq_factor=low, high_freq_factor=low + width,
               original_max_position_embeddings=old)
    f = rope_freq_factors(cfg)
    mid = int(np.sum((f > 1) & (f < np.float32(factor))))
    if mid < 2:  # the blend is seen at fewer than two frequencies: the band edges cannot be told
        with pytest.raises(GGUFError, match=ROPE_FREQS):
            scaling_from_factors(cfg, f, source="m.gguf", old_context=old)
        return
    for ctx in (old, 8192):
        back = scaling_from_factors(dataclasses.replace(cfg, rope_scaling=None), f, source="m.gguf", old_context=ctx)
        np.testing.assert_allclose(rope_inv_freq(back), rope_inv_freq(cfg), rtol=TOL, atol=0)
    back = scaling_from_factors(cfg, f, source="m.gguf", old_context=old).rope_scaling
    assert back.factor == pytest.approx(factor, rel=TOL)
    # the band edges come from a line fitted through float32 factors: relative error of a few float32 ulps over
    # the slope's conditioning, well inside 1e-4 for these ranges
    assert back.low_freq_factor == pytest.approx(low, rel=1e-4) and back.high_freq_factor == pytest.approx(low + width,
                                                                                                         rel=1e-4)


def test_plain_and_linear_factors():
    """All ones is no scaling; one factor everywhere is linear scaling."""
    cfg = _cfg(16, 1e4)
    assert scaling_from_factors(cfg, np.ones(8, np.float32), source="m").rope_scaling is None
    assert scaling_from_factors(cfg, np.full(8, 4.0, np.float32), source="m").rope_scaling == RopeScaling(
        type="linear", factor=4.0)


@pytest.mark.parametrize("factors, match", [
    (np.linspace(1.0, 8.0, 32, dtype=np.float32)[::-1], "not Llama 3's scaling"),  # falls where llama3's rises
    (np.r_[np.ones(10), np.linspace(1.5, 7.5, 12) ** 1.7, np.full(10, 8.0)].astype(np.float32), "not Llama 3's"),
    (np.ones(31, np.float32), r"expected 32 finite positive factors"),
    (np.r_[np.ones(31), np.nan].astype(np.float32), r"expected 32 finite positive factors"),
    (np.r_[np.ones(31), 0.0].astype(np.float32), r"expected 32 finite positive factors"),
])
def test_other_factors_are_refused_naming_the_tensor(factors, match):
    with pytest.raises(GGUFError, match=rf"m\.gguf: tensor 'rope_freqs\.weight'.*{match}"):
        scaling_from_factors(_cfg(), factors, source="m.gguf")


def _hf_dir(tmp_path: Path, scaling: dict) -> Path:
    """A tiny float Llama with ``scaling`` as an HF directory (the robustness fixtures' writer) with a byte-level
    BPE tokenizer of 260 tokens (GGUF needs merges)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    from tests.robustness.robustness_fixtures import write_hf_model

    d = write_hf_model(tmp_path / "hf", vocab=260, hidden=64, n_heads=2, n_kv_heads=1, rope_theta=1e4,
                       max_position_embeddings=1024, rope_scaling={"rope_type": "llama3", **scaling})
    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n")]
    vocab |= {a + b: 256 + i for i, (a, b) in enumerate(merges)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.save(str(d / "tokenizer.json"))
    return d


def test_a_llama3_model_round_trips_through_gguf(tmp_path):
    """A float llama3-scaled model written to GGUF (its factors as ``rope_freqs.weight``, first, F32, no scaling keys)
    loads back with the same RoPE frequencies and weights, so the same logits; read as unscaled RoPE the logits
    differ by far more (the factors matter at these positions)."""
    from eqjax.io.hf import load_hf_checkpoint

    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=16.0, original_max_position_embeddings=256)
    d = _hf_dir(tmp_path, scaling)
    model, params = load_hf_checkpoint(d)[:2]
    info = export_gguf(params, tmp_path / "m.gguf", source=d)
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    assert reader.tensors[0].name == ROPE_FREQS and reader.tensors[0].tensor_type.name == "F32"
    assert not any(k.startswith("llama.rope.scaling") for k in reader.fields)
    np.testing.assert_array_equal(np.asarray(reader.tensors[0].data), rope_freq_factors(model.config))
    assert info["tensor_types"]["F32"] == len(reader.tensors)
    cfg, back, _ = load_gguf(tmp_path / "m.gguf")
    assert cfg.rope_scaling.factor == 8.0
    np.testing.assert_allclose(rope_inv_freq(cfg), rope_inv_freq(model.config), rtol=TOL, atol=0)
    ids = jax.numpy.asarray([list(range(3, 259, 2))])  # 128 positions
    ref = np.asarray(model.apply(params, ids)[0])
    got = np.asarray(Model(cfg).apply(back, ids)[0])
    plain = np.asarray(Model(dataclasses.replace(cfg, rope_scaling=None)).apply(back, ids)[0])
    scale = np.abs(ref).max()
    assert np.abs(got - ref).max() <= 1e-4 * scale  # float32 sums over a 64-wide model in another order
    assert np.abs(plain - ref).max() > 100 * np.abs(got - ref).max()


def test_a_file_with_garbled_factors_is_refused(tmp_path):
    """load_gguf of a file whose rope_freqs.weight is not a llama3 scaling names the file and the tensor."""
    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=16.0, original_max_position_embeddings=256)
    d = _hf_dir(tmp_path, scaling)
    from eqjax.io.hf import load_hf_checkpoint

    _, params = load_hf_checkpoint(d)[:2]
    export_gguf(params, tmp_path / "m.gguf", source=d)
    raw = bytearray((tmp_path / "m.gguf").read_bytes())
    t = gguf.GGUFReader(tmp_path / "m.gguf").tensors[0]
    off = int(t.data_offset)
    raw[off:off + 4 * 8] = np.linspace(9.0, 2.0, 8, dtype=np.float32).tobytes()
    (tmp_path / "bad.gguf").write_bytes(bytes(raw))
    with pytest.raises(GGUFError, match=r"bad\.gguf: tensor 'rope_freqs\.weight'"):
        load_gguf(tmp_path / "bad.gguf")
