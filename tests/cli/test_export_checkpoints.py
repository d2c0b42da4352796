"""The exporters take an HF directory as ``--model`` and a saved ``--checkpoint`` (eqjax's Orbax checkpoint or a
compressed-tensors directory), exported as saved: the same bytes as exporting with the recipe directly, never
quantized again. ``search`` takes a float HF directory. Every bad input is one line, exit 2, before any output.

Tiny models only: the robustness fixtures' HF directory (with a chat template and special-token ids added) and a
GGUF whose widths are whole GGUF blocks (tests/io/test_gguf.py's writer)."""

from __future__ import annotations

import json
import pathlib

import gguf
import jax
import numpy as np
import pytest

from eqjax.cli.main import main
from eqjax.io.load import stream_model
from tests.io.test_gguf import hf_weights, write_tiny
from tests.robustness.robustness_fixtures import write_hf_model

DIMS = (64, 96, 4, 2, 16, 1)  # D, F, HQ, HKV, HD, L: every width a multiple of 32 (GGUF blocks)
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def _bpe_tokenizer(path: pathlib.Path) -> None:
    """A byte-level BPE of the 256 byte symbols and four merges (260 tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n")]
    vocab |= {a + b: 256 + i for i, (a, b) in enumerate(merges)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path))


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpts")
    tiny = write_hf_model(d / "tiny", vocab=260)
    _bpe_tokenizer(tiny / "tokenizer.json")
    cfg = json.loads((tiny / "config.json").read_text())
    (tiny / "config.json").write_text(json.dumps({**cfg, "bos_token_id": 1, "eos_token_id": 2}))
    (tiny / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 3]}))
    (tiny / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "model_max_length": 128}))
    write_hf_model(d / "other", hidden=32, intermediate=64)
    g = write_tiny(d / "src.gguf", weights=hf_weights(dims=DIMS), dims=DIMS)
    for argv in (["--model", str(tiny), "--recipe", "w4g128-rtn", "--out", str(d / "ck")],
                 ["--model", str(tiny), "--recipe", "w4g128-rtn", "--format", "compressed-tensors", "--out", str(d / "ct")],
                 ["--model", str(tiny), "--recipe", "kv4", "--out", str(d / "kv")],
                 ["--model", str(tiny), "--recipe", "w3g128-rtn", "--out", str(d / "w3")],
                 ["--model", str(g), "--recipe", "w4g128-rtn-sym", "--out", str(d / "gck")],
                 ["--model", str(g), "--recipe", "w8a8-naive", "--out", str(d / "gw8a8")]):
        assert main(["quantize", *argv]) == 0
    (d / "file").write_text("x")
    spm = write_hf_model(d / "spm")  # a pre-tokenizer llama.cpp's names are not known for: export-gguf refuses it
    tj = json.loads((spm / "tokenizer.json").read_text())
    (spm / "tokenizer.json").write_text(json.dumps({**tj, "pre_tokenizer": {"type": "Metaspace", "replacement": "_"}}))
    names = ("tiny", "other", "ck", "ct", "kv", "w3", "gck", "gw8a8", "file", "spm")
    return {k: str(d / k) for k in names} | {"gguf": str(g)}


@pytest.fixture(scope="module")
def recipe_pkg(fx, tmp_path_factory):
    """export-onnx of the HF directory with --recipe w4g128-rtn."""
    out = tmp_path_factory.mktemp("pkg") / "p"
    assert main(["export-onnx", "--model", fx["tiny"], "--recipe", "w4g128-rtn", "--out", str(out)]) == 0
    return out


def _initializers(pkg: pathlib.Path) -> dict[str, np.ndarray]:
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(pkg / "model.onnx"))
    assert any(n.op_type == "MatMulNBits" for n in m.graph.node)
    return {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}


def _check_ok(pkg: pathlib.Path) -> dict:
    man = json.loads((pkg / "eqjax_export.json").read_text())
    assert man["check"]["max_rel_diff"] <= man["check"]["tolerance"] and man["check"]["top1_agreement"] > 0.9
    return man


def test_export_onnx_from_an_hf_directory_copies_its_tokenizer(fx, recipe_pkg):
    """An HF --model: the package's tokenizer.json and tokenizer_config.json are the directory's, its chat template
    is chat_template.jinja, genai_config's ids are config.json's overridden by generation_config.json's, and the
    onnxruntime self-check (the prompt encoded by tokenizer.json) passes."""
    src = pathlib.Path(fx["tiny"])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (recipe_pkg / name).read_bytes() == (src / name).read_bytes()
    assert (recipe_pkg / "chat_template.jinja").read_text() == TEMPLATE
    genai = json.loads((recipe_pkg / "genai_config.json").read_text())["model"]
    assert (genai["bos_token_id"], genai["eos_token_id"], genai["pad_token_id"]) == (1, [2, 3], 2)
    assert _check_ok(recipe_pkg)["recipe"] == "w4g128-rtn"


def test_export_onnx_orbax_checkpoint_is_the_recipe_export(fx, recipe_pkg, tmp_path, capsys, monkeypatch):
    """``export-onnx --checkpoint`` of the checkpoint ``eqjax quantize`` saved: no quantizing, and the package's
    graph and MatMulNBits initializers equal those of exporting with the recipe directly (same params)."""
    import eqjax.cli.export as cli_export

    monkeypatch.setattr(cli_export, "quantize", lambda *a, **k: pytest.fail("quantized again"))
    pkg = tmp_path / "p"
    assert main(["export-onnx", "--model", fx["tiny"], "--checkpoint", fx["ck"], "--out", str(pkg)]) == 0
    assert f"checkpoint {fx['ck']}, recipe w4g128-rtn" in capsys.readouterr().out
    assert _check_ok(pkg)["recipe"] == "w4g128-rtn"
    assert (pkg / "model.onnx").read_bytes() == (recipe_pkg / "model.onnx").read_bytes()
    ours, theirs = _initializers(pkg), _initializers(recipe_pkg)
    assert ours.keys() == theirs.keys() and all(np.array_equal(ours[k], theirs[k]) for k in ours)


def test_export_onnx_compressed_tensors_checkpoint(fx, tmp_path, monkeypatch):
    """A compressed-tensors directory (``quantize --format compressed-tensors``) is its own model without --model
    (tokenizer from its copied files) and loads into --model's shapes with it; both pass the self-check."""
    import eqjax.cli.export as cli_export

    monkeypatch.setattr(cli_export, "quantize", lambda *a, **k: pytest.fail("quantized again"))
    assert main(["export-onnx", "--checkpoint", fx["ct"], "--out", str(tmp_path / "own")]) == 0
    assert _check_ok(tmp_path / "own")["recipe"] == "compressed-tensors"
    assert (tmp_path / "own" / "tokenizer.json").read_bytes() == (pathlib.Path(fx["ct"]) / "tokenizer.json").read_bytes()
    assert main(["export-onnx", "--model", fx["tiny"], "--checkpoint", fx["ct"], "--out", str(tmp_path / "m"),
                 "--no-check"]) == 0
    assert (tmp_path / "m" / "chat_template.jinja").read_text() == TEMPLATE


