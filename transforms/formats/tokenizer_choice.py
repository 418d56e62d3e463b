"""Which tokenizer prep uses: a tiktoken encoding or a Hugging Face ``tokenizer.json``.

Two steps, so that workers never decide anything:

- :func:`resolve_tokenizer` (the driver, once): a ``--tokenizer`` value (and ``--eos-token``)
  -> a :class:`TokenizerSpec`, a small frozen record that travels in the stage config to
  every worker: kind, name (tiktoken: the encoding; tokenizers: the ``tokenizer.json`` path,
  absolute when local, or ``gs://``), the sha256 of its file, vocab size, EOS id and the
  shards' dtype. A bad value raises :class:`TokenizerError`, one line for the user.
- :func:`~refinery.transforms.formats.encoders.load_tokenizer` (each worker process, once per
  spec): the :class:`PrepTokenizer` the spec names (:func:`plain_tokenizer`, or a faster encoder
  giving the same tokens). A ``tokenizer.json`` is read again and checked against the spec's
  sha256, so a worker never encodes with a file other than the one planned.

The values ``--tokenizer`` takes:

- a tiktoken encoding: ``o200k_harmony`` (the default, :data:`DEFAULT`), ``o200k_base``,
  ``cl100k_base`` (offline from ``bpe-openai``), ``gpt2``, ``r50k_base``, ``p50k_base``,
  ``p50k_edit`` (only when tiktoken's cache holds their files). EOS: ``<|endoftext|>``.
- a ``tokenizer.json`` file or a folder holding one (local or ``gs://``), read by the
  ``tokenizers`` library. EOS: the ``eos_token`` of a ``tokenizer_config.json`` beside it,
  else the first of :data:`COMMON_EOS` in its vocab, else an error asking for ``--eos-token``.

``--eos-token TOKEN_OR_ID`` overrides the EOS (a token of the vocab or an id in it).

A document's tokens: tiktoken ``encode_ordinary``; tokenizers ``encode(text,
add_special_tokens=False)`` with ``encode_special_tokens`` on (special-token text in a
document stays text, as ``encode_ordinary`` keeps it: an EOS only ever ends a document).

Identity in plan hashes (:meth:`TokenizerSpec.identity`): tiktoken ``{encoding, vocab_sha256}``
exactly as before this module existed (so old outputs resume); a ``tokenizer.json`` by its
sha256, never its path. An EOS other than the tokenizer's own enters it too.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import numpy as np

from refinery.transforms.formats import tiktoken_vocab as tk
from refinery.transforms.io import storage
from refinery.transforms.io.hf import HubError, _hub_call

if TYPE_CHECKING:
    from huggingface_hub import HfApi
    from tiktoken import Encoding
    from tokenizers import Tokenizer as HfTok

UINT16_MAX_VOCAB = 1 << 16  # ids 0..65535 fit uint16
COMMON_EOS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<|im_end|>", "<eos>")
TIKTOKEN_EOS = "<|endoftext|>"


class TokenizerError(ValueError):
    """A ``--tokenizer``/``--eos-token`` value that cannot be used; the message is one line."""


@dataclass(frozen=True)
class TokenizerSpec:
    """What identifies and loads a tokenizer (picklable, small; see the module doc)."""

    kind: str  # "tiktoken" | "tokenizers"
    name: str  # the encoding, or the tokenizer.json path
    sha256: str  # tiktoken: its (first) vocab file's; tokenizers: tokenizer.json's
    vocab_size: int  # ids are < vocab_size (added tokens included)
    eos_id: int
    eos_token: str
    eos_override: bool = False  # the EOS is --eos-token's, not the tokenizer's own
    more_sha256: tuple[str, ...] = ()  # gpt2's second vocab file
    eos_ordinary: bool = False  # the EOS is an ordinary token (--eos-token-is-ordinary): documents may hold it

    @property
    def dtype(self) -> str:
        """The shards' dtype: uint16 when every id fits, else uint32."""
        return "uint16" if self.vocab_size <= UINT16_MAX_VOCAB else "uint32"

    @property
    def is_default(self) -> bool:
        return self == DEFAULT

    def identity(self) -> dict[str, Any]:
        """What enters plan hashes (for the default: what ``tokenizer_identity()`` always gave)."""
        if self.kind == "tiktoken":
            ident: dict[str, Any] = {"encoding": self.name, "vocab_sha256": self.sha256}
            if self.more_sha256:
                ident["more_sha256"] = list(self.more_sha256)
        else:
            ident = {"tokenizer": "tokenizers", "sha256": self.sha256}
        if self.eos_override or self.kind != "tiktoken":
            ident["eos_token_id"] = self.eos_id
        return ident

    def manifest_fields(self) -> dict[str, Any]:
        """The manifest's tokenizer fields. The default's are those manifests always had;
        another tokenizer adds ``tokenizer_kind`` and ``eos_token``."""
        fields = {"tokenizer": self.name, "vocab_sha256": self.sha256, "vocab_size": self.vocab_size,
                  "eos_token_id": self.eos_id, "dtype": self.dtype}
        if not self.is_default:
            fields.update({"tokenizer_kind": self.kind, "eos_token": self.eos_token})
        if self.eos_ordinary:  # document ends cannot be told from the tokens: the .idx is their only record
            fields["eos_token_is_ordinary"] = True
        return fields

    def describe(self) -> str:
        """One line for people: ``cl100k_base (tiktoken, vocab 100,277, EOS 100257 '<|endoftext|>', uint32)``."""
        if self.eos_id < 0:
            return f"{self.name} ({self.sha256})"
        return (f"{self.name} ({self.kind}, vocab {self.vocab_size:,}, EOS {self.eos_id} {self.eos_token!r}, "
                f"{self.dtype})")


