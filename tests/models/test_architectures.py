"""Gemma, Phi-3 and gelu MLPs beyond logit parity (which is in test_parity.py).

* every architecture or feature eqjax does not run is a ConfigError naming the model_type and the
  field, raised from config.json before any weight is read;
* the stored representation: Gemma's effective norm scale ``1 + w``, Phi-3's split projections, and
  a save that gives back the very tensors transformers wrote;
* SmoothQuant finds its norm folds on every new architecture (exact in float), and the
  ``w8a8-smoothquant`` recipe runs through ``eqjax.quantize``;
* ``eqjax eval --model <hf dir>`` on a tiny Gemma and Phi-3, checked against transformers' perplexity.
"""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import eqjax
from eqjax.core.errors import InputError
from eqjax.core.linear import ActQuantKernel
from eqjax.io.hf import CheckpointError, load_hf_checkpoint, save_hf_checkpoint
from eqjax.methods.smoothquant import SmoothQuant
from eqjax.models import ConfigError, LlamaConfig, from_hf_config, to_hf_config
from eqjax.recipes.apply import model_context
from eqjax.recipes.types import Recipe

_BASE = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-5,
)
_LONGROPE = {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}

# (config.json, the message must match): one per refused architecture / feature.
REFUSED = {
    "gemma2": (dict(_BASE, model_type="gemma2", architectures=["Gemma2ForCausalLM"]),
               r"model_type 'gemma2'.*attn_logit_softcapping.*pre/post_feedforward_layernorm"),
    "gemma3_text": (dict(_BASE, model_type="gemma3_text"), r"model_type 'gemma3_text'.*sandwich norms"),
    "falcon": (dict(_BASE, model_type="falcon", architectures=["FalconForCausalLM"]),
               r"unsupported architecture.*model_type 'falcon'.*FalconForCausalLM.*parallel_attn"),
    "mixtral": (dict(_BASE, model_type="mixtral", num_local_experts=8), r"model_type 'mixtral'.*num_local_experts"),
    "unknown": (dict(_BASE, model_type="mamba"), r"model_type 'mamba'.*eqjax supports .*gemma, phi3"),
    "phi3_longrope": (dict(_BASE, model_type="phi3", rope_scaling=_LONGROPE),
                      r"phi3 rope_scaling of type 'longrope' is not supported"),
    "phi3_su": (dict(_BASE, model_type="phi3", rope_scaling=dict(_LONGROPE, type="su")),
                r"phi3 rope_scaling of type 'su'"),
    "phi3_longrope_tf5": (dict(_BASE, model_type="phi3", rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}),
                          r"phi3 rope_parameters of type 'longrope'"),
    "phi3_odd_rotary": (dict(_BASE, model_type="phi3", partial_rotary_factor=0.33),
                        r"phi3 partial_rotary_factor=0.33 gives 5 rotary channels"),
    "llama_partial_rotary": (dict(_BASE, model_type="llama", partial_rotary_factor=0.5),
                             r"llama with partial_rotary_factor=0.5"),
    "llama_relu": (dict(_BASE, model_type="llama", hidden_act="relu"), r"llama hidden_act 'relu' is not supported"),
    "gemma_bad_activation": (dict(_BASE, model_type="gemma", hidden_activation="swish"),
                             r"gemma hidden_activation 'swish'"),
    "gemma_softcapping": (dict(_BASE, model_type="gemma", final_logit_softcapping=30.0),
                          r"gemma with final_logit_softcapping=30.0"),
    "gemma_window": (dict(_BASE, model_type="gemma", sliding_window=64), r"gemma with sliding_window=64"),
    "llama_moe": (dict(_BASE, model_type="llama", num_local_experts=4), r"llama with num_local_experts=4"),
    "qwen2_mlp_bias": (dict(_BASE, model_type="qwen2", mlp_bias=True), r"qwen2 with mlp_bias=True"),
    "gpt2_unscaled": (dict(vocab_size=64, model_type="gpt2", scale_attn_weights=False),
                      r"gpt2 with scale_attn_weights=False"),
    "gpt2_cross": (dict(vocab_size=64, model_type="gpt2", add_cross_attention=True), r"gpt2 with add_cross_attention"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_before_any_weight_is_read(tmp_path, case):
    cfg, pattern = REFUSED[case]
    with pytest.raises(ConfigError, match=pattern) as info:
        from_hf_config(cfg)
    assert isinstance(info.value, InputError)
    # a checkpoint whose weights are garbage still fails on its config.json, naming it
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors at all")
    with pytest.raises(CheckpointError, match="config.json: .*" + pattern):
        load_hf_checkpoint(tmp_path)


def test_gemma_config_defaults_and_activation_precedence():
    c = from_hf_config({k: v for k, v in dict(_BASE, model_type="gemma").items() if k != "head_dim"})
    assert (c.head_dim, c.tie_word_embeddings, c.hidden_act) == (256, True, "gelu_pytorch_tanh")  # GemmaConfig's
    assert c.embed_scale and c.norm_style == "gemma" and c.rms_norm_eps == 1e-5
    assert from_hf_config(dict(_BASE, model_type="gemma", hidden_act="gelu")).hidden_act == "gelu"
    with pytest.warns(UserWarning, match="hidden_activation 'gelu_pytorch_tanh' differs from hidden_act 'gelu'"):
        c = from_hf_config(dict(_BASE, model_type="gemma", hidden_act="gelu", hidden_activation="gelu_pytorch_tanh"))
    assert c.hidden_act == "gelu_pytorch_tanh"
    phi = from_hf_config(dict(_BASE, model_type="phi3", partial_rotary_factor=0.75, sliding_window=7))
    assert (phi.rotary_dim, phi.sliding_window, phi.sliding_layers) == (12, 7, None)
    back = from_hf_config(to_hf_config(phi))
    assert back == phi
    for d in (dict(_BASE, model_type="gemma", tie_word_embeddings=False, attention_bias=True),
              dict(_BASE, model_type="llama", hidden_act="gelu_new"), dict(_BASE, model_type="qwen2", hidden_act="gelu")):
        c = from_hf_config(d)
        assert from_hf_config(to_hf_config(c)) == c, d  # what orbax checkpoints record and rebuild


@pytest.mark.parametrize(
    "fields",
    [
        dict(model_type="gemma", embed_scale=True, norm_style="gemma", hidden_act="gelu_pytorch_tanh"),
        dict(model_type="phi3", rotary_dim=4),
        dict(hidden_act="gelu"),
    ],
    ids=["gemma", "phi3-partial-rope", "exact-gelu"],
)
def test_onnx_export_of_other_architectures_matches_eqjax(fields):
    """The exporter lowers the traced forward, so Gemma's embedding scale and norms, partial RoPE and
    exact / tanh GELU come out as they run in eqjax (onnxruntime logits within float rounding)."""
    import onnx

    from eqjax.export.onnx import build_model, make_session, onnx_logits
    from eqjax.models import Model

    model = Model(LlamaConfig(vocab=32, hidden=16, intermediate=24, n_layers=1, n_heads=2, **fields))
    params = model.init_params(jax.random.key(0), std=0.1)
    toks = np.array([[1, 5, 7, 9, 3, 2]], np.int32)
    m = build_model(model, params)
    onnx.checker.check_model(m)
    np.testing.assert_allclose(onnx_logits(make_session(m), toks), np.asarray(model.apply(params, toks)[0]),
                               rtol=0, atol=2e-5)


def test_orbax_checkpoint_records_the_architecture(tmp_path):
    """A quantized Gemma saved with orbax reloads bit-identically and is refused by a Llama of equal shapes."""
    from eqjax.core.errors import CompatibilityError
    from eqjax.io.orbax import load_quantized, save_quantized
    from eqjax.models import Model

    kw = dict(vocab=64, hidden=32, intermediate=48, n_layers=1, n_heads=2, tie_word_embeddings=True)
    gemma = Model(LlamaConfig(**kw, model_type="gemma", embed_scale=True, norm_style="gemma", hidden_act="gelu"))
    params = gemma.init_params(jax.random.key(1), std=0.1)
    q = eqjax.quantize(params, eqjax.get_recipe("w8"), model=gemma)
    save_quantized(tmp_path / "ck", q, recipe="w8", model=gemma)
    q2, manifest = load_quantized(tmp_path / "ck", model=gemma)
    assert manifest["model_config"]["model_type"] == "gemma" and manifest["model_fingerprint"]
    toks = jnp.arange(10, dtype=jnp.int32).reshape(1, 10)
    np.testing.assert_array_equal(np.asarray(gemma.apply(q, toks)[0]), np.asarray(gemma.apply(q2, toks)[0]))
    with pytest.raises(CompatibilityError, match="config key"):
        load_quantized(tmp_path / "ck", model=Model(LlamaConfig(**kw)))


# ---------------------------------------------------------------------------------------------- torch

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.models.test_parity import TOL, V, _build  # noqa: E402

pytestmark = pytest.mark.reference
NEW = ("gemma_tied", "phi3_partial_rotary_tied", "llama_gelu")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """case -> (HF model, directory it was saved to), built on first use."""
    cache: dict[str, tuple] = {}

    def get(case: str):
        if case not in cache:
            hf = _build(case)
            path = tmp_path_factory.mktemp(case)
            hf.save_pretrained(path, safe_serialization=True)
            cache[case] = (hf, path)
        return cache[case]

    return get


def test_gemma_tree_holds_the_effective_norm_scale(saved, tmp_path):
    hf, path = saved("gemma_tied")
    stored = load_file(str(path / "model.safetensors"))
    model, params = load_hf_checkpoint(path)
    for tree, name in (
        (params["layers_1"]["attn_norm"]["scale"], "model.layers.1.input_layernorm.weight"),
        (params["layers_0"]["mlp_norm"]["scale"], "model.layers.0.post_attention_layernorm.weight"),
        (params["final_norm"]["scale"], "model.norm.weight"),
    ):
        np.testing.assert_array_equal(np.asarray(tree), np.float32(1) + stored[name])
    # and that is what transformers' GemmaRMSNorm multiplies by
    x = torch.randn(3, 64)
    want = hf.model.norm(x).detach().numpy()
    x32 = x.numpy()
    ours = x32 / np.sqrt(np.mean(x32**2, -1, keepdims=True) + model.config.rms_norm_eps) * np.asarray(params["final_norm"]["scale"])
    np.testing.assert_allclose(ours, want, atol=1e-5, rtol=0)


def test_phi3_fused_projections_are_split(saved):
    _, path = saved("phi3_window")
    stored = load_file(str(path / "model.safetensors"))
    model, params = load_hf_checkpoint(path)
    c, a, m = model.config, params["layers_1"]["attn"], params["layers_1"]["mlp"]
    qkv, gu = stored["model.layers.1.self_attn.qkv_proj.weight"], stored["model.layers.1.mlp.gate_up_proj.weight"]
    q, kv, F = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.intermediate
    np.testing.assert_array_equal(np.asarray(a["q_proj"]["kernel"]), qkv[:q].T)
    np.testing.assert_array_equal(np.asarray(a["k_proj"]["kernel"]), qkv[q : q + kv].T)
    np.testing.assert_array_equal(np.asarray(a["v_proj"]["kernel"]), qkv[q + kv :].T)
    np.testing.assert_array_equal(np.asarray(m["gate_proj"]["kernel"]), gu[:F].T)
    np.testing.assert_array_equal(np.asarray(m["up_proj"]["kernel"]), gu[F:].T)
    names = {k.key for path, _ in jax.tree_util.tree_flatten_with_path(params)[0] for k in path}
    assert {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"} <= names and not names & {"qkv_proj", "gate_up_proj"}


@pytest.mark.parametrize("case", ["gemma_tied", "gemma_untied_bias_linear_rope", "phi3_window",
                                  "phi3_partial_rotary_tied"])
def test_save_gives_back_the_tensors_transformers_wrote(saved, tmp_path, case):
    _, path = saved(case)
    model, params = load_hf_checkpoint(path)
    save_hf_checkpoint(tmp_path, model, params)
    want, got = load_file(str(path / "model.safetensors")), load_file(str(tmp_path / "model.safetensors"))
    want.pop("lm_head.weight", None) if model.config.tie_word_embeddings else None
    assert sorted(got) == sorted(want)
    gemma = model.config.norm_style == "gemma"
    for name in want:
        if gemma and name.endswith("norm.weight"):  # what transformers uses, 1 + w, is bit-exact (see eqjax.io.hf)
            np.testing.assert_array_equal(np.float32(1) + got[name], np.float32(1) + want[name], err_msg=name)
        else:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_bfloat16_gemma_keeps_float32_norm_scales(saved, tmp_path):
    hf, _ = saved("gemma_tied")
    hf.to(torch.bfloat16).save_pretrained(tmp_path, safe_serialization=True)
    hf.to(torch.float32)
    _, params = load_hf_checkpoint(tmp_path, dtype=None)
    scale = params["layers_0"]["attn_norm"]["scale"]
    assert scale.dtype == jnp.float32 and params["layers_0"]["attn"]["q_proj"]["kernel"].dtype == jnp.bfloat16
    w = hf.model.layers[0].input_layernorm.weight.detach().to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(np.asarray(scale), 1 + w)  # what GemmaRMSNorm computes: 1 + w.float()


def _windows(n: int = 4, T: int = 16) -> np.ndarray:
    return np.random.default_rng(3).integers(0, V, size=(n, T)).astype(np.int32)


@pytest.mark.parametrize("case", NEW)
def test_smoothquant_folds_into_the_norms(saved, case):
    """The folds come from the traced graph: q/k/v and gate/up each get their norm, and folding is exact."""
    _, path = saved(case)
    model, params = load_hf_checkpoint(path)
    windows = _windows()
    ref = np.asarray(model.apply(params, jnp.asarray(windows))[0])
    smoothed = eqjax.quantize(params, Recipe("s", (SmoothQuant(0.5),)), model=model, calibration=windows)
    np.testing.assert_allclose(np.asarray(model.apply(smoothed, jnp.asarray(windows))[0]), ref, atol=TOL, rtol=1e-4)
    for name in model.layer_names:
        for norm in ("attn_norm", "mlp_norm"):
            assert not np.allclose(smoothed[name][norm]["scale"], params[name][norm]["scale"]), (name, norm)

    ctx = model_context(model, params, windows)
    q = eqjax.quantize(params, eqjax.get_recipe("w8a8-smoothquant"), model=model, calibration=windows, context=ctx)
    not_smoothed = {p for p, what in ctx.report if "not smoothed" in what}
    first_of_group = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    assert not {p for p in not_smoothed if any(f"/{n}/" in p for n in first_of_group)}, not_smoothed
    for name in model.layer_names:
        for part, proj in (("attn", "q_proj"), ("attn", "k_proj"), ("attn", "v_proj"), ("attn", "o_proj"),
                           ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj")):
            assert isinstance(q[name][part][proj]["kernel"], ActQuantKernel), (name, proj)
    out = np.asarray(model.apply(q, jnp.asarray(windows))[0])
    # W8A8 on random weights: close to float (a loose sanity bound; exactness of the folds is checked above)
    assert np.linalg.norm(out - ref) < 0.25 * np.linalg.norm(ref)


# ---------------------------------------------------------------------------------------------- CLI


def _byte_tokenizer(path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path))


@pytest.mark.parametrize("case", ["gemma_tied", "phi3_window"])
def test_cli_eval_on_an_hf_directory(tmp_path, case):
    """``eqjax eval --model <dir>``: perplexity equals transformers' on the same windows; W8A8 runs."""
    from tokenizers import Tokenizer

    from eqjax.cli.main import main

    cls_name, kw = __import__("tests.models.test_parity", fromlist=["CASES"]).CASES[case]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(
        getattr(transformers, cls_name)(**dict(kw, vocab_size=256)), attn_implementation="eager", dtype=torch.float32
    ).eval()
    d = tmp_path / "model"
    hf.save_pretrained(d, safe_serialization=True)
    _byte_tokenizer(d / "tokenizer.json")
    words = np.random.default_rng(0).choice(["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta"], 600)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(words), encoding="utf-8")
    ctx, n = 64, 4
    common = ["--model", str(d), "--text", str(text), "--eval-len", str(ctx), "--eval-tokens", str(ctx * n)]
    out = tmp_path / "fp.json"
    assert main(["eval", *common, "--recipe", "fp", "--json", str(out)]) == 0
    ppl = json.loads(out.read_text())["ppl"]

    ids = Tokenizer.from_file(str(d / "tokenizer.json")).encode(text.read_text(), add_special_tokens=False).ids
    ev = np.asarray(ids[len(ids) // 2 :][: ctx * n], np.int64).reshape(n, ctx)  # eqjax: second half, windows
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.from_numpy(ev)).logits[:, :-1].double(), -1)
        nll = -logp.gather(-1, torch.from_numpy(ev[:, 1:, None])).mean().item()
    assert ppl == pytest.approx(math.exp(nll), rel=1e-4)

    out = tmp_path / "w8a8.json"
    rc = main(["eval", *common, "--recipe", "w8a8-smoothquant", "--calib-windows", "4", "--calib-len", "32",
               "--json", str(out)])
    assert rc == 0 and np.isfinite(json.loads(out.read_text())["ppl"])