def test_check_reference_read_block_by_block_equals_the_loaded_models(fx):
    """The self-check's eqjax logits from the checkpoint read one block at a time (what export-onnx does for a
    checkpoint that is its own model, after dropping the loaded params) equal those of the loaded params, bit for
    bit, with the one-ulp spread of the int8-activation tolerance too."""
    from eqjax.export.runtime import eqjax_reference
    from eqjax.io.load import load_model, stream_model

    model, params, _ = load_model(fx["ct"])
    streamed = stream_model(fx["ct"])[1]
    for level in (0, 4):
        a, b = (eqjax_reference(model, p, accuracy_level=level) for p in (params, streamed))
        np.testing.assert_array_equal(a["logits"], b["logits"])
        assert (a["tolerance"], a["spread"]) == (b["tolerance"], b["spread"])


def test_export_gguf_orbax_checkpoint_is_the_recipe_export(fx, tmp_path, capsys, monkeypatch):
    """``export-gguf --checkpoint`` of a checkpoint made for the GGUF --model: the tensors (Q4_0 blocks) equal
    those of ``export-gguf --recipe`` with the same recipe, with no quantizing on the checkpoint's way."""
    import eqjax.cli.export as cli_export

    assert main(["export-gguf", "--model", fx["gguf"], "--recipe", "w4g128-rtn-sym", "--out", str(tmp_path / "r.gguf")]) == 0
    monkeypatch.setattr(cli_export, "quantize", lambda *a, **k: pytest.fail("quantized again"))
    assert main(["export-gguf", "--model", fx["gguf"], "--checkpoint", fx["gck"], "--out", str(tmp_path / "c.gguf")]) == 0
    assert "recipe w4g128-rtn-sym, file type Q4_0" in capsys.readouterr().out
    a, b = ({t.name: (t.tensor_type.name, np.asarray(t.data)) for t in gguf.GGUFReader(tmp_path / f).tensors}
            for f in ("r.gguf", "c.gguf"))
    assert a.keys() == b.keys() and a["blk.0.ffn_down.weight"][0] == "Q4_0"
    assert all(a[k][0] == b[k][0] and np.array_equal(a[k][1], b[k][1]) for k in a)


