"""SmolLM2-135M-Instruct from its GGUF file: eqjax vs transformers' GGUF loader (float32, CPU)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.slow, pytest.mark.reference]

T = 256  # tokens of the evaluation text
LOGIT_TOL = 1e-3  # max |eqjax - transformers| over all T x 49152 logits


@pytest.fixture(scope="module")
def loaded() -> tuple:
    from eqjax.io.gguf import default_model_path, load_gguf

    path = default_model_path()
    cfg, params, tok = load_gguf(path)
    # transformers' own GGUF conversion (config, Q/K un-permutation, dequantization). Done by hand
    # because from_pretrained(..., gguf_file=...) insists on `accelerate`, which is not installed here.
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_cfg = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        ref = transformers.AutoModelForCausalLM.from_config(
            hf_cfg, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        sd = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=ref)["tensors"]
    result = ref.load_state_dict({k: torch.as_tensor(v, dtype=torch.float32) for k, v in sd.items()}, strict=False)
    assert result.missing_keys == ["lm_head.weight"] and not result.unexpected_keys
    ref.tie_weights()
    assert ref.lm_head.weight.data_ptr() == ref.model.embed_tokens.weight.data_ptr()
    return cfg, params, tok, ref


def test_weights_match_transformers(loaded: tuple) -> None:
    """Q/K un-permutation, transposes and the tied embedding agree with transformers' own conversion."""
    cfg, params, _, ref = loaded
    sd = ref.state_dict()
    np.testing.assert_array_equal(params["embed"]["embedding"], sd["model.embed_tokens.weight"].numpy())
    for i in (0, 17, 29):
        lay, pre = params[f"layers_{i}"], f"model.layers.{i}."
        for ours, theirs in [
            (lay["attn"]["q_proj"]["kernel"], "self_attn.q_proj.weight"),
            (lay["attn"]["k_proj"]["kernel"], "self_attn.k_proj.weight"),
            (lay["attn"]["v_proj"]["kernel"], "self_attn.v_proj.weight"),
            (lay["attn"]["o_proj"]["kernel"], "self_attn.o_proj.weight"),
            (lay["mlp"]["gate_proj"]["kernel"], "mlp.gate_proj.weight"),
            (lay["mlp"]["down_proj"]["kernel"], "mlp.down_proj.weight"),
        ]:
            np.testing.assert_array_equal(np.asarray(ours), sd[pre + theirs].numpy().T, err_msg=theirs)
        np.testing.assert_array_equal(lay["mlp_norm"]["scale"], sd[pre + "post_attention_layernorm.weight"].numpy())
    hf = ref.config
    assert (hf.num_attention_heads, hf.num_key_value_heads, hf.hidden_size) == (cfg.n_heads, cfg.n_kv_heads, cfg.hidden)
    assert hf.tie_word_embeddings and cfg.tie_word_embeddings


def test_logits_match_transformers(loaded: tuple) -> None:
    from eqjax.data import join_documents, split_wikipedia
    from eqjax.models import Model

    cfg, params, tok, ref = loaded
    ids = np.asarray(tok.encode(join_documents(split_wikipedia()[1])[:4000])[:T], np.int32)[None]
    assert ids.shape == (1, T)
    with jax.default_matmul_precision("highest"):
        ours, _ = jax.jit(Model(cfg).apply)(params, jnp.asarray(ids))
    ours = np.asarray(ours)
    with torch.no_grad():
        theirs = ref(torch.from_numpy(ids.astype(np.int64))).logits.numpy()
    err = np.abs(ours - theirs).max()
    print(f"max |logit diff| over {T} tokens: {err:.2e} (logit scale {np.abs(theirs).max():.1f})")
    assert err < LOGIT_TOL
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()
    # per-token negative log-likelihood agrees too
    lp = jax.nn.log_softmax(ours[0, :-1], -1)[np.arange(T - 1), ids[0, 1:]]
    lt = torch.log_softmax(torch.from_numpy(theirs[0, :-1]), -1)[torch.arange(T - 1), torch.from_numpy(ids[0, 1:].astype(np.int64))]
    np.testing.assert_allclose(np.asarray(lp), lt.numpy(), atol=1e-4)
