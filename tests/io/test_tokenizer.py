"""Tokenizer from GGUF metadata: a tiny synthetic vocabulary (fast) and SmolLM2's (slow, vs transformers)."""

from __future__ import annotations

import warnings

import pytest

from eqjax.io.gguf import load_tokenizer
from eqjax.io.tokenizer import Tokenizer, TokenizerError, bytes_to_unicode

EDGE_CASES = [
    "",
    "Hello world",
    "  leading and trailing spaces  ",
    "tabs\tand\t\tnewlines\n\n\n\nand \r\n crlf",
    "digits 0 12 345 6789 3.14159 1,000,000 2024-01-31 x86_64 H2O",
    "unicode: naïve café Zürich Ελληνικά Русский 中文 日本語 한국어 العربية हिन्दी",
    "emoji 🙂👍🏽 and symbols ∑∫√∞ ≤≥ — – … «» “quotes” ‘single’",
    "contractions: it's, we're, they'll, I'd, you've, don't, O'Neill",
    "code: def f(x):\n    return x**2  # comment\n\tif a != b: pass",
    "<|im_start|>user\nhi<|im_end|> <|endoftext|>",
    "     \n     ",
    "zero\u200bwidth\u00a0nbsp\ufeffbom",
]


def tiny_meta() -> dict:
    tokens = ["<|endoftext|>", "<|user|>", *bytes_to_unicode().values(), "Ġt", "he", "Ġthe"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": ["Ġ t", "h e", "Ġt he"],
        "tokenizer.ggml.token_type": [3, 4] + [1] * (len(tokens) - 2),
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 0,
    }


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    return Tokenizer.from_metadata(tiny_meta())


def test_tiny_encode_decode(tiny: Tokenizer) -> None:
    assert tiny.vocab_size == 261 and tiny.bos_id == tiny.eos_id == 0
    assert tiny.encode(" the") == [260]
    assert tiny.encode(" the", add_bos=True) == [0, 260]
    assert tiny.encode("<|endoftext|><|user|>") == [0, 1]
    for s in EDGE_CASES:
        assert tiny.decode(tiny.encode(s)) == s
    assert tiny.decode(tiny.encode("a<|endoftext|>b"), skip_special_tokens=True) == "ab"


def test_tiny_digits_split_individually(tiny: Tokenizer) -> None:
    meta = tiny_meta()
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"], "12"]
    meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"], 1]
    meta["tokenizer.ggml.merges"] = [*meta["tokenizer.ggml.merges"], "1 2"]
    smollm = Tokenizer.from_metadata(meta)
    assert len(smollm.encode("12")) == 2  # smollm pre-tokenizer: one digit per piece, as llama.cpp
    gpt2 = Tokenizer.from_metadata(meta | {"tokenizer.ggml.pre": "gpt2"})
    assert gpt2.encode("12") == [261]


def test_fingerprint_tracks_vocab(tiny: Tokenizer) -> None:
    other = tiny_meta()
    other["tokenizer.ggml.merges"] = other["tokenizer.ggml.merges"][:2]
    other["tokenizer.ggml.tokens"] = other["tokenizer.ggml.tokens"][:-1]
    other["tokenizer.ggml.token_type"] = other["tokenizer.ggml.token_type"][:-1]
    assert tiny.fingerprint == Tokenizer.from_metadata(tiny_meta()).fingerprint
    assert tiny.fingerprint != Tokenizer.from_metadata(other).fingerprint


def test_errors() -> None:
    with pytest.raises(TokenizerError, match="'llama' is not supported"):
        Tokenizer.from_metadata(tiny_meta() | {"tokenizer.ggml.model": "llama"})
    with pytest.raises(TokenizerError, match="no tokenizer"):
        Tokenizer.from_metadata({"general.architecture": "llama"})
    with pytest.raises(TokenizerError, match="bos id 999"):
        Tokenizer.from_metadata(tiny_meta() | {"tokenizer.ggml.bos_token_id": 999})
    with pytest.raises(TokenizerError, match="merge 0"):
        Tokenizer.from_metadata(tiny_meta() | {"tokenizer.ggml.merges": ["abc"]})
    with pytest.warns(UserWarning, match="unknown GGUF pre-tokenizer 'mystery'"):
        Tokenizer.from_metadata(tiny_meta() | {"tokenizer.ggml.pre": "mystery"})
    tok = Tokenizer.from_metadata(tiny_meta())
    with pytest.raises(TokenizerError, match="outside"):
        tok.decode([5, 100000])