@pytest.mark.filterwarnings("ignore:No artists with labels")  # the plot of a curve without evaluated points
def _gguf(path: pathlib.Path) -> tuple[dict, dict]:
    r = gguf.GGUFReader(path)
    return ({k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")},
            {t.name: (t.tensor_type.name, np.asarray(t.data)) for t in r.tensors})


def test_export_gguf_from_an_hf_directory(fx, tmp_path, capsys):
    """``export-gguf --model <HF directory>``: the file carries the directory's hyper-parameters and its tokenizer
    (tokens in id order, the ids tokenizer_config / config.json name, the chat template), and exporting a
    checkpoint made for the directory (eqjax's Orbax one with ``--model``, the compressed-tensors one as its own
    model) writes the recipe's codes, quantized once (the Orbax checkpoint: the same bytes; the compressed-tensors
    one stores its scales and float tensors in bfloat16)."""
    assert main(["export-gguf", "--model", fx["tiny"], "--recipe", "w4g128-rtn", "--out", str(tmp_path / "r.gguf")]) == 0
    meta, tensors = _gguf(tmp_path / "r.gguf")
    cfg = json.loads((pathlib.Path(fx["tiny"]) / "config.json").read_text())
    vocab = json.loads((pathlib.Path(fx["tiny"]) / "tokenizer.json").read_text())["model"]["vocab"]
    assert meta["general.architecture"] == "llama" and meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.pre"] == "gpt-2"
    assert meta["tokenizer.ggml.tokens"] == sorted(vocab, key=vocab.get)
    assert meta["tokenizer.ggml.merges"] == ["Ġ t", "h e", "Ġt he", "i n"]
    assert (meta["llama.embedding_length"], meta["llama.block_count"], meta["llama.attention.head_count_kv"]) == (
        cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_key_value_heads"])
    assert (meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"]) == (1, 2)
    assert meta["tokenizer.chat_template"] == TEMPLATE
    assert {t for t, _ in tensors.values()} == {"Q4_1", "F32"}
    for argv, name in ((["--model", fx["tiny"], "--checkpoint", fx["ck"]], "ck.gguf"), (["--checkpoint", fx["ct"]], "ct.gguf")):
        assert main(["export-gguf", *argv, "--out", str(tmp_path / name)]) == 0
        got = _gguf(tmp_path / name)[1]
        assert got.keys() == tensors.keys()
        for k, (t, data) in tensors.items():
            assert got[k][0] == t, k
            if name == "ck.gguf":
                assert np.array_equal(got[k][1], data), k
            elif t == "F32":  # the directory stores float tensors in bfloat16 (unit roundoff 2^-8)
                assert np.all(np.abs(got[k][1] - data) <= 2.0**-8 * np.abs(data)), k
            else:  # Q4_1 blocks [d, m: float16][16 bytes of codes]: the same codes; d and m from bfloat16 scales
                a, b = (x.reshape(x.shape[0], -1, 20) for x in (got[k][1], data))
                assert np.array_equal(a[..., 4:], b[..., 4:]), k
                dm_a, dm_b = (x[..., :4].copy().view(np.float16).astype(np.float64) for x in (a, b))
                assert np.all(np.abs(dm_a - dm_b) <= (2.0**-8 + 2 * 2.0**-11) * np.abs(dm_b)), k


def test_export_gguf_refuses_a_model_larger_than_memory(fx, tmp_path, capsys, monkeypatch):
    """A float HF directory is loaded whole to be quantized: with the available memory faked one byte below its
    float32 weights, it is refused in one line before anything is loaded or written. A compressed-tensors
    directory as its own model is read a block at a time instead: the same bytes as with every tensor in memory."""
    import eqjax.cli.sources as sources
    from eqjax.io.compressed_tensors import load_compressed_tensors
    from eqjax.io.gguf_write import export_gguf

    need = 4 * sum(int(np.prod(s)) for s in jax.tree.leaves(
        stream_model(fx["tiny"])[0].param_shapes(), is_leaf=lambda x: isinstance(x, tuple)))
    monkeypatch.setattr(sources, "_available_bytes", lambda: need - 1)
    out = tmp_path / "o.gguf"
    assert main(["export-gguf", "--model", fx["tiny"], "--recipe", "w8", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model too large for export-gguf (--model" in err[0], err
    assert not out.exists()
    import eqjax.cli.export as cli_export

    monkeypatch.setattr(cli_export, "load_source", lambda *a, **k: pytest.fail("loaded whole"))
    assert main(["export-gguf", "--checkpoint", fx["ct"], "--out", str(out)]) == 0
    assert "recipe compressed-tensors" in capsys.readouterr().out
    whole = export_gguf(load_compressed_tensors(fx["ct"])[1], tmp_path / "w.gguf", source=fx["ct"])
    assert out.read_bytes() == (tmp_path / "w.gguf").read_bytes()
    assert whole["check"]["Q4_1"] > 0  # d and m rounded to float16 from the directory's scales


def test_search_takes_a_float_hf_directory(fx, tmp_path):
    out = tmp_path / "s"
    assert main(["search", "--model", fx["tiny"], "--budget-bits", "4", "--out", str(out), "--proxy", "weight",
                 "--embedding", "none", "--calib-windows", "2", "--calib-len", "32", "--eval-windows", "0",
                 "--pareto-bits", "4", "--baselines", ""]) == 0
    assert json.loads((out / "rules.json").read_text())


@pytest.mark.parametrize("argv, match", [
    (["export-onnx", "--model", "{tiny}", "--checkpoint", "{tiny}/nope"], r"checkpoint not found \(--checkpoint"),
    (["export-onnx", "--model", "{tiny}", "--checkpoint", "{tiny}"], r"not a checkpoint .*found a float HF directory"),
    (["export-onnx", "--model", "{tiny}", "--checkpoint", "{file}"], r"not a checkpoint .*found a file"),
    (["export-onnx", "--model", "{tiny}", "--checkpoint", "{kv}"], r"KV cache .*'kv4'.*float KV cache"),
    (["export-onnx", "--model", "{other}", "--checkpoint", "{ck}"], r"checkpoint made for another model"),
    (["export-onnx", "--model", "{other}", "--checkpoint", "{ct}"], r"checkpoint made for another model"),
    (["export-onnx", "--model", "{tiny}", "--checkpoint", "{w3}"], r"--checkpoint .*: layers_0/.*3-bit weights"),
    (["export-onnx", "--model", "{tiny}", "--checkpoint", "{ck}", "--embedding", "int8"], r"--embedding with a checkpoint"),
    (["export-onnx", "--model", "{ct}", "--recipe", "w8"], r"quantized model \(--model .*--checkpoint"),
    (["export-onnx", "--model", "{file}", "--recipe", "w8"], r"unsupported model \(--model"),
    (["export-gguf", "--model", "{gguf}", "--checkpoint", "{kv}"], r"KV cache .*weights only"),
    (["export-gguf", "--model", "{gguf}", "--checkpoint", "{ck}"], r"checkpoint made for another model"),
    (["export-gguf", "--model", "{gguf}", "--checkpoint", "{gw8a8}"],
     r"GGUF file cannot hold \(--checkpoint .*layers_0/.*ActQuantKernel"),
    (["export-gguf", "--model", "{file}", "--recipe", "w8"], r"unsupported model \(--model"),
    (["export-gguf", "--model", "{spm}", "--recipe", "w8"], r"tokenizer\.json: pre_tokenizer .* not one eqjax can name"),
    (["search", "--model", "{ct}", "--budget-bits", "4"], r"quantized model \(--model .*float weights for search"),
])
def test_bad_inputs_are_one_line_before_any_output(argv, match, fx, tmp_path, capsys):
    import re

    out = tmp_path / ("o.gguf" if argv[0] == "export-gguf" else "o")
    assert main([*(a.format(**fx) for a in argv), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("eqjax: error:") and re.search(match, err[0]), err
    assert not out.exists() or argv[0] == "search"


@pytest.mark.parametrize("argv", [["export-onnx", "--recipe", "w8", "--checkpoint", "c", "--out", "o"],
                                  ["export-gguf", "--recipe", "w8", "--checkpoint", "c", "--out", "o.gguf"],
                                  ["export-gguf", "--out", "o.gguf"]])
def test_checkpoint_and_recipe_are_one_or_the_other(argv, capsys):
    """--checkpoint with --recipe is a usage error; export-gguf needs one of them, export-onnx defaults to --recipe fp."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and ("not allowed with" in err or "one of the arguments" in err)