DEFAULT = TokenizerSpec("tiktoken", tk.ENCODING_NAME, tk.VOCAB_SHA256, tk.VOCAB_SIZE, tk.EOS_TOKEN_ID, TIKTOKEN_EOS)


# ---------------------------------------------------------------------------------------
# Loaded tokenizers
# ---------------------------------------------------------------------------------------

class PrepTokenizer:
    """A loaded tokenizer: ``encode(text)`` -> ``array('I')`` of token ids without EOS;
    ``encode_flat(texts)`` -> a batch's tokens as one buffer plus offsets; ``eos_id``,
    ``vocab_size``, ``dtype``, ``name`` and ``identity()`` from its spec."""

    def __init__(self, spec: TokenizerSpec):
        self.spec = spec
        self.name, self.eos_id, self.vocab_size, self.dtype = spec.name, spec.eos_id, spec.vocab_size, spec.dtype

    def identity(self) -> dict[str, Any]:
        return self.spec.identity()

    def encode(self, text: str) -> array[int]:
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[array[int]]:
        return [self.encode(t) for t in texts]

    def encode_flat(self, texts: Sequence[str], plain: Sequence[bool] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, offsets) of ``texts``: one uint32 array of every text's tokens (without EOS)
        back to back, and int64 offsets (``len(texts) + 1``): text ``i``'s tokens are
        ``tokens[offsets[i]:offsets[i + 1]]``. ``plain`` (optional, per text): known to hold
        no code point unassigned in Unicode 14.0; only gigatoken's encoder uses it. Here:
        :meth:`encode` per text, joined."""
        return join_encoded([self.encode(t) for t in texts])

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError


def join_encoded(parts: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
    """(tokens uint32, offsets int64) of per-text token buffers (``array('I')`` or uint32
    arrays): the :meth:`PrepTokenizer.encode_flat` form."""
    offsets = np.zeros(len(parts) + 1, np.int64)
    np.cumsum([len(p) for p in parts], out=offsets[1:])
    tokens = np.empty(int(offsets[-1]), np.uint32)
    for p, lo, hi in zip(parts, offsets[:-1].tolist(), offsets[1:].tolist()):
        tokens[lo:hi] = np.frombuffer(p, np.uint32) if isinstance(p, array) else p
    return tokens, offsets


class TiktokenTokenizer(PrepTokenizer):
    def __init__(self, spec: TokenizerSpec, enc: Encoding):
        super().__init__(spec)
        self.enc = enc

    def encode(self, text: str) -> array[int]:
        out = array("I")
        # encode_to_numpy with no special token allowed or disallowed is encode_ordinary
        # (tested token for token), returned as one uint32 buffer instead of a list of ints.
        out.frombytes(self.enc.encode_to_numpy(text, allowed_special=set(), disallowed_special=()).data.cast("B"))
        return out

    def encode_flat(self, texts: Sequence[str], plain: Sequence[bool] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`PrepTokenizer.encode_flat` with tiktoken's own uint32 buffers, one text at a time
        (tiktoken's batch call would start a thread pool)."""
        enc = self.enc
        return join_encoded([enc.encode_to_numpy(t, allowed_special=set(), disallowed_special=()) for t in texts])

    def decode(self, ids: Iterable[int]) -> str:
        return self.enc.decode([int(t) for t in ids])


