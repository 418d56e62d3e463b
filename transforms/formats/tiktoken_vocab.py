"""tiktoken encodings, resolved offline and identified by their vocab hash.

``o200k_harmony`` (prep's default, gpt-oss's tokenizer) is :func:`get_encoding`; any other
tiktoken encoding is :func:`get_tiktoken` (``o200k_base`` and ``cl100k_base`` offline from
``bpe-openai``; ``gpt2``, ``r50k_base``, ``p50k_base`` only from tiktoken's cache, see
:data:`TIKTOKEN_FILES`).

Dataflow/SLURM workers and this project's CI often have no internet, so the o200k_base
vocab (which tiktoken's ``o200k_harmony`` is built on) is resolved from, in order:

1. an explicit file: the ``vocab_file`` argument or ``$REFINERY_VOCAB_FILE`` (plain or ``.gz``);
2. tiktoken's own cache (``$TIKTOKEN_CACHE_DIR``, else a per-user ``~/.cache/refinery/tiktoken``);
3. the copy that the PyPI package ``bpe-openai`` ships (``bpe_openai/data/o200k_base.tiktoken.gz``);
4. tiktoken's normal download.

Every source is checked against :data:`VOCAB_SHA256` (sha256 of the decompressed file). Sources
1 and 3 are written into tiktoken's cache, and tiktoken then builds the encoding itself, so
the regex and special tokens are tiktoken's, not a copy of them. ``cl100k_base`` is resolved
the same way (2 and 3, checked against :data:`CL100K`'s sha256); source 1 is o200k's only.

A tokenizer's identity in every plan hash is :func:`tokenizer_identity`: (encoding name,
vocab sha256). Nothing network-dependent enters it.
"""
from __future__ import annotations

import contextlib
import functools
import gzip
import hashlib
import os
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import tiktoken

ENCODING_NAME = "o200k_harmony"
VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
VOCAB_URL = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"
EOS_TOKEN_ID = 199999  # <|endoftext|>
VOCAB_SIZE = 201088




@dataclass(frozen=True)
class VocabFile:
    """One vocab file of a tiktoken encoding: where tiktoken downloads it (its cache file is
    named by the sha1 of that URL), its pinned sha256, and the ``bpe-openai`` copy, if any."""

    name: str
    url: str
    sha256: str
    bundled: str | None = None  # file name under bpe_openai/data/


O200K = VocabFile("o200k_base", VOCAB_URL, VOCAB_SHA256, "o200k_base.tiktoken.gz")
CL100K = VocabFile("cl100k_base", "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken",
                   "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7", "cl100k_base.tiktoken.gz")
_R50K = VocabFile("r50k_base", "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken",
                  "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930")
_P50K = VocabFile("p50k_base", "https://openaipublic.blob.core.windows.net/encodings/p50k_base.tiktoken",
                  "94b5ca7dff4d00767bc256fdd1b27e5b17361d7b8a5f968547f9f23eb70d2069")
_GPT2 = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"

# encoding -> its vocab file(s), the hashes tiktoken itself pins (tiktoken_ext.openai_public)
TIKTOKEN_FILES: dict[str, tuple[VocabFile, ...]] = {
    "o200k_harmony": (O200K,),
    "o200k_base": (O200K,),
    "cl100k_base": (CL100K,),
    "r50k_base": (_R50K,),
    "p50k_base": (_P50K,),
    "p50k_edit": (_P50K,),
    "gpt2": (VocabFile("gpt2 vocab.bpe", _GPT2 + "vocab.bpe",
                       "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"),
             VocabFile("gpt2 encoder.json", _GPT2 + "encoder.json",
                       "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783")),
}


class VocabError(RuntimeError):
    """A vocab could not be found offline, or a candidate failed its sha256 check."""


def tokenizer_identity() -> dict[str, Any]:
    """What identifies the tokenizer inside plan hashes: name and vocab hash, never a URL."""
    return {"encoding": ENCODING_NAME, "vocab_sha256": VOCAB_SHA256}


