"""A byte-level BPE tokenizer rebuilt from a GGUF file's metadata (no ``tokenizer.json`` needed).

GGUF files store the vocabulary (``tokenizer.ggml.tokens``), the merges (``tokenizer.ggml.merges``),
the token kinds (``tokenizer.ggml.token_type``: 1 normal, 3 control, 4 user-defined, ...), the special
ids and the pre-tokenizer name (``tokenizer.ggml.pre``). :class:`Tokenizer` turns those into a
``tokenizers`` BPE tokenizer that follows llama.cpp (the runtime the file is made for) and gives the
same ids as transformers' GGUF loader except in the one documented case below:

* model ``gpt2`` (byte-level BPE) only; tokens are spelled in GPT-2's byte alphabet;
* pre-tokenizer ``smollm``: single digits first, then GPT-2's regex on the rest (``Digits`` +
  ``ByteLevel``), exactly llama.cpp's ``LLAMA_VOCAB_PRE_TYPE_SMOLLM`` (``"\\p{N}"`` then the GPT-2
  regex; SmolLM's ``tokenizer.json`` declares the same ``Digits`` + ``ByteLevel`` sequence, not checked
  here: no network); ``llama-bpe``/``llama3`` and ``qwen2`` use their split
  regexes; anything else GPT-2's regex alone;
* control tokens (type 3) are special added tokens, user-defined ones (type 4) plain added tokens, so
  ``<|im_start|>`` in text stays one id as in transformers and llama.cpp;
* no BOS is added unless asked (SmolLM2 says ``add_bos_token = false``).

transformers' GGUF loader (5.x) ignores ``tokenizer.ggml.pre = smollm`` and applies GPT-2's regex alone.
That only differs where whitespace touches a digit: ``"\\n\\n\\n\\n 1950"`` is ``ĊĊ ĊĊĠ 1 9 5 0`` here and
in llama.cpp, ``ĊĊĊĊ Ġ 1 9 5 0`` in transformers (0.15 % of the Wikipedia text's tokens: 730,689 vs
731,786; 75,678 vs 75,680 on the news text). ``eqjax.io.gguf.load_tokenizer(path, pre="gpt2")``
reproduces transformers' ids exactly.

This module reads no files: :mod:`eqjax.io.gguf` reads the metadata and builds the tokenizer with
:meth:`Tokenizer.from_metadata` (the dependency goes one way, gguf -> tokenizer).
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from eqjax.core.errors import InputError

__all__ = ["Tokenizer", "TokenizerError", "bytes_to_unicode", "LLAMA3_SPLIT"]

_CONTROL, _USER_DEFINED = 3, 4

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""Llama 3's pre-tokenization regex (llama.cpp's ``llama-bpe``): contractions, letters, digits in threes."""
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama3": LLAMA3_SPLIT, "llama-bpe": LLAMA3_SPLIT, "llama-v3": LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
_GPT2_PRES = ("default", "gpt2", "gpt-2", "starcoder", "refact")


class TokenizerError(InputError):
    """The metadata does not describe a tokenizer eqjax can rebuild (names what is wrong)."""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


