"""Measured sensitivity (the search's kl proxy): the measured KL against a float64 oracle, invariance under a
rescaling that leaves the function unchanged."""

import numpy as np
import pytest
from test_search import CANDS, _close_to_kl64, tiny  # noqa: F401 - the module fixture

from eqjax.search.allocate import search
from eqjax.search.layers import collect_hessians


def test_kl_proxy_is_the_measured_kl_carried_by_the_hessian_error(tiny):
    from eqjax.core.numerics import fake_quantize
    from eqjax.core.pytree import get_path, set_path
    from eqjax.search.layers import layer_table
    from eqjax.search.sensitivity import calibrate_kl

    model, params, cal, H = tiny
    layers = calibrate_kl(model, params, cal, layer_table(params, H, CANDS), ref_bits=3)
    for L in layers[:4]:
        j = next(i for i, c in enumerate(L.options) if c.bits == 3)
        w = get_path(params, L.path)
        qp = set_path(params, L.path, fake_quantize(w, L.options[j].spec(L.shape[0])))
        _close_to_kl64(L.errors["kl"][j], model, params, qp, cal)
        ratio = np.asarray(L.errors["kl"]) / np.asarray(L.errors["hessian"])
        np.testing.assert_allclose(ratio, ratio[j], rtol=1e-6)


def test_kl_proxy_at_two_widths_carries_each_option_from_the_nearest(tiny):
    """``ref_bits=(2, 3)``: the 2-bit and 3-bit references are each the measured KL (float64 oracle); 2-bit
    options carry the 2-bit factor, 3- to 8-bit ones the 3-bit factor (the same as with ``ref_bits=3``)."""
    from eqjax.core.numerics import fake_quantize
    from eqjax.core.pytree import get_path, set_path
    from eqjax.search.layers import layer_table
    from eqjax.search.sensitivity import calibrate_kl

    model, params, cal, H = tiny
    table = layer_table(params, H, CANDS)
    one = calibrate_kl(model, params, cal, table[:3], ref_bits=3)
    two = calibrate_kl(model, params, cal, table[:3], ref_bits=(2, 3))
    for L1, L2 in zip(one, two):
        bits = np.array([c.bits for c in L2.options])
        assert (bits == 2).any() and (bits > 2).any()
        np.testing.assert_allclose(np.asarray(L2.errors["kl"])[bits > 2], np.asarray(L1.errors["kl"])[bits > 2], rtol=1e-6)
        j = min((i for i in range(len(bits)) if bits[i] == 2), key=lambda i: L2.nbytes[i])
        w = get_path(params, L2.path)
        qp = set_path(params, L2.path, fake_quantize(w, L2.options[j].spec(L2.shape[0])))
        _close_to_kl64(L2.errors["kl"][j], model, params, qp, cal)
        ratio = np.asarray(L2.errors["kl"]) / np.asarray(L2.errors["hessian"])
        np.testing.assert_allclose(ratio[bits == 2], ratio[j], rtol=1e-6)
    with pytest.raises(ValueError, match="no 5-bit option"):
        calibrate_kl(model, params, cal, table[:1], ref_bits=(3, 5))
    with pytest.raises(ValueError, match=r"kl_ref_bits \[5\] is not among the candidates' widths"):
        search(model, params, cal, budget_bits=4.0, candidates=CANDS, kl_ref_bits=(3, 5))  # before any work


def test_a_table_beyond_float16s_range_gets_no_f16_option(tiny):
    """A table value past 65504 would become Inf in float16: the f16 option is left out (bf16 stays)."""
    from eqjax.search.sensitivity import KLProbe, embedding_layer

    model, params, cal, _ = tiny
    big = {**params, "embed": {"embedding": params["embed"]["embedding"].at[3, 5].set(1e5)}}
    L = embedding_layer(model, big, KLProbe(model, big, cal[:1]), ("int8", "f16", "bf16"))
    assert [o.kind for o in L.options] == ["float", "int8", "bf16"]
    assert np.isfinite(L.errors["kl"]).all()


def test_kl_proxy_sees_through_a_rescaling_that_fools_the_hessian_error(tiny):
    """v_proj / 16 and o_proj * 16 is the same function (attention is linear in the values): the measured
    sensitivity of v_proj is unchanged, its Hessian error drops 256x. The kl proxy must not move."""
    from eqjax.search.layers import layer_table
    from eqjax.search.sensitivity import calibrate_kl

    model, params, cal, _ = tiny
    attn = params["layers_0"]["attn"]
    scaled = {**params, "layers_0": {**params["layers_0"], "attn": {
        **attn, "v_proj": {"kernel": attn["v_proj"]["kernel"] / 16}, "o_proj": {"kernel": attn["o_proj"]["kernel"] * 16}}}}
    out = []
    for p in (params, scaled):
        h = collect_hessians(model, p, cal)
        out.append({L.path: L for L in calibrate_kl(model, p, cal, layer_table(p, h, CANDS))})
    a, b = (o["layers_0/attn/v_proj/kernel"] for o in out)
    np.testing.assert_allclose(b.errors["hessian"], np.asarray(a.errors["hessian"]) / 256, rtol=1e-3)
    np.testing.assert_allclose(b.errors["kl"], a.errors["kl"], rtol=1e-3, atol=1e-9)


def test_method_errors_are_gptqs_and_carry_the_measured_kl(tiny):
    """With GPTQ applying the mix, each option's error is the Hessian error of GPTQ's result (checked in
    float64 against :func:`gptq_quantize` of that layer), below RTN's in total, and the kl proxy carries the
    measured RTN KL of the reference option by GPTQ's error over RTN's."""
    from eqjax.core.numerics import dequantize
    from eqjax.core.pytree import get_path
    from eqjax.methods.gptq import GPTQ, gptq_quantize
    from eqjax.search.layers import layer_table
    from eqjax.search.sensitivity import calibrate_kl, method_errors

    model, params, cal, H = tiny
    rtn = layer_table(params, H, CANDS)
    step = GPTQ()
    got = method_errors(params, H, rtn, step)
    for L in got[:3]:
        w = np.asarray(get_path(params, L.path), np.float64)
        h = np.asarray(H[L.path], np.float64)
        for j, c in enumerate(L.options):
            spec = c.spec(L.shape[0])
            q = gptq_quantize(w, h, group_size=spec.granularity.group_size if spec.granularity.kind == "group" else None,
                              bits=spec.bits, symmetric=spec.symmetric, scale_dtype=spec.scale_dtype,
                              full_range=spec.full_range)
            d = np.asarray(dequantize(q), np.float64) - w
            assert L.errors["hessian"][j] == pytest.approx(float(np.sum(d * (h @ d))), rel=1e-3)
    assert sum(sum(L.errors["hessian"]) for L in got) < 0.9 * sum(sum(L.errors["hessian"]) for L in rtn)
    kl_rtn = calibrate_kl(model, params, cal, rtn, ref_bits=3)
    kl_gptq = calibrate_kl(model, params, cal, got, ref_bits=3)
    for a, b in zip(kl_rtn[:4], kl_gptq[:4]):
        j = next(i for i, c in enumerate(a.options) if c.bits == 3)
        measured = a.errors["kl"][j]
        np.testing.assert_allclose(b.errors["kl"], measured * np.asarray(b.errors["hessian"]) / a.errors["hessian"][j],
                                   rtol=1e-5, atol=1e-12)