class HfTokenizer(PrepTokenizer):
    def __init__(self, spec: TokenizerSpec, tok: HfTok):
        super().__init__(spec)
        self.tok = tok

    def encode(self, text: str) -> array[int]:
        return array("I", self.tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: list[str]) -> list[array[int]]:
        return [array("I", e.ids) for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(t) for t in ids], skip_special_tokens=False)


# tiktoken encodings the fast encoders (gigatoken, bpe-openai) encode, and the base encoding whose
# vocab and split pattern they use (o200k_harmony's ordinary tokens are o200k_base's: the same
# ranks and pattern, other special tokens)
FAST_ENCODINGS = {"o200k_harmony": "o200k_base", "o200k_base": "o200k_base", "cl100k_base": "cl100k_base"}
# checked at load: the fast encoder is used only if it gives tiktoken's tokens for these (the
# sha256 of their JSON token lists, as tiktoken 0.14 encodes them; tests compare both encoders)
_PROBE_SHA256 = {"o200k_base": "34ea12200d289670b619da7f259f72518adbae03b8a88b5db8c75c00da5939ff",
                 "cl100k_base": "00870a9e60baa71e91bbe076af087e9d5d0b15570f8cc272009c0b064a12a235"}
_PROBES = ("Hello, world! 123 4567 <|endoftext|> ünïcödé 日本語 \U0001F600\n\n\tdef f(x):\n    return x**2",
           "a" * 3000 + " " * 40 + "0123456789" * 30, "don't I'll we've  \r\n  x")


def wrap_encoding(enc: Encoding) -> TiktokenTokenizer:
    """A tiktoken ``Encoding`` (e.g. :func:`tokenizer.get_encoding`'s) as a :class:`PrepTokenizer`
    whose EOS is its ``<|endoftext|>``."""
    if enc.name == tk.ENCODING_NAME:
        return TiktokenTokenizer(DEFAULT, enc)
    return TiktokenTokenizer(TokenizerSpec("tiktoken", enc.name, "", enc.n_vocab, enc.eot_token, TIKTOKEN_EOS), enc)


def _parse_hf(data: bytes, source: str) -> HfTok:
    from tokenizers import Tokenizer as HfTok

    try:
        tok = HfTok.from_str(data.decode("utf-8"))
    except Exception as e:  # noqa: BLE001 - a parse error of any kind: one line naming the file
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise TokenizerError(f"{source}: not a tokenizers tokenizer.json ({type(e).__name__}: {first})") from None
    tok.encode_special_tokens = True  # special-token text in a document stays text (encode_ordinary's rule)
    return tok


@functools.lru_cache(maxsize=8)
def plain_tokenizer(spec: TokenizerSpec) -> TiktokenTokenizer | HfTokenizer:
    """The reference :class:`PrepTokenizer` of ``spec``, once per process: tiktoken's for an
    encoding, ``tokenizers``' for a ``tokenizer.json`` (read again and checked against the
    spec's sha256: :class:`TokenizerError` when it is missing or no longer that file). The
    encoder a worker uses, a faster one giving the same tokens included, is
    :func:`refinery.transforms.formats.encoders.load_tokenizer`'s."""
    if spec.kind == "tiktoken":
        return TiktokenTokenizer(spec, tiktoken_encoding(spec))
    try:
        data = storage.read_bytes(spec.name)
    except FileNotFoundError:
        raise TokenizerError(f"{spec.name}: not found (the tokenizer.json this job was planned with)") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != spec.sha256:
        raise TokenizerError(f"{spec.name}: sha256 {digest}, but this job was planned with {spec.sha256}; "
                             "run the same command again to plan with the new file")
    return HfTokenizer(spec, _parse_hf(data, spec.name))


def tiktoken_encoding(spec: TokenizerSpec) -> Encoding:
    """tiktoken's ``Encoding`` of a tiktoken ``spec`` (the project's verified o200k_harmony,
    else tiktoken's own)."""
    return tk.get_encoding() if spec.name == tk.ENCODING_NAME else tk.get_tiktoken(spec.name)


