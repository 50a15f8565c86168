"""Token stores and the TokenLoader: prepare (resumable), determinism, resume, per-process rows,
bad input, and Trainer.fit resuming a loader from a checkpoint (tiny Llama, 8 devices)."""

import json

import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.cli import main
from jaxpar.data import ByteTokenizer, LoaderProcess, TokenLoader, TokenStore, prepare
from jaxpar.models.data import arithmetic_text
from jaxpar.models.llama import Llama, LlamaConfig, loss_fn

SEQ, BATCH = 16, 8
BIG = 96          # 13 batches an epoch: 20 batches cross an epoch boundary


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    files = []
    for k, lines in enumerate((1500, 700)):
        path = root / f"part{k}.txt"
        path.write_text(arithmetic_text(lines, seed=k))
        files.append(str(path))
    return root, files


@pytest.fixture(scope="module")
def store(corpus):
    root, files = corpus
    return prepare(files, str(root / "store"), docs="line", shard_tokens=4000, chunk_bytes=1000, progress=False)


def test_prepare_splits_documents_and_shards(store, corpus):
    _, files = corpus
    text = "".join(open(f).read() for f in files)
    assert store.num_docs == text.count("\n") and len(store.shards) > 2
    tokens = np.concatenate([t for t, _ in store.shards])
    assert ByteTokenizer().decode(tokens) == text.replace("\n", "")            # eos (256) between lines
    assert int((tokens == store.eos_id).sum()) == store.num_docs and store.dtype == np.uint16
    for t, starts in store.shards:                                             # each doc starts after an eos
        assert starts[0] == 0 and (np.asarray(t)[starts[1:] - 1] == store.eos_id).all()


class _Crash(ByteTokenizer):
    """The byte tokenizer, failing on its n-th call: a run interrupted mid-way."""

    def __init__(self, calls):
        self.calls = calls

    def encode(self, text):
        self.calls -= 1
        if self.calls < 0:
            raise KeyboardInterrupt
        return super().encode(text)


def test_interrupted_prepare_resumes_to_the_same_files(corpus, tmp_path):
    _, files = corpus
    sizes = dict(shard_tokens=3000, chunk_bytes=2000, progress=False)
    whole = prepare(files, str(tmp_path / "whole"), docs="file", **sizes)
    with pytest.raises(KeyboardInterrupt):
        prepare(files, str(tmp_path / "again"), _Crash(8), docs="file", **sizes)
    with pytest.raises(ValueError, match="unfinished"):
        TokenStore(str(tmp_path / "again"))
    written = len(json.loads((tmp_path / "again" / "index.json").read_text())["shards"])
    assert 0 < written < len(whole.shards)
    again = prepare(files, str(tmp_path / "again"), docs="file", **sizes)
    assert again.index == whole.index and again.fingerprint == whole.fingerprint
    for (a, da), (b, db) in zip(whole.shards, again.shards):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(da, db)
    ends = sum(int((np.asarray(t) == whole.eos_id).sum()) for t, _ in whole.shards)
    assert ends == 2 and len(whole.shards) > 2                    # docs="file": one document per file
    with pytest.raises(ValueError, match="already holds a token store with docs"):
        prepare(files, str(tmp_path / "again"), docs="line", **sizes)


def _batches(loader, n):
    return [next(loader) for _ in range(n)]


def _same(a, b):
    return all(np.array_equal(x[k], y[k]) for x, y in zip(a, b, strict=True) for k in x)


def test_same_seed_same_batches_and_resume_at_10(store):
    loader = TokenLoader(store, seq_len=SEQ, global_batch=BIG, seed=3, prefetch=3)
    first = _batches(loader, 20)
    assert loader.batches_per_epoch < 20               # the run crosses an epoch boundary
    assert _same(first, _batches(TokenLoader(store, seq_len=SEQ, global_batch=BIG, seed=3, prefetch=0), 20))
    assert not _same(first[:1], _batches(TokenLoader(store, seq_len=SEQ, global_batch=BIG, seed=4), 1))
    stopped = TokenLoader(store, seq_len=SEQ, global_batch=BIG, seed=3)
    _batches(stopped, 10)
    saved = json.loads(json.dumps(stopped.state()))    # what a checkpoint keeps
    resumed = TokenLoader(store, seq_len=SEQ, global_batch=BIG, seed=3)
    resumed.restore(saved)
    assert saved["next_batch"] == 10 and _same(first[10:], _batches(resumed, 10))
    with pytest.raises(ValueError, match="seed=3 but this loader has seed=5"):
        TokenLoader(store, seq_len=SEQ, global_batch=BIG, seed=5).restore(saved)