# ------------------------------------------------------------------------ the real SmolLM2 tokenizer
@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return load_tokenizer()


def _parity_text() -> str:
    """Several thousand characters of the Wikipedia text (incl. its most non-ASCII and digit-dense
    articles), the news text's start, and the edge cases."""
    from eqjax.data import news_text, wikipedia_articles

    arts = wikipedia_articles()
    non_ascii = max(arts, key=lambda a: sum(ord(c) > 127 for c in a[:20000]))
    digits = max(arts, key=lambda a: sum(c.isdigit() for c in a[:20000]) / max(1, len(a[:20000])))
    parts = [arts[0][:4000], non_ascii[:4000], digits[:4000], news_text()[:2000], *EDGE_CASES]
    return "\n\n".join(parts)


def llamacpp_smollm_pieces(text: str) -> list[str]:
    """llama.cpp's pre-tokenization for ``LLAMA_VOCAB_PRE_TYPE_SMOLLM`` (llama-vocab.cpp): split on
    ``\\p{N}``, then on the GPT-2 regex; text between matches stays a piece of its own."""
    import regex

    pieces = [text]
    for pat in (r"\p{N}", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"):
        out = []
        for p in pieces:
            pos = 0
            for m in regex.finditer(pat, p):
                if m.start() > pos:
                    out.append(p[pos : m.start()])
                out.append(m.group())
                pos = m.end()
            if pos < len(p):
                out.append(p[pos:])
        pieces = out
    return pieces


@pytest.mark.slow
def test_pretokenizer_matches_llamacpp(smol: Tokenizer) -> None:
    from eqjax.data import news_text

    spell = bytes_to_unicode()
    for text in (_parity_text().replace("<|", "< |"), news_text()):
        want = ["".join(spell[b] for b in p.encode("utf-8")) for p in llamacpp_smollm_pieces(text)]
        got = [p for p, _ in smol.backend.pre_tokenizer.pre_tokenize_str(text)]
        assert got == want
    assert [smol.id_to_token(i) for i in smol.encode("\n\n\n\n 1950")] == ["ĊĊ", "ĊĊĠ", "1", "9", "5", "0"]


@pytest.fixture(scope="module")
def hf_reference() -> object:
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from eqjax.io.gguf import default_model_path

    path = default_model_path()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.slow
@pytest.mark.reference
def test_parity_with_transformers(smol: Tokenizer, hf_reference: object) -> None:
    """pre="gpt2" gives transformers' GGUF ids exactly; the default (llama.cpp's smollm pre-tokenizer)
    differs only where whitespace meets a digit."""
    ref = hf_reference
    compat = load_tokenizer(pre="gpt2")
    text = _parity_text()
    assert len(text) > 10_000 and any(ord(c) > 0x4E00 for c in text)
    want = ref(text, add_special_tokens=False)["input_ids"]
    assert compat.encode(text) == want
    for s in EDGE_CASES:
        assert compat.encode(s) == ref(s, add_special_tokens=False)["input_ids"], s
    ours = smol.encode(text)
    assert smol.decode(ours) == ref.decode(ours, clean_up_tokenization_spaces=False) == text
    assert abs(len(ours) - len(want)) <= 0.03 * len(want)  # digit-dense tables differ most (~2 %)
    no_digits = "".join(c for c in text if not c.isdigit())
    assert smol.encode(no_digits) == ref(no_digits, add_special_tokens=False)["input_ids"]
    # bos / eos against the GGUF file itself: transformers 4.57.6 reports eos_token_id 1 (<|im_start|>)
    # for this file, whose tokenizer.ggml.eos_token_id is 2 (<|im_end|>)
    from eqjax.io.gguf import default_model_path, read_metadata

    meta = read_metadata(default_model_path())
    assert (smol.bos_id, smol.eos_id) == (meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"])
    assert smol.vocab_size == len(ref) and smol.bos_id == ref.bos_token_id


@pytest.mark.slow
def test_smollm2_roundtrip_whole_texts(smol: Tokenizer) -> None:
    from eqjax.data import join_documents, news_text, wikipedia_articles

    assert (smol.vocab_size, smol.bos_id, smol.eos_id, smol.pre) == (49152, 1, 2, "smollm")
    for text in (join_documents(wikipedia_articles()), news_text(), *EDGE_CASES):
        assert smol.decode(smol.encode(text)) == text
    assert smol.encode("<|im_start|>") == [1]
    assert smol.encode("Hello 2024") == [19556, 216, 34, 32, 34, 36]
