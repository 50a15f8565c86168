"""Damaged token stores and bad inputs: every shard checked against index.json when a store opens
(sizes before mapping, document starts, checksums), a shard changed while it is read, token ids
outside the vocabulary, `jaxpar data verify`, binary / gzip inputs, and `data prepare`'s --out and
OSError answers. Tiny stores (a few thousand byte tokens); nothing here compiles a model."""

import doctest
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jaxpar.cli import main
from jaxpar.data import ByteTokenizer, ShardDamage, TokenLoader, TokenStore, prepare, verify_store
from jaxpar.data import loader as loader_module
from jaxpar.data import shard_read as shard_read_module
from jaxpar.data import store as store_module
from jaxpar.data import text as text_module
from jaxpar.models.data import arithmetic_text

SIZES = dict(docs="line", shard_tokens=1500, chunk_bytes=800, progress=False)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A store of 4 shards (and its corpus), copied by each test that damages it."""
    root = tmp_path_factory.mktemp("damage")
    (root / "a.txt").write_text(arithmetic_text(600, seed=2))
    store = prepare([str(root / "a.txt")], str(root / "store"), **SIZES)
    assert len(store.shards) >= 3
    return root


def _copy(built, tmp_path, name="s"):
    return shutil.copytree(built / "store", tmp_path / name)


def _strip_checksums(path):
    """The index of a store prepared before checksums were recorded."""
    index = json.loads((path / "index.json").read_text())
    for shard in index["shards"]:
        for key in ("tokens_sha256", "tokens_sample", "docs_sha256", "record_sha256"):
            shard.pop(key, None)
    (path / "index.json").write_text(json.dumps(index))


def _edit(path, shard, at, value):
    tokens = np.memmap(path / f"tokens_{shard:05d}.bin", dtype=np.uint16, mode="r+")
    tokens[at] = value
    tokens.flush()
    del tokens


def test_a_truncated_or_empty_shard_is_named_before_it_is_mapped(built, tmp_path, capsys):
    s = _copy(built, tmp_path)
    n = TokenStore(str(s)).index["shards"][1]["num_tokens"]
    os.truncate(s / "tokens_00001.bin", 1001)                       # odd: numpy's "not a multiple" before
    with pytest.raises(ShardDamage, match=rf"shard 1: '{s}/tokens_00001.bin' is 1001 bytes but the index says "
                                          rf"{n} uint16 tokens \({2 * n} bytes\)"):
        TokenStore(str(s))
    os.truncate(s / "tokens_00001.bin", 0)                          # empty: "cannot mmap an empty file" before
    with pytest.raises(ShardDamage, match="tokens_00001.bin' is 0 bytes"):
        TokenLoader(str(s), seq_len=8, global_batch=4)
    job = tmp_path / "job.yaml"
    job.write_text(f"model: {{name: llama, size: tiny}}\ndata: {{path: {s}, seq_len: 16, batch: 8}}\n"
                   "parallel: {mesh: {data: 8}}\ntrain: {steps: 1}\n")
    capsys.readouterr()
    assert main(["train", "--config", str(job), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"jaxpar train: error: token store '{s}' is damaged: shard 1: '{s}/tokens_00001.bin' "
                          "is 0 bytes") and "run 'jaxpar data prepare' again" in err


def test_a_shard_changed_while_it_is_read_is_named_not_a_sigbus(built, tmp_path):
    s = _copy(built, tmp_path)
    loader = TokenLoader(str(s), seq_len=8, global_batch=4, shuffle=False, prefetch=0)
    loader.batch(0)                                                  # rows of shard 0
    data = (s / "tokens_00000.bin").read_bytes()
    (s / "tokens_00000.bin").write_bytes(data + b"\0\0")              # rewritten in place, as `cp` does
    with pytest.raises(ShardDamage, match=rf"shard 0: .*tokens_00000.bin' changed while it was being read "
                                          rf"\({len(data)} bytes when opened, {len(data) + 2} now\)"):
        loader.batch(0)
    # only once the check above holds: reading this truncated map would kill pytest with SIGBUS
    os.truncate(s / "tokens_00000.bin", 0)
    with pytest.raises(ShardDamage, match=r"\d+ bytes when opened, 0 now"):
        loader.batch(0)


_RACE = textwrap.dedent("""
    import os, random, shutil, sys, threading, time
    from jaxpar.data import ShardDamage, TokenLoader, verify_store
    src, root, trials = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rng = random.Random(0)
    named = 0
    for t in range(trials):
        store = shutil.copytree(src, os.path.join(root, f"s{t}"))
        files = sorted(os.path.join(store, f) for f in os.listdir(store) if f.startswith("tokens_"))
        packing, prefetch = ("packed", "padded")[t % 2], (0, 2)[t // 2 % 2]

        verify = t % 5 == 4            # verify_store reads every token; the others read batches
        how = (0, 2)[t % 2] if verify else t % 3

        def damage(f=rng.choice(files), how=how):
            time.sleep(rng.random() * 0.02)
            data = open(f, "rb").read()
            if how == 0:                       # truncate
                os.truncate(f, rng.randrange(len(data)))
            else:                              # rewritten in place, as cp does: emptied, then written again
                with open(f, "wb") as out:
                    for at in range(0, len(data), 512):
                        out.write(data[at:at + 512] if how == 1 else bytes(len(data[at:at + 512])))
                        out.flush()
        try:
            if verify:
                threading.Thread(target=damage).start()
                for _ in range(2000):
                    found = verify_store(store)
                    if found:
                        raise found[0]
            loader = TokenLoader(store, seq_len=64, global_batch=256, packing=packing, prefetch=prefetch)
            threading.Thread(target=damage).start()
            for _ in range(2000):
                next(loader)
        except ShardDamage as e:
            assert "is damaged: shard" in str(e), e
            named += 1
        else:
            sys.exit(f"trial {t}: 2000 batches read from a shard damaged under the reader")
    print("named", named)
""")


def test_shards_truncated_or_rewritten_under_the_reader_are_errors_never_signals(tmp_path):
    """Token files are read from a descriptor with byte counts checked, never mapped: a shard cut
    short or rewritten while batches are read is a ShardDamage, in every packing and with prefetch
    (mapped, the reads died of SIGBUS: exit status -7)."""
    (tmp_path / "a.txt").write_text(arithmetic_text(20000, seed=3))        # 4 shards of 60,000 tokens
    prepare([str(tmp_path / "a.txt")], str(tmp_path / "store"), docs="line", shard_tokens=60000, progress=False)
    trials = 30
    run = subprocess.run([sys.executable, "-c", _RACE, str(tmp_path / "store"), str(tmp_path), str(trials)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert run.stdout.split() == ["named", str(trials)]


def test_a_short_read_names_the_shard_offset_and_bytes(tmp_path):
    f = tmp_path / "tokens_00003.bin"
    f.write_bytes(np.arange(6, dtype=np.uint16).tobytes())
    tokens = shard_read_module.ShardTokens("st", 3, str(f), np.uint16, 10)    # the file lost 4 of 10 tokens
    with pytest.raises(ShardDamage, match=r"shard 3: '.*tokens_00003.bin' ended early: reading 8 bytes at byte "
                                          r"offset 8 \(tokens 4 to 8\) gave 4; the file is 12 bytes now"):
        tokens.read_rows([0, 4], [4, 4])
    assert tokens[1:3].tolist() == [1, 2] and int(tokens[-5]) == 5
    with pytest.raises(IndexError, match="tokens \\[8, 12\\) of shard 3, which holds 10"):
        tokens.read(8, 4)


@pytest.mark.parametrize("packing", ["packed", "padded"])
def test_token_ids_outside_the_vocabulary_are_refused_when_read(built, tmp_path, packing):
    s = _copy(built, tmp_path)
    _strip_checksums(s)            # an old store: opens, nothing on open reads every token
    _edit(s, 0, 5, 300)            # the byte tokenizer's vocabulary is 257
    loader = TokenLoader(str(s), seq_len=8, global_batch=4, shuffle=False, packing=packing, prefetch=0)
    with pytest.raises(ShardDamage, match=r"shard 0: .*tokens_00000.bin' holds token id 300 at token 5, outside "
                                          "the store's vocabulary of 257"):
        loader.batch(0)
    assert loader.batch(loader.batches_per_epoch - 1)["inputs"].max() < 257     # other rows still read
    ahead = TokenLoader(str(s), seq_len=8, global_batch=4, shuffle=False, packing=packing, prefetch=2)
    with pytest.raises(ShardDamage, match="holds token id 300"):                 # from the prefetch thread
        next(ahead)
    ahead.close()


def test_checksums_are_recorded_and_checked_on_open(built, tmp_path, monkeypatch):
    s = _copy(built, tmp_path)
    entry = json.loads((s / "index.json").read_text())["shards"][0]
    assert entry["tokens_sha256"] == hashlib.sha256((s / "tokens_00000.bin").read_bytes()).hexdigest()   # = sha256sum
    assert entry["docs_sha256"] == hashlib.sha256((s / "docs_00000.npy").read_bytes()).hexdigest()
    original = (s / "tokens_00000.bin").read_bytes()
    _edit(s, 0, 7, 50)                                         # an id edited in the vocabulary, same size
    with pytest.raises(ShardDamage, match=r"tokens_00000.bin' holds other tokens than the index records \(its "
                                          "sampled SHA-256 differs\\)"):
        TokenStore(str(s))
    (s / "tokens_00000.bin").write_bytes(original)
    starts = np.load(s / "docs_00000.npy")
    starts[[1, 2]] = starts[[2, 1]]                            # document starts out of order
    np.save(s / "docs_00000.npy", starts)
    with pytest.raises(ShardDamage, match="docs_00000.npy' holds other document starts than the index records"):
        TokenStore(str(s))
    _strip_checksums(s)                                        # without checksums the order is still checked
    with pytest.raises(ShardDamage, match="docs_00000.npy' does not hold document starts sorted from 0"):
        TokenStore(str(s))
    # a large shard: opening hashes a sample only; verify_store hashes every token
    monkeypatch.setattr(store_module, "SAMPLE_BLOCKS", 2)
    monkeypatch.setattr(store_module, "SAMPLE_BYTES", 8)
    big = prepare([str(built / "a.txt")], str(tmp_path / "big"), **SIZES)
    assert verify_store(big.path) == []
    _edit(tmp_path / "big", 2, 100, 50)
    TokenStore(big.path)                                       # the edit is outside the sample
    (damage,) = verify_store(big.path)
    want = hashlib.sha256((tmp_path / "big" / "tokens_00002.bin").read_bytes()).hexdigest()
    assert damage.shard == 2 and f"its SHA-256 is {want}, index.json records " in damage.what


def test_verify_command(built, tmp_path, capsys):
    s = _copy(built, tmp_path)
    assert main(["data", "verify", str(s)]) == 0
    assert f"{s}: intact: " in capsys.readouterr().out
    _edit(s, 0, 3, 999)
    os.truncate(s / "tokens_00002.bin", 11)
    assert main(["data", "verify", str(s)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and "Traceback" not in "".join(lines)
    assert lines[0].startswith(f"jaxpar data: error: shard 0: '{s}/tokens_00000.bin' holds token id 999 at token 3")
    assert lines[1].startswith("jaxpar data: error: shard 2: ") and "is 11 bytes" in lines[1]
    old = _copy(built, tmp_path, "old")
    _strip_checksums(old)
    assert main(["data", "verify", str(old)]) == 0
    n = len(TokenStore(str(old)).shards)
    assert f"{old}: {n} shard(s), " in (out := capsys.readouterr().out) and f"but {n} shard(s) have no checksum" in out
    assert main(["data", "verify", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("jaxpar data: error: no token store index at")


def test_verify_names_an_edited_index_record_not_the_intact_shard(built, tmp_path, capsys):
    s = _copy(built, tmp_path)
    index = json.loads((s / "index.json").read_text())
    real = index["shards"][1]["tokens_sha256"]
    index["shards"][1]["tokens_sha256"] = "0" * 64                 # the record changed, the shard did not
    (s / "index.json").write_text(json.dumps(index))
    assert main(["data", "verify", str(s)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"jaxpar data: error: shard 1: '{s}/index.json' holds a record of shard 1 that does not "
                           "match its own checksum (record_sha256): index.json's record was changed")
    assert f"the record says tokens SHA-256 {'0' * 64}, the file '{s}/tokens_00001.bin' has {real}" in line
    with pytest.raises(ShardDamage, match="index.json' holds a record of shard 1 that does not match"):
        TokenStore(str(s))
    del index["shards"][1]["record_sha256"]                          # an index without record checksums
    (s / "index.json").write_text(json.dumps(index))
    (damage,) = verify_store(str(s))
    assert damage.what.startswith(f"holds other tokens than the index records: its SHA-256 is {real}, index.json "
                                  f"records {'0' * 64}; the file was edited or overwritten, or index.json's record")


@pytest.mark.parametrize("edit, words", [
    (lambda i: i.update(shards=5), "shards is 5, expected a list of shard records"),
    (lambda i: i.pop("dtype"), "dtype is None, expected 'uint16' or 'uint32'"),
    (lambda i: i["shards"][0].pop("num_tokens"), r"shards\[0\].num_tokens is None, expected an int >= 0"),
    (lambda i: i["shards"][2].update(tokens="../../etc/passwd"), r"shards\[2\].tokens is '../../etc/passwd', "
                                                                  "expected a file name in the store's directory"),
    (lambda i: i["tokenizer"].update(vocab_size="257"), "tokenizer.vocab_size is '257', expected an int >= 1"),
    (lambda i: i["shards"][1].update(tokens_sha256=7), r"shards\[1\].tokens_sha256 is 7, expected a SHA-256"),
])
def test_a_malformed_index_is_one_line_naming_the_field(built, tmp_path, capsys, edit, words):
    s = _copy(built, tmp_path)
    index = json.loads((s / "index.json").read_text())
    edit(index)
    (s / "index.json").write_text(json.dumps(index))
    for command in (["data", "verify", str(s)], ["train", "--config", str(_job(tmp_path, s)), "--quiet"]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert f"token store index '{s}/index.json' is malformed: " in err
        assert __import__("re").search(words, err), err
    (s / "index.json").write_text("[" * 100_000 + "]" * 100_000)     # nested too deep for the JSON reader
    assert main(["data", "verify", str(s)]) == 2
    assert "cannot be read (RecursionError" in capsys.readouterr().err


def _job(tmp_path, store):
    job = tmp_path / "job.yaml"
    job.write_text(f"model: {{name: llama, size: tiny}}\ndata: {{path: {store}, seq_len: 16, batch: 8}}\n"
                   "parallel: {mesh: {data: 8}}\ntrain: {steps: 1}\n")
    return job


class _Crash(ByteTokenizer):
    """The byte tokenizer, failing on its n-th call: a run interrupted mid-way."""

    def __init__(self, calls):
        self.calls = calls

    def encode_lines(self, lines):
        self.calls -= 1
        if self.calls < 0:
            raise KeyboardInterrupt
        return super().encode_lines(lines)


def test_gzip_inputs_are_decompressed_and_resume(built, tmp_path):
    text = (built / "a.txt").read_bytes()
    with gzip.open(tmp_path / "a.txt.gz", "wb") as f:
        f.write(text)
    plain = TokenStore(str(built / "store"))
    with pytest.raises(KeyboardInterrupt):
        prepare([str(tmp_path / "a.txt.gz")], str(tmp_path / "gz"), _Crash(3), **SIZES)
    assert 0 < len(json.loads((tmp_path / "gz" / "index.json").read_text())["shards"]) < len(plain.shards)
    gz = prepare([str(tmp_path / "a.txt.gz")], str(tmp_path / "gz"), **SIZES)    # resumed at a text offset
    assert gz.index["shards"] == plain.index["shards"]                          # the same tokens, checksums
    tokenizers = pytest.importorskip("tokenizers")
    assert tokenizers
    from jaxpar.data import train_tokenizer

    a = train_tokenizer([str(built / "a.txt")], 300, str(tmp_path / "a.json"))
    b = train_tokenizer([str(tmp_path / "a.txt.gz")], 300, str(tmp_path / "b.json"))
    assert a.sha256 == b.sha256


def test_binary_input_is_refused_naming_the_file(built, tmp_path, capsys):
    (tmp_path / "blob.bin").write_bytes(bytes(range(256)) * 40)
    (tmp_path / "latin1.txt").write_bytes("ok\ncaf\xe9\n".encode("latin-1"))
    (tmp_path / "late.txt").write_bytes(b"fine\n" * 3000 + b"\x00\n")          # past the first 8 KiB
    with pytest.raises(ValueError, match=r"input '.*blob.bin' is not text: a NUL byte at byte 0; .*--errors replace"):
        prepare([str(tmp_path / "blob.bin")], str(tmp_path / "s1"), progress=False)
    assert not (tmp_path / "s1").exists()                      # refused before anything is written
    with pytest.raises(ValueError, match=r"latin1.txt' is not text: byte 0xe9, not UTF-8, at byte 6"):
        prepare([str(tmp_path / "latin1.txt")], str(tmp_path / "s2"), progress=False)
    with pytest.raises(ValueError, match=r"late.txt' is not text: a NUL byte at byte 15000"):
        prepare([str(tmp_path / "late.txt")], str(tmp_path / "s3"), progress=False)
    kept = prepare([str(tmp_path / "latin1.txt")], str(tmp_path / "s4"), errors="replace", progress=False)
    assert ByteTokenizer().decode(kept.shards[0][0]) == "ok\ncaf\ufffd\n"
    head = bytearray(gzip.compress(b"x\n" * 100000))[:200]       # a gzip file cut short
    (tmp_path / "cut.gz").write_bytes(bytes(head))
    with pytest.raises(ValueError, match="input '.*cut.gz' is a damaged gzip file"):
        prepare([str(tmp_path / "cut.gz")], str(tmp_path / "s5"), progress=False)
    capsys.readouterr()
    assert main(["data", "prepare", str(tmp_path / "blob.bin"), "--out", str(tmp_path / "s6"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxpar data: error: input") and "blob.bin' is not text" in err and err.count("\n") == 1
    assert main(["data", "prepare", str(tmp_path / "latin1.txt"), "--out", str(tmp_path / "s7"), "--quiet",
                 "--errors", "replace"]) == 0


def test_prepare_out_and_os_errors_are_one_line(built, tmp_path, capsys):
    corpus = str(built / "a.txt")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=f"out='{tmp_path}/file' is a file; give a directory"):
        prepare([corpus], str(tmp_path / "file"), progress=False)
    for out, words in ((tmp_path / "file", "is a file"), (tmp_path / "file" / "sub", "which is a file")):
        assert main(["data", "prepare", corpus, "--out", str(out), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"jaxpar data: error: --out '{out}'") and words in err and err.count("\n") == 1
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full to fill a disk")
    out = tmp_path / "full"
    out.mkdir()
    os.symlink("/dev/full", out / "tokens_00000.bin.tmp")      # the first shard lands on a full "disk"
    args = ["data", "prepare", corpus, "--out", str(out), "--quiet", "--docs", "line", "--shard-tokens", "1500"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxpar data: error: stopped by the system: No space left on device")
    assert "run the same command again" in err and err.count("\n") == 1
    os.remove(out / "tokens_00000.bin.tmp")
    assert main(args) == 0 and verify_store(str(out)) == []


def test_docstring_examples_run():
    for module in (text_module, store_module, loader_module, shard_read_module):
        assert doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed == 0