def test_each_epoch_visits_every_sequence_once(store):
    loader = TokenLoader(store, seq_len=SEQ, global_batch=BATCH, seed=0)
    e0, e1 = loader.order(0), loader.order(1)
    assert sorted(e0) == list(range(loader.num_examples)) and not np.array_equal(e0, e1)
    n = loader.batches_per_epoch
    assert not np.array_equal(loader.batch(n)["inputs"], loader.batch(0)["inputs"])


@pytest.mark.parametrize("packing", ["packed", "padded"])
def test_process_rows_assemble_the_global_batch(store, packing):
    full = TokenLoader(store, seq_len=SEQ, global_batch=BATCH, packing=packing, seed=1)
    for count in (2, 4):
        parts = [TokenLoader(store, seq_len=SEQ, global_batch=BATCH, packing=packing, seed=1,
                             process=LoaderProcess(index=p, count=count)).batch(7) for p in range(count)]
        for key, value in full.batch(7).items():
            np.testing.assert_array_equal(np.concatenate([part[key] for part in parts]), value)


def test_the_former_process_keywords_warn_and_read_the_same_rows(store):
    """0.1.0's ``TokenLoader(..., process_index=, process_count=)`` still reads the same rows, warning
    with the ``LoaderProcess`` spelling; mixing both spellings is refused naming both."""
    want = TokenLoader(store, seq_len=SEQ, global_batch=BATCH, seed=1, process=LoaderProcess(index=1, count=2))
    with pytest.warns(DeprecationWarning, match=r"TokenLoader\(store, \*, seq_len.*process_count=None\) is deprecated: "
                                                r"call TokenLoader\(store, \.\.\., process=jaxpar.data.LoaderProcess"):
        got = TokenLoader(store, seq_len=SEQ, global_batch=BATCH, seed=1, process_index=1, process_count=2)
    assert got.rows == want.rows == slice(4, 8)
    np.testing.assert_array_equal(got.batch(3)["inputs"], want.batch(3)["inputs"])
    with pytest.warns(DeprecationWarning):
        assert TokenLoader(store, seq_len=SEQ, global_batch=BATCH, process_count=1).rows == slice(0, BATCH)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'process'.*in the former form"):
        TokenLoader(store, seq_len=SEQ, global_batch=BATCH, process=LoaderProcess(), process_index=0)


def test_segments_follow_documents(store):
    b = TokenLoader(store, seq_len=SEQ, global_batch=BATCH, packing="packed").batch(2)
    after_eos = np.concatenate([np.zeros((BATCH, 1), bool), b["inputs"][:, :-1] == store.eos_id], axis=1)
    assert (np.diff(b["segment_ids"], axis=1) == after_eos[:, 1:]).all() and (b["segment_ids"][:, 0] == 1).all()
    np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
    p = TokenLoader(store, seq_len=SEQ, global_batch=BATCH, packing="padded").batch(2)
    valid = p["segment_ids"].sum(1)                           # one document per row, then padding (0)
    assert ((p["segment_ids"] == 0) | (p["segment_ids"] == 1)).all() and (valid >= 1).all()
    for row, n in zip(p["targets"], valid):
        assert row[n - 1] == store.eos_id or n == SEQ          # a whole line ends in its eos