def resolve_tokenizer(value: str | TokenizerSpec | None = None, eos_token: str | int | None = None,
                      eos_ordinary: bool = False) -> TokenizerSpec:
    """The :class:`TokenizerSpec` of a ``--tokenizer`` value (default ``o200k_harmony``) and an
    optional ``--eos-token``; raises :class:`TokenizerError` with one line naming the problem.
    An ``--eos-token`` that is an ordinary token (one a document's text can encode to) is
    refused unless ``eos_ordinary`` (``--eos-token-is-ordinary``): documents holding it could
    not be told apart by their EOS (``inspect``, ``regenerate-index``)."""
    if isinstance(value, TokenizerSpec):
        return value if eos_token is None else _with_eos(value, plain_tokenizer(value), eos_token, eos_ordinary)
    value = value or tk.ENCODING_NAME
    if value in tk.TIKTOKEN_FILES:
        return _tiktoken_spec(value, eos_token, eos_ordinary)
    if storage.is_remote(value):
        try:
            if not storage.exists(value):
                raise TokenizerError(f"{value}: not found (a tokenizer.json or a folder holding one)")
            return _hf_spec(value, eos_token, eos_ordinary)
        except (TokenizerError, storage.InputError):
            raise
        except Exception as e:  # noqa: BLE001 - network/auth errors of any fsspec backend: one line
            first = (str(e).strip().splitlines() or [""])[0][:300]
            raise TokenizerError(f"--tokenizer {value}: cannot be read ({type(e).__name__}: {first}); no network or "
                                 "no access? pass a local tokenizer.json") from None
    if os.path.exists(value):
        return _hf_spec(os.path.abspath(value), eos_token, eos_ordinary)
    if HUB_NAME.fullmatch(value) and not value.endswith(".json"):
        return _hf_spec(hub_tokenizer_path(value), eos_token, eos_ordinary)
    if value.endswith(".json") or "/" in value or os.sep in value:
        raise TokenizerError(f"{value}: not found (a tokenizer.json or a folder holding one)")
    raise TokenizerError(f"unknown tokenizer {value!r}: not a tiktoken encoding ({', '.join(tk.TIKTOKEN_FILES)}) "
                         "nor a tokenizer.json file or a folder holding one")


HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?")


def hub_tokenizer_path(value: str, api: HfApi | None = None) -> str:
    """``hf://ORG/MODEL@SHA/tokenizer.json`` for a hub name ``ORG/MODEL[@REVISION]``: the
    revision (default: the current commit) resolved to its commit sha once, in the driver, so
    every worker reads the same file and a rerun names the same plan. Raises
    :class:`TokenizerError` with one line when the hub cannot be reached (no network)."""

    name, _, revision = value.partition("@")
    if (state := storage.offline_state()) is not None:
        raise storage.RemoteNotRead(f"{value}: the hub is not asked ({state.reason})")
    sha: str | None
    if revision and re.fullmatch(r"[0-9a-f]{40}", revision):
        sha = revision
    else:
        if api is None:
            from huggingface_hub import HfApi
            api = HfApi()
        try:
            sha = _hub_call(f"resolving {name}", lambda: api.model_info(name, revision=revision or None).sha)
        except HubError as e:
            raise TokenizerError(f"--tokenizer {value}: {e}; or pass a local tokenizer.json") from None
    return f"hf://{name}@{sha}/tokenizer.json"


def _tiktoken_spec(name: str, eos_token: str | int | None, eos_ordinary: bool = False) -> TokenizerSpec:
    try:
        if name == tk.ENCODING_NAME and eos_token is None:
            tk.check_vocab()  # the default: workers build the encoding; the driver only checks they can
            return DEFAULT
        enc = tk.get_encoding() if name == tk.ENCODING_NAME else tk.get_tiktoken(name)
    except tk.VocabError as e:
        raise TokenizerError(str(e)) from None
    files = tk.TIKTOKEN_FILES[name]
    spec = TokenizerSpec("tiktoken", name, files[0].sha256, enc.n_vocab, enc.eot_token, TIKTOKEN_EOS,
                         more_sha256=tuple(f.sha256 for f in files[1:]))
    if name == tk.ENCODING_NAME and spec != DEFAULT:
        raise TokenizerError(f"unexpected {name}: {spec}")
    return spec if eos_token is None else _with_eos(spec, TiktokenTokenizer(spec, enc), eos_token, eos_ordinary)


def _eos_of(value: str | int, token_to_id: Callable[[str], int | None], id_to_token: Callable[[int], str | None],
            vocab_size: int, where: str) -> tuple[int, str]:
    """(id, token) of an EOS given as a token string or an integer id, checked against the vocab."""
    text = str(value).strip()
    if re.fullmatch(r"\d+", text):
        i = int(text)
        token = id_to_token(i) if i < vocab_size else None
        if token is None:
            raise TokenizerError(f"--eos-token {i}: no token has that id in {where} (vocab size {vocab_size})")
        return i, token
    token_id = token_to_id(str(value))
    if token_id is None:
        raise TokenizerError(f"--eos-token {value!r}: not a token of {where}")
    return token_id, str(value)


