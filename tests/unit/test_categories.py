"""Token categories (METHODS: role, type8) as array lookups, against a token-by-token reference."""

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from actlake.batching import collate, Window
from actlake.categories import ROLE, TYPE8, Categorizer, type8_of


def reference(tok, ids: list[int]) -> tuple[list[str], list[int], list[int]]:
    """Texts, role ids and type8 ids of one window, token by token, straight from METHODS' definitions."""
    bos = tok.cls_token_id if getattr(tok, "cls_token_id", None) is not None else tok.bos_token_id
    eos = tok.sep_token_id if getattr(tok, "sep_token_id", None) is not None else tok.eos_token_id
    texts, roles, t8s = [], [], []
    for pos, tid in enumerate(ids):
        decoded = tok.decode([tid])
        if tid == bos and (pos == 0 or bos != eos):
            role = "bos"
        elif tid == eos:
            role = "eos"
        elif decoded.strip() in (".", ","):
            role = "period" if decoded.strip() == "." else "comma"
        else:
            role = "other"
        texts.append(tok.convert_ids_to_tokens(tid))
        roles.append(ROLE.index(role))
        t8s.append(TYPE8.index("other" if tid in tok.all_special_ids else type8_of(decoded)))
    return texts, roles, t8s


def windows_of(tok) -> list[Window]:
    texts = ["Hello, world. (A test)\n\n 42 tokens; [x] {y} <z>", "Numbers: 3.14, 2,718 ... and\tso on.",
             "short", "  leading spaces, trailing  "]
    out = []
    for i, t in enumerate(texts):
        ids = tok(t)["input_ids"]
        eos = tok.sep_token_id if getattr(tok, "sep_token_id", None) is not None else tok.eos_token_id
        if i == 1:  # the end token inside a window too (packed documents), and at position 0 of another
            ids = ids + [eos] + tok("more.", add_special_tokens=False)["input_ids"]
        if i == 2:
            ids = [eos] + ids
        out.append(Window(i, 0, ids, "s"))
    return out


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_batch_categories_equal_token_by_token_reference(family, tiny_models):
    """BERT ([CLS] ≠ [SEP]), GPT-2's tokenizer here (BOS = EOS, not prepended) and Llama's (BOS = EOS,
    prepended): the positional rule, the punctuation roles and type8, with padding 0, over two batches
    sharing a categorizer (the second judged partly from the first's entries)."""
    tok = AutoTokenizer.from_pretrained(tiny_models[family])
    cats = Categorizer(tok)
    windows = windows_of(tok)
    for batch in (windows[:2], windows):
        ids, mask = collate(batch, tok.pad_token_id)
        role, type8 = cats.batch(ids.numpy(), mask.sum(1).numpy())
        assert role.shape == type8.shape == ids.shape and role.dtype == type8.dtype == torch.int64
        for i, w in enumerate(batch):
            texts, roles, t8s = reference(tok, w.ids)
            T = len(w.ids)
            assert role[i, :T].tolist() == roles and type8[i, :T].tolist() == t8s
            assert not role[i, T:].any() and not type8[i, T:].any()
            assert cats.texts(w.ids) == texts
            assert cats.text_array(np.array(w.ids)).to_pylist() == texts
    seen = {r for w in windows for r in reference(tok, w.ids)[1]}
    assert {ROLE.index("bos"), ROLE.index("eos"), ROLE.index("period"), ROLE.index("comma")} <= seen


def test_ids_past_the_tokenizer_grow_the_tables(minilm_path):
    """An id the tokenizer's length does not cover (a model whose vocabulary is padded past it) is judged
    like any other, and the entries judged before stay."""
    tok = AutoTokenizer.from_pretrained(minilm_path)
    cats = Categorizer(tok)
    first = np.array([[tok.cls_token_id, 1012, tok.sep_token_id]])
    before, _ = cats.batch(first, np.array([3]))
    past = len(tok) + 5
    role, type8 = cats.batch(np.array([[tok.cls_token_id, past, 1012]]), np.array([3]))
    decoded = tok.decode([past])
    assert type8[0, 1] == TYPE8.index(type8_of(decoded)) and role[0, 2] == before[0, 1]
    assert cats.texts([past]) == [tok.convert_ids_to_tokens(past)]
