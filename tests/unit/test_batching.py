import pytest
import torch
from torch.nn.utils.rnn import pad_sequence

from actlake.batching import Window, collate, document_windows, documents_windows, make_batches, right_padded
from actlake.config import BatchingConfig, TokenizationConfig


def test_windows_split_with_stride_and_keep_special_tokens(minilm_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_path)
    text = " ".join(f"word{i}" for i in range(200))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    cfg = TokenizationConfig(max_length=16, overflow="split", stride=4, max_windows_per_doc=100)
    ws, cut = document_windows(tok, text, cfg)
    assert not cut
    assert all(w[0] == tok.cls_token_id and w[-1] == tok.sep_token_id and len(w) <= 16 for w in ws)
    body = [w[1:-1] for w in ws]
    assert body[0] == ids[:14] and body[1] == ids[10:24]  # 14-token bodies, 4 shared
    assert sum(len(b) for b in body) - 4 * (len(body) - 1) == len(ids)
    first, cut = document_windows(tok, text, TokenizationConfig(max_length=16, overflow="truncate"))
    assert len(first) == 1 and cut
    capped, cut = document_windows(tok, text, TokenizationConfig(max_length=16, max_windows_per_doc=3))
    assert len(capped) == 3 and cut


@pytest.mark.parametrize("kind", ["wordpiece", "byte-level BPE with BOS"])
def test_documents_tokenised_together_get_the_windows_each_gets_alone(kind, minilm_path, tmp_path):
    """Reading tokenises a run of records in one call (the interpreter lock released): same windows, same cuts
    as one call per record, the way reading tokenised before."""
    from transformers import AutoTokenizer

    from actlake.batching import CHARS_PER_TOKEN_CAP
    from tests.conftest import _bpe_tokenizer

    tok = AutoTokenizer.from_pretrained(minilm_path) if kind == "wordpiece" else _bpe_tokenizer(tmp_path, True)
    texts = [" ".join(f"word{i}" for i in range(n)) for n in (0, 1, 3, 40, 200)] + ["", "héllo wörld", "x" * 5000]
    cfg = TokenizationConfig(max_length=16, stride=4, max_windows_per_doc=5)
    together = documents_windows(tok, texts, cfg)
    assert together == [document_windows(tok, t, cfg) for t in texts]
    limit = (14 + 10 * 4) * CHARS_PER_TOKEN_CAP  # the characters documents_windows tokenises at most here
    listed = tok([t[:limit] for t in texts], add_special_tokens=False)["input_ids"]
    assert listed == [tok(t[:limit], add_special_tokens=False)["input_ids"] for t in texts]  # one str per call: as before
    assert [cut for _, cut in together] == [False] * 3 + [True] * 2 + [False] * 2 + [True]  # cut ones, empty ones
    assert together[0][0] == together[5][0] == []  # the empty texts


def test_prepend_bos_puts_the_bos_token_first_only_where_the_tokenizer_puts_no_special_token_first(minilm_path, tmp_path):
    """tokenization.prepend_bos: a GPT-2/Pythia-style tokenizer (nothing first) gets its BOS before each window,
    inside max_length; one that already starts with a special token ([CLS], BOS) is unchanged; none to put: an error."""
    from transformers import AutoTokenizer

    from actlake.errors import ConfigError
    from tests.conftest import _bpe_tokenizer

    text = " ".join(f"word{i}" for i in range(60))
    on, off = (TokenizationConfig(max_length=16, max_windows_per_doc=50, prepend_bos=b) for b in (True, False))
    plain = _bpe_tokenizer(tmp_path / "plain", False)
    ids = plain(text, add_special_tokens=False)["input_ids"]
    assert document_windows(plain, text, off)[0][0] == ids[:16]
    ws = document_windows(plain, text, on)[0]
    assert all(w[0] == plain.bos_token_id and len(w) == 16 for w in ws[:-1])
    assert [t for w in ws for t in w[1:]] == ids  # 15-token bodies, every token once
    for tok in (_bpe_tokenizer(tmp_path / "bos", True), AutoTokenizer.from_pretrained(minilm_path)):
        assert document_windows(tok, text, on) == document_windows(tok, text, off)
    plain.bos_token = None
    plain._actlake_affixes = None
    with pytest.raises(ConfigError, match=r"^'tokenization.prepend_bos': the tokenizer of .* has no BOS token"):
        document_windows(plain, text, on)
    # reading a shard: the job's error, not a tokenizer_error reject for every record
    import threading

    from actlake.config import parse_config
    from actlake.corpus.sample import write_sample
    from actlake.jobs.extract.plan import Shard
    from actlake.jobs.extract.read import read_shard

    (path,) = [p for p in write_sample(tmp_path / "corpus", n_docs=4, n_files=1) if str(p).endswith(".jsonl")]
    cfg = parse_config({"name": "j", "corpus": {"paths": [str(path)]}, "tokenization": {"prepend_bos": True}})
    with pytest.raises(ConfigError, match=r"^'tokenization.prepend_bos'"):
        read_shard(Shard(0, str(path), "jsonl", 0, 4, 0), cfg, plain, threading.Lock())


def test_batches_respect_budget_and_pad_little():
    windows = [Window(i, 0, list(range(5 + (i * 37) % 60)), "s") for i in range(200)]
    cfg = BatchingConfig(max_tokens=256, max_batch_size=16)
    batches = make_batches(windows, cfg)
    assert sorted((w.doc_id for b in batches for w in b)) == list(range(200))
    real = padded = 0
    for b in batches:
        T = max(len(w.ids) for w in b)
        assert len(b) * T <= 256 and len(b) <= 16
        real += sum(len(w.ids) for w in b)
        padded += len(b) * T - sum(len(w.ids) for w in b)
        ids, mask = collate(b, pad_id=0)
        assert ids.shape == (len(b), T) and mask.sum() == sum(len(w.ids) for w in b)
    assert padded / real < 0.1


def test_collate_and_right_padded_match_torch_pad_sequence():
    rows = [list(range(7, 7 + (i * 13) % 9)) for i in range(12)]  # lengths 0..8, one empty row
    batch = [Window(i, 0, r, "s") for i, r in enumerate(rows) if r]
    ids, mask = collate(batch, pad_id=-3)
    ref = pad_sequence([torch.tensor(w.ids) for w in batch], batch_first=True, padding_value=-3)
    assert ids.dtype == torch.long and torch.equal(ids, ref)
    ref_mask = pad_sequence([torch.ones(len(w.ids), dtype=torch.long) for w in batch], batch_first=True)
    assert mask.dtype == torch.long and torch.equal(mask, ref_mask)
    padded = right_padded(rows, 0)  # the empty row too
    assert padded.shape == (12, 8) and torch.equal(padded, pad_sequence(
        [torch.tensor(r, dtype=torch.long) for r in rows], batch_first=True))