def _with_eos(spec: TokenizerSpec, tok: TiktokenTokenizer | HfTokenizer, eos_token: str | int,
              eos_ordinary: bool = False) -> TokenizerSpec:
    from dataclasses import replace

    if isinstance(tok, TiktokenTokenizer):
        enc = tok.enc

        def is_special(i: int, s: str) -> bool:
            return s in enc.special_tokens_set

        def token_to_id(s: str, /) -> int | None:
            try:
                return enc.encode_single_token(s)
            except KeyError:
                return None

        def id_to_token(i: int, /) -> str | None:
            try:
                return enc.decode_single_token_bytes(i).decode("utf-8", "replace")
            except KeyError:
                return None
    else:
        token_to_id, id_to_token = tok.tok.token_to_id, tok.tok.id_to_token
        added = tok.tok.get_added_tokens_decoder()

        def is_special(i: int, s: str) -> bool:  # special added tokens are never matched in a document's text
            return i in added and bool(added[i].special)
    eos_id, eos = _eos_of(eos_token, token_to_id, id_to_token, spec.vocab_size, spec.name)
    if spec.kind == "tiktoken" and eos_id == spec.eos_id:
        return spec  # the tokenizer's own EOS, named explicitly: the same plan
    ordinary = not is_special(eos_id, eos)
    if ordinary and not eos_ordinary:
        raise TokenizerError(f"--eos-token {eos_token}: {eos!r} (id {eos_id}) is an ordinary token of {spec.name}: "
                             "documents can hold it, so their ends could not be told from the tokens (inspect, "
                             "regenerate-index); give a special token, or pass --eos-token-is-ordinary to accept it")
    return replace(spec, eos_id=eos_id, eos_token=eos, eos_override=True, eos_ordinary=ordinary)


def _hf_file(path: str) -> str:
    if storage.isdir(path):
        path = storage.join(path, "tokenizer.json")
        if not storage.exists(path):
            raise TokenizerError(f"{storage.dirname(path)}: a folder without a tokenizer.json")
    return path


def _config_eos(config_path: str) -> str | None:
    """``eos_token`` of a ``tokenizer_config.json`` (a string, or ``{"content": ...}``), or None."""
    try:
        cfg = json.loads(storage.read_bytes(config_path))
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise TokenizerError(f"{config_path}: not valid JSON ({e})") from None
    eos = cfg.get("eos_token") if isinstance(cfg, dict) else None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) and eos else None


def _hf_spec(path: str, eos_token: str | int | None, eos_ordinary: bool = False) -> TokenizerSpec:
    file = _hf_file(path)
    try:
        data = storage.read_bytes(file)
    except (FileNotFoundError, IsADirectoryError):
        raise TokenizerError(f"{file}: not found") from None
    tok = _parse_hf(data, file)
    vocab = tok.get_vocab(with_added_tokens=True)
    vocab_size = max(tok.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)
    spec = TokenizerSpec("tokenizers", file, hashlib.sha256(data).hexdigest(), vocab_size, -1, "")
    if eos_token is not None:
        return _with_eos(spec, HfTokenizer(spec, tok), eos_token, eos_ordinary)
    config = storage.join(storage.dirname(file), "tokenizer_config.json")
    configured = _config_eos(config)
    if configured is not None:
        configured_id = tok.token_to_id(configured)
        if configured_id is None:
            raise TokenizerError(f"{config}: eos_token {configured!r} is not a token of {file}; pass --eos-token")
        candidates = [(configured, configured_id)]
    else:
        candidates = [(t, i) for t in COMMON_EOS if (i := tok.token_to_id(t)) is not None]
    if not candidates:
        raise TokenizerError(f"{file}: no EOS token found (no tokenizer_config.json eos_token, none of "
                             f"{' '.join(COMMON_EOS)}); pass --eos-token TOKEN_OR_ID")
    from dataclasses import replace

    eos, eos_id = candidates[0]
    return replace(spec, eos_id=eos_id, eos_token=eos)


def spec_from_manifest(manifest: dict[str, Any]) -> TokenizerSpec | None:
    """The tokenizer a manifest records, when it can be loaded here (for decoding samples):
    the default for manifests without ``tokenizer_kind``; None when unknown or unavailable."""
    kind = manifest.get("tokenizer_kind", "tiktoken")
    name = manifest.get("tokenizer", tk.ENCODING_NAME)
    try:
        if kind == "tiktoken" and name == tk.ENCODING_NAME and "tokenizer_kind" not in manifest:
            return DEFAULT
        spec = resolve_tokenizer(name)
        return spec if spec.sha256 == manifest.get("vocab_sha256") else None
    except (TokenizerError, OSError):
        return None