def test_bad_input_names_the_file_or_value(store, corpus, tmp_path):
    tiny = LlamaConfig.named("tiny", vocab_size=264)
    with pytest.raises(ValueError, match=f"no token store index at '{tmp_path}/index.json'"):
        TokenLoader(str(tmp_path), seq_len=SEQ, global_batch=BATCH)
    with pytest.raises(ValueError, match="seq_len=32 is longer than the model's max_seq_len=16"):
        TokenLoader(store, seq_len=32, global_batch=BATCH, model_config=tiny)
    with pytest.raises(ValueError, match="vocabulary of 257 tokens but the model's vocab_size is 64"):
        TokenLoader(store, seq_len=SEQ, global_batch=BATCH, model_config=LlamaConfig.named("tiny"))
    with pytest.raises(ValueError, match="seq_len=5000 is longer than the data: .* holds 4"):
        TokenLoader(store, seq_len=5000, global_batch=BATCH)
    with pytest.raises(ValueError, match="fewer than global_batch=4096"):
        TokenLoader(store, seq_len=SEQ, global_batch=4096)
    with pytest.raises(ValueError, match="global_batch=6 does not split over 4 processes"):   # its own name
        TokenLoader(store, seq_len=SEQ, global_batch=6, process=LoaderProcess(index=0, count=4))
    with pytest.raises(ValueError, match=r"LoaderProcess: index=4 must be in 0..3 \(count=4\)"):
        LoaderProcess(index=4, count=4)
    with pytest.raises(ValueError, match=r"LoaderProcess: count=0 must be an int >= 1, or None"):
        LoaderProcess(index=0, count=0)
    with pytest.raises(TypeError, match=r"LoaderProcess: index='0' must be an int >= 0, or None"):
        LoaderProcess(index="0", count=2)
    with pytest.raises(TypeError, match=r"process=\(1, 2\) must be a jaxpar.data.LoaderProcess\(index="):
        TokenLoader(store, seq_len=SEQ, global_batch=BATCH, process=(1, 2))
    # numpy integers are taken as ints: the position stays JSON (json.dumps failed on an int64 seed)
    loader = TokenLoader(store, seq_len=np.int64(SEQ), global_batch=np.int32(BATCH), seed=np.int64(3), prefetch=0)
    assert json.loads(json.dumps(loader.state()))["seed"] == 3
    with pytest.raises(ValueError, match=r"batch index i=-1 must be an int >= 0"):
        loader.batch(-1)                     # was numpy's "expected non-negative integer"
    with pytest.raises(TypeError, match=r"shuffle='no' must be True or False"):
        TokenLoader(store, seq_len=SEQ, global_batch=BATCH, shuffle="no")       # was shuffle=True
    with pytest.raises(TypeError, match=r"store=5 must be a TokenStore or the path of one"):
        TokenLoader(5, seq_len=SEQ, global_batch=BATCH)
    (tmp_path / "blank.txt").write_text("\n\n")      # docs="line": no document, no shard at all
    blank = prepare([str(tmp_path / "blank.txt")], str(tmp_path / "blank"), docs="line", progress=False)
    with pytest.raises(ValueError, match="no document of .* has 2 tokens or more"):   # was numpy's concatenate
        TokenLoader(blank, seq_len=SEQ, global_batch=1, packing="padded")
    with pytest.raises(TypeError, match=r"prepare: inputs='.*blank.txt' is one path; pass a list of paths"):
        prepare(str(tmp_path / "blank.txt"), str(tmp_path / "one"), progress=False)   # was "input '/' is not a file"
    tokenizers = pytest.importorskip("tokenizers")
    assert tokenizers
    root, files = corpus
    assert main(["data", "prepare", *files, "--out", str(tmp_path / "bpe"), "--train-tokenizer", "300",
                 "--docs", "line", "--quiet"]) == 0
    bpe = TokenStore(str(tmp_path / "bpe"))
    assert bpe.tokenizer_identity["kind"] == "huggingface" and bpe.num_tokens < store.num_tokens
    assert bpe.tokenizer().decode(bpe.shards[0][0][:7]).startswith(open(files[0]).readline().strip()[:5])
    with pytest.raises(ValueError, match=f"token store '{tmp_path}/bpe/index.json' was built with tokenizer"):
        TokenLoader(bpe, seq_len=SEQ, global_batch=BATCH, tokenizer=ByteTokenizer())


def test_prepare_command_refuses_a_missing_input_in_one_paragraph(tmp_path, capsys):
    assert main(["data", "prepare", str(tmp_path / "none.txt"), "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxpar data: error: input") and "Traceback" not in err


@pytest.mark.slow     # ~12 s of CPU; 30 s wall on a busy 2-core machine (compile, two saves)
def test_fit_resumes_the_loader_from_a_checkpoint(store, tmp_path):
    """Stop at step 10, save, resume: the same losses as 20 uninterrupted steps. The resume
    restores the step-10 checkpoint into the trainer that ran on (one compile, not two)."""
    config = jaxpar.ParallelConfig(mesh={"data": 8}, mode="data")
    cfg = LlamaConfig.named("tiny", vocab_size=264)
    trainer = jaxpar.Trainer(Llama(cfg, rngs=nnx.Rngs(0)), optax.adamw(3e-3), loss_fn, config,
                             jaxpar.make_mesh(config), checkpoint_dir=str(tmp_path), save_every=10, keep=None)
    loader = lambda: TokenLoader(store, seq_len=SEQ, global_batch=BATCH, seed=7, model_config=cfg)
    with trainer:
        whole = [r["loss"] for r in trainer.fit(loader(), 20, progress=False)]
        assert trainer.data_state["next_batch"] == 20 and whole[-1] < whole[0]
        meta = trainer.restore(step=10)                 # as a restarted job would: the step-10 save
        assert meta["data_state"]["next_batch"] == 10 and trainer.step_count == 10
        again = [r["loss"] for r in trainer.fit(loader(), 10, progress=False)]   # a fresh loader at 0
    np.testing.assert_allclose(again, whole[10:], rtol=1e-6)
    assert trainer.data_state["next_batch"] == 20