class Tokenizer:
    """Byte-level BPE tokenizer with the ids of the model it came from.

    Build with :meth:`from_metadata` (a dict of GGUF metadata keys) or, from a file,
    :func:`eqjax.io.gguf.load_tokenizer`.

    Attributes:
      bos_id, eos_id, unk_id, pad_id: special ids from the metadata (None when absent).
      vocab_size: number of ids (``len(tokens)``), equal to the model's embedding rows.
      pre: the pre-tokenizer name the file gave (``tokenizer.ggml.pre``).
      add_bos: whether the model's own tokenizer prepends BOS (informational; :meth:`encode` only adds it
        when asked).
    """

    def __init__(
        self,
        tokens: Sequence[str],
        merges: Sequence[str],
        token_types: Sequence[int] | None = None,
        *,
        bos_id: int | None = None,
        eos_id: int | None = None,
        unk_id: int | None = None,
        pad_id: int | None = None,
        pre: str = "default",
        add_bos: bool = False,
    ) -> None:
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as _HFTokenizer

        tokens = [str(t) for t in tokens]
        if not tokens:
            raise TokenizerError("the tokenizer metadata has an empty vocabulary")
        if token_types is not None and len(token_types) != len(tokens):
            raise TokenizerError(f"{len(token_types)} token types for {len(tokens)} tokens")
        for name, i in (("bos", bos_id), ("eos", eos_id), ("unk", unk_id), ("pad", pad_id)):
            if i is not None and not 0 <= int(i) < len(tokens):
                raise TokenizerError(f"{name} id {i} outside the vocabulary of {len(tokens)} tokens")
        self._tokens = tokens
        self._merges = [str(m) for m in merges]
        self.bos_id = None if bos_id is None else int(bos_id)
        self.eos_id = None if eos_id is None else int(eos_id)
        self.unk_id = None if unk_id is None else int(unk_id)
        self.pad_id = None if pad_id is None else int(pad_id)
        self.pre = pre or "default"
        self.add_bos = bool(add_bos)

        spelling = bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab: dict[str, int] = {}
        for i, t in enumerate(tokens):
            t = t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))
            vocab.setdefault(t, i)
        pairs = []
        for k, m in enumerate(self._merges):
            parts = m.split(" ")
            if len(parts) != 2:
                raise TokenizerError(f"merge {k} ({m!r}) is not two tokens separated by one space")
            pairs.append((parts[0], parts[1]))
        bpe = models.BPE(
            vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False
        )
        tok = _HFTokenizer(bpe)
        if self.pre == "smollm":
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
            )
        elif self.pre in _SPLITS:
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(_SPLITS[self.pre]), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        else:
            if self.pre not in _GPT2_PRES:
                warnings.warn(
                    f"unknown GGUF pre-tokenizer {self.pre!r}: splitting text with GPT-2's regex "
                    "(ids may differ from llama.cpp's)",
                    stacklevel=2,
                )
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        types = list(token_types) if token_types is not None else []
        special = [
            AddedToken(t, normalized=False, special=True)
            for t, ty in zip(tokens, types)
            if int(ty) == _CONTROL and set(t) <= alphabet
        ]
        if special:
            tok.add_special_tokens(special)
        user = [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types) if int(ty) == _USER_DEFINED]
        if user:
            tok.add_tokens(user)
        self._tok = tok
        self._fingerprint: str | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_metadata(
        cls, meta: Mapping[str, Any], *, source: str = "GGUF metadata", pre: str | None = None
    ) -> "Tokenizer":
        """From GGUF metadata (``tokenizer.ggml.*`` keys, values already decoded to Python objects).

        ``pre`` overrides the file's pre-tokenizer name; ``pre="gpt2"`` reproduces transformers' GGUF
        loader, which ignores ``smollm`` and applies only GPT-2's regex (see the module docs).
        """
        model = meta.get("tokenizer.ggml.model")
        if model is None or "tokenizer.ggml.tokens" not in meta:
            raise TokenizerError(f"{source}: no tokenizer in the metadata (tokenizer.ggml.model/tokens missing)")
        if model != "gpt2":
            raise TokenizerError(
                f"{source}: tokenizer model {model!r} is not supported; eqjax rebuilds byte-level BPE ('gpt2') only"
            )
        if "tokenizer.ggml.merges" not in meta:
            raise TokenizerError(f"{source}: byte-level BPE tokenizer without tokenizer.ggml.merges")
        return cls(
            meta["tokenizer.ggml.tokens"],
            meta["tokenizer.ggml.merges"],
            meta.get("tokenizer.ggml.token_type"),
            bos_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_id=meta.get("tokenizer.ggml.eos_token_id"),
            unk_id=meta.get("tokenizer.ggml.unknown_token_id"),
            pad_id=meta.get("tokenizer.ggml.padding_token_id"),
            pre=pre if pre is not None else meta.get("tokenizer.ggml.pre", "default"),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        )

    # ------------------------------------------------------------------ use
    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def backend(self) -> Any:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    @property
    def fingerprint(self) -> str:
        """Hex digest identifying the vocabulary, merges, special tokens and pre-tokenizer (cache keys)."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            h.update(f"eqjax-bpe-v1|{self.pre}|{self.bos_id}|{self.eos_id}\x00".encode())
            h.update("\x00".join(self._tokens).encode())
            h.update(b"\x01")
            h.update("\x00".join(self._merges).encode())
            h.update(b"\x01")
            h.update(",".join(str(i) for i in sorted(self._tok.get_added_tokens_decoder())).encode())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """Token ids of ``text``; BOS is prepended only with ``add_bos=True``."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos:
            if self.bos_id is None:
                raise TokenizerError("add_bos=True but the tokenizer has no BOS id")
            ids = [self.bos_id, *ids]
        return ids

    def encode_array(self, text: str, *, add_bos: bool = False) -> np.ndarray:
        """:meth:`encode` as an int32 array [n]."""
        return np.asarray(self.encode(text, add_bos=add_bos), dtype=np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray, *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (special tokens kept unless ``skip_special_tokens``)."""
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise TokenizerError(f"ids outside [0, {self.vocab_size}): {bad[:5]}")
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str:
        """The token string (GPT-2 byte alphabet) of id ``i``."""
        return self._tokens[int(i)]

    def token_to_id(self, token: str) -> int | None:
        """The id of a token string (GPT-2 byte alphabet), or None."""
        return self._tok.token_to_id(token)

    def __repr__(self) -> str:
        return f"Tokenizer(byte-level BPE, vocab={self.vocab_size}, pre={self.pre!r}, bos={self.bos_id}, eos={self.eos_id})"
