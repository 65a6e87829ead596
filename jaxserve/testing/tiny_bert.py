"""Tiny random BERT checkpoints for tests: an embedder laid out as a sentence-transformers
directory (MEAN pooling, a Dense module, Normalize) and a cross-encoder
(``BertForSequenceClassification``), with a small WordPiece tokenizer."""
from __future__ import annotations

import json
from pathlib import Path

WORDS = ("the a an is was be to of and in on at for with by from cat dog sat mat ran fast "
         "slow red blue green big small house tree car road city paris london france capital "
         "what where who how why when query document answer question rain sun cloud").split()


def _vocab() -> list[str]:
    return ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS + [
        "##s", "##ed", "##ing", "##ly"] + list("abcdefghijklmnopqrstuvwxyz.,?!")


def _bert_config(**kw):
    from transformers import BertConfig

    return BertConfig(vocab_size=len(_vocab()), hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                      type_vocab_size=2, hidden_act="gelu", **kw)


def _save_tokenizer(out: Path) -> None:
    from transformers import BertTokenizer  # transformers 5: the tokenizers-backed class

    tok = BertTokenizer(vocab={w: i for i, w in enumerate(_vocab())}, do_lower_case=True,
                        model_max_length=64)
    tok.save_pretrained(str(out))


def make_tiny_st_embedder(out, *, seed: int = 0, pooling: str = "mean", dense: bool = True,
                          max_seq_length: int = 48) -> Path:
    """A sentence-transformers directory: BertModel + Pooling(``pooling``) [+ Dense(32->16,
    Tanh)] + Normalize."""
    import torch
    from safetensors.torch import save_file
    from transformers import BertModel

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    BertModel(_bert_config()).eval().save_pretrained(str(out))
    _save_tokenizer(out)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 32, "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_lasttoken": pooling == "last"}))
    if dense:
        (out / "2_Dense").mkdir(exist_ok=True)
        (out / "2_Dense" / "config.json").write_text(json.dumps({
            "in_features": 32, "out_features": 16, "bias": True,
            "activation_function": "torch.nn.modules.activation.Tanh"}))
        g = torch.Generator().manual_seed(seed + 1)
        save_file({"linear.weight": torch.randn(16, 32, generator=g) * 0.3,
                   "linear.bias": torch.randn(16, generator=g) * 0.1},
                  str(out / "2_Dense" / "model.safetensors"))
        modules.append({"idx": 2, "name": "2", "path": "2_Dense",
                        "type": "sentence_transformers.models.Dense"})
    modules.append({"idx": len(modules), "name": str(len(modules)), "path": "3_Normalize",
                    "type": "sentence_transformers.models.Normalize"})
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "sentence_bert_config.json").write_text(json.dumps(
        {"max_seq_length": max_seq_length, "do_lower_case": False}))
    return out


def make_tiny_cross_encoder(out, *, seed: int = 0, num_labels: int = 1) -> Path:
    """A ``BertForSequenceClassification`` with ``num_labels`` outputs."""
    import torch
    from transformers import BertForSequenceClassification

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    # a wide init: each pair's score depends on its text enough that no order is decided by
    # rounding (BERT's 0.02 leaves a random model's CLS state nearly constant)
    model = BertForSequenceClassification(_bert_config(num_labels=num_labels,
                                                       initializer_range=0.1)).eval()
    model.save_pretrained(str(out))
    _save_tokenizer(out)
    return out