def _read_maybe_gz(path: str | os.PathLike[str]) -> bytes:
    with open(path, "rb") as f:
        data = f.read()
    return gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def user_cache_dir(name: str) -> Path:
    """A per-user cache folder: ``$XDG_CACHE_HOME/refinery/NAME`` or ``~/.cache/refinery/NAME``
    (not a fixed name under /tmp that every user of the machine shares)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "refinery" / name


def tiktoken_cache_path(vocab: VocabFile = O200K) -> Path | None:
    """Where tiktoken caches a vocab, o200k_base's by default (None when its cache is disabled).

    Unless ``$TIKTOKEN_CACHE_DIR`` (or ``$DATA_GYM_CACHE_DIR``) names one, refinery points
    tiktoken at a per-user folder (:func:`user_cache_dir`) by setting ``$TIKTOKEN_CACHE_DIR``
    for this process and the workers it starts."""
    cache_dir = os.environ.get("TIKTOKEN_CACHE_DIR", os.environ.get("DATA_GYM_CACHE_DIR"))
    if cache_dir is None:
        cache_dir = str(user_cache_dir("tiktoken"))
        os.environ["TIKTOKEN_CACHE_DIR"] = cache_dir
    if cache_dir == "":
        return None
    return Path(cache_dir) / hashlib.sha1(vocab.url.encode()).hexdigest()


def bundled_vocab_path(vocab: VocabFile = O200K) -> Path | None:
    """The gzipped vocab that the ``bpe-openai`` wheel ships, if that package is installed."""
    import importlib.util

    if vocab.bundled is None:
        return None
    spec = importlib.util.find_spec("bpe_openai")  # locate it without importing (its import loads vocabs)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / vocab.bundled
    return path if path.exists() else None


def _checked(data: bytes, source: str, vocab: VocabFile = O200K) -> bytes:
    digest = _sha256(data)
    if digest != vocab.sha256:
        raise VocabError(f"{vocab.name} vocab from {source} has sha256 {digest}, expected {vocab.sha256}")
    return data


def _seed_cache(data: bytes, cache_path: Path) -> None:
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache_path.with_name(f"{cache_path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, cache_path)


def resolve_vocab(vocab_file: str | None = None) -> str:
    """Make sure tiktoken's cache holds the verified vocab; return where it came from.

    Raises :class:`VocabError` when an explicit file fails the check, or when no offline
    source exists and the cache is disabled.
    """
    explicit = vocab_file or os.environ.get("REFINERY_VOCAB_FILE")
    cache_path = tiktoken_cache_path()
    if explicit:
        data = _checked(_read_maybe_gz(explicit), explicit)
        if cache_path is None:
            raise VocabError("tiktoken's cache is disabled (TIKTOKEN_CACHE_DIR=''); unset it to use a vocab file")
        _seed_cache(data, cache_path)
        return explicit
    if cache_path is not None and cache_path.exists():
        try:
            _checked(cache_path.read_bytes(), str(cache_path))
            return str(cache_path)
        except VocabError:
            pass  # a corrupt cache entry: fall through and replace it
    bundled = bundled_vocab_path()
    if bundled is not None and cache_path is not None:
        _seed_cache(_checked(_read_maybe_gz(bundled), str(bundled)), cache_path)
        return str(bundled)
    return VOCAB_URL  # tiktoken downloads and checks the hash itself


def resolve_tiktoken_files(name: str) -> None:
    """Make sure tiktoken's cache holds every verified vocab file of encoding ``name``, from
    the cache itself or ``bpe-openai``'s copy; never the network. Raises :class:`VocabError`
    naming what is missing (o200k's ``--vocab-file`` is :func:`resolve_vocab`'s)."""
    for vocab in TIKTOKEN_FILES[name]:
        cache_path = tiktoken_cache_path(vocab)
        if cache_path is None:
            raise VocabError(f"tiktoken's cache is disabled (TIKTOKEN_CACHE_DIR=''): {name} cannot be loaded offline")
        if cache_path.exists():
            try:
                _checked(cache_path.read_bytes(), str(cache_path), vocab)
                continue
            except VocabError:
                pass  # a corrupt cache entry: replace it from the bundled copy if there is one
        bundled = bundled_vocab_path(vocab)
        if bundled is None:
            raise VocabError(f"tiktoken encoding {name!r} is not available offline: {vocab.name} ({vocab.url}, "
                             f"sha256 {vocab.sha256}) is not in tiktoken's cache as {cache_path}")
        _seed_cache(_checked(_read_maybe_gz(bundled), str(bundled), vocab), cache_path)


def vocab_bytes(vocab_file: str | None = None) -> bytes:
    """The verified, decompressed o200k_base vocab (for tools that want their own copy)."""
    source = resolve_vocab(vocab_file)
    cache_path = tiktoken_cache_path()
    if cache_path is not None and cache_path.exists():
        return _checked(cache_path.read_bytes(), str(cache_path))
    raise VocabError(f"no offline o200k_base vocab (last source tried: {source})")


def write_vocab_file(directory: str | os.PathLike[str], vocab_file: str | None = None) -> Path:
    """Write the verified vocab as ``DIRECTORY/o200k_base.tiktoken`` (e.g. for openai-harmony)."""
    path = Path(directory) / "o200k_base.tiktoken"
    if not (path.exists() and _sha256(path.read_bytes()) == VOCAB_SHA256):
        _seed_cache(vocab_bytes(vocab_file), path)
    return path


def check_vocab(vocab_file: str | None = None) -> None:
    """Fail early (in a driver) if the verified vocab is not available, without building the
    encoding: workers build it; the driver only needs to know they can."""
    resolve_vocab(vocab_file)
    cache_path = tiktoken_cache_path()
    if cache_path is None or not cache_path.exists():
        get_encoding(vocab_file)  # no offline copy: tiktoken downloads (or says why not)


_BUILD_LOCK = threading.Lock()


def _parsed_ranks(cache_path: Path, vocab: VocabFile = O200K) -> dict[bytes, int]:
    """The vocab's (token bytes -> rank) table. Parsing the base64 text file takes tiktoken
    about a second per process; the parsed table is kept beside it as ``marshal`` bytes
    (prefixed by their sha256, checked on every read) and loads in a tenth of that."""
    import marshal

    from tiktoken.load import load_tiktoken_bpe

    parsed = cache_path.with_name(cache_path.name + f".{vocab.sha256[:16]}.ranks")
    try:
        data = parsed.read_bytes()
        if hashlib.sha256(data[32:]).digest() == data[:32]:
            ranks: dict[bytes, int] = marshal.loads(data[32:])
            return ranks
    except (OSError, ValueError, EOFError, TypeError):
        pass
    ranks = load_tiktoken_bpe(str(cache_path), vocab.sha256)
    body = marshal.dumps(ranks)
    with contextlib.suppress(OSError):  # a read-only cache still works, only slower
        _seed_cache(hashlib.sha256(body).digest() + body, parsed)
    return ranks


def _build(name: str, cache_path: Path, vocab: VocabFile) -> tiktoken.Encoding:
    """tiktoken's own constructor of encoding ``name``, handed the parsed table of its one
    vocab file instead of re-parsing it."""
    import tiktoken
    import tiktoken_ext.openai_public as openai_public

    ranks = _parsed_ranks(cache_path, vocab)
    with _BUILD_LOCK:
        load = openai_public.load_tiktoken_bpe
        openai_public.load_tiktoken_bpe = lambda *args, **kwargs: ranks
        try:
            params = openai_public.ENCODING_CONSTRUCTORS[name]()
        finally:
            openai_public.load_tiktoken_bpe = load
    return tiktoken.Encoding(**params)


@functools.lru_cache(maxsize=4)
def get_encoding(vocab_file: str | None = None) -> tiktoken.Encoding:
    """The ``o200k_harmony`` encoding (a ``tiktoken.Encoding``), built by tiktoken from an
    offline, verified vocab: tiktoken's own constructor gives the regex and special tokens;
    only the parsed vocab comes from :func:`_parsed_ranks`."""
    import tiktoken

    resolve_vocab(vocab_file)
    cache_path = tiktoken_cache_path()
    if cache_path is None or not cache_path.exists():
        enc = tiktoken.get_encoding(ENCODING_NAME)
    else:
        enc = _build(ENCODING_NAME, cache_path, O200K)
    if enc.eot_token != EOS_TOKEN_ID or enc.n_vocab != VOCAB_SIZE:
        raise VocabError(f"unexpected {ENCODING_NAME}: eot={enc.eot_token} n_vocab={enc.n_vocab}")
    return enc


@functools.lru_cache(maxsize=8)
def get_tiktoken(name: str) -> tiktoken.Encoding:
    """Any encoding of :data:`TIKTOKEN_FILES`, offline (:func:`resolve_tiktoken_files`); one per
    process. ``o200k_harmony`` is :func:`get_encoding`'s (it honours ``$REFINERY_VOCAB_FILE``)."""
    import tiktoken

    if name == ENCODING_NAME:
        return get_encoding()
    if name not in TIKTOKEN_FILES:
        raise VocabError(f"unknown tiktoken encoding {name!r} (known: {', '.join(TIKTOKEN_FILES)})")
    if name == "o200k_base":
        resolve_vocab()
    else:
        resolve_tiktoken_files(name)
    files = TIKTOKEN_FILES[name]
    if len(files) == 1 and (cache_path := tiktoken_cache_path(files[0])) is not None and cache_path.exists():
        return _build(name, cache_path, files[0])
    return tiktoken.get_encoding(name)  # reads (and hash-checks) the files now in its cache
