"""Incremental detokenizer, stop strings and chat templates with real (trained-in-test) tokenizers."""
import json

import numpy as np
import pytest

from jaxserve.errors import InvalidRequestError
from jaxserve.engine.tokenizer import (IncrementalDetokenizer, apply_chat_template, check_stop_strings,
                                decode_token, stop_buffer_length)

CORPUS = [
    "héllo wörld — naïve café, déjà vu. 日本語のテキストです。 🙂🚀 emoji! ελληνικά, русский текст",
    "the quick brown fox jumps over the lazy dog; STOP words and ### markers",
    "Ünïcödé ∑∫√ ≠ ≤ mixed with ASCII 12345 and tabs\tand\nnewlines",
] * 30
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def _byte_level():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def _sentencepiece_like():
    """Llama-2 style: metaspace '▁', byte fallback tokens <0xNN>, decoder strips one leading space."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.train_from_iterator([c for c in CORPUS if "日" not in c], trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS))
    state = json.loads(tok.to_str())["model"]
    vocab = dict(state["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in state["merges"]]
    sp = Tokenizer(models.BPE(vocab, merges, byte_fallback=True, fuse_unk=True))
    sp.normalizer = tok.normalizer
    sp.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    sp.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=sp, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def bl():
    return _byte_level()


@pytest.fixture(scope="module")
def spl():
    return _sentencepiece_like()


def _dec(tok, ids, skip=True):
    return tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def _check_stream(tok, prompt, out, skip=True, chunk=1):
    """At every step the text is a prefix of the final decode and equals the decode so far
    whenever that has no open character; at the end it equals the final decode."""
    # a prompt that ends inside a character: that character counts as prompt (as in vLLM), so
    # the reference below only holds for prompts that decode cleanly; trim such prompts
    while prompt and _dec(tok, prompt, skip).endswith("\ufffd"):
        prompt = prompt[:-1]
    det = IncrementalDetokenizer(tok, prompt, skip, True)
    base = _dec(tok, prompt, skip)
    final = _dec(tok, prompt + out, skip)
    assert final.startswith(base)
    final = final[len(base):]
    joined = ""
    for i in range(0, len(out), chunk):
        joined += det.add_tokens(out[i:i + chunk])
        assert joined == det.text
        assert final.startswith(det.text), (det.text, final)
        full = _dec(tok, prompt + out[:i + chunk], skip)
        if "\ufffd" not in full:
            assert det.text == full[len(base):], (out[:i + chunk], det.text, full)
    if not final.endswith("\ufffd"):
        assert det.text == final
    return det


def test_byte_level_really_splits_characters(bl):
    ids = bl.encode("日本語🙂🚀")
    assert any(bl.decode([i]).endswith("\ufffd") for i in ids)  # the test below means something


@pytest.mark.parametrize("skip", [True, False])
def test_detokenizer_matches_decode_on_text(bl, skip):
    for text in CORPUS[:3]:
        ids = bl.encode(text)
        for cut in (0, 3, len(ids) // 2):
            _check_stream(bl, ids[:cut], ids[cut:], skip)
    # with special tokens in the middle and a chunked feed
    ids = bl.encode("<|im_start|>ün 日本</s>🙂 ok<|im_end|>")
    _check_stream(bl, ids[:2], ids[2:], skip)
    _check_stream(bl, ids[:1], ids[1:], skip, chunk=3)


def test_detokenizer_random_sequences(bl):
    rng = np.random.default_rng(0)
    multibyte = [i for i in range(len(bl)) if "\ufffd" in bl.decode([i])]
    assert multibyte
    for trial in range(40):
        n = int(rng.integers(1, 40))
        pool = multibyte if trial % 2 else list(range(len(bl)))
        out = [int(rng.choice(pool)) for _ in range(n)]
        prompt = [int(t) for t in rng.integers(0, len(bl), size=int(rng.integers(0, 8)))]
        _check_stream(bl, prompt, out, skip=bool(trial % 3))


def test_detokenizer_sentencepiece_spaces_and_byte_fallback(spl):
    assert any(spl.convert_ids_to_tokens(i).startswith("<0x") for i in spl.encode("日本"))
    rng = np.random.default_rng(1)
    for text in ["Hello world, naïve café", "日本 text 🙂 ok", CORPUS[1]]:
        ids = spl.encode(text)
        for cut in (0, 1, len(ids) // 2):
            _check_stream(spl, ids[:cut], ids[cut:])
    # random strings (byte-fallback decoding is per group of byte tokens, not self-synchronising,
    # so random *ids* may decode differently in windows; real text must not)
    alphabet = sorted(set("".join(CORPUS))) + list("日本語🙂🚀")
    for _ in range(20):
        text = "".join(rng.choice(alphabet, size=int(rng.integers(1, 30))))
        _check_stream(spl, spl.encode("prompt text"), spl.encode(text)[1:])
    # the first generated word keeps its space after a prompt (decode alone would strip it)
    prompt, word = spl.encode("Hello"), spl.encode("Hello world")[len(spl.encode("Hello")):]
    det = IncrementalDetokenizer(spl, prompt)
    det.add_tokens(word)
    assert det.text == " world"


def test_detokenizer_tracks_ids_and_long_outputs(bl):
    ids = bl.encode(" ".join(CORPUS[:3]) * 12)
    det = _check_stream(bl, [], ids[:40])
    for t in ids[40:]:
        det.add_tokens([t])
    assert det.output_token_ids == ids
    assert det.text == _dec(bl, ids)  # window trimming keeps long outputs right


def test_check_stop_strings_semantics():
    # found in the new delta: excluded by default, kept with include_stop_str_in_output
    assert check_stop_strings("abc STOP", 5, ["STOP"], False) == ("STOP", 4)
    assert check_stop_strings("abc STOP", 5, ["STOP"], True) == ("STOP", None)
    assert check_stop_strings("abc STOP tail", 9, ["STOP"], True) == ("STOP", 8)
    assert check_stop_strings("abc STOP tail", 9, ["STOP"], False) == ("STOP", 4)
    # spanning the boundary: only "P" is new
    assert check_stop_strings("abc STOP", 1, ["STOP"], False) == ("STOP", 4)
    # already-searched text is not searched again
    assert check_stop_strings("STOP abc d", 1, ["STOP"], False) is None
    assert check_stop_strings("abc", 0, ["a"], False) is None
    assert check_stop_strings("abc", 2, [], False) is None
    # earliest match wins when two complete in one delta
    assert check_stop_strings("x ## yy", 6, ["yy", "##"], False) == ("##", 2)
    assert stop_buffer_length(["ab", "abcd"], False) == 3
    assert stop_buffer_length(["ab"], True) == 0 and stop_buffer_length(None, False) == 0


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(bl, include):
    text = "the quick brown fox jumps over the lazy dog"
    ids = bl.encode(text)
    stop = "own fox ju"
    toks = [bl.decode([i]) for i in ids]
    assert not any(stop in t for t in toks)  # it really spans several tokens
    det = IncrementalDetokenizer(bl, [])
    hit = None
    for n, t in enumerate(ids):
        delta = det.add_tokens([t])
        hit = check_stop_strings(det.text, len(delta), [stop, "zzz"], include)
        if hit:
            break
    assert hit is not None and hit[0] == stop
    cut = det.text if hit[1] is None else det.text[:hit[1]]
    assert cut == ("the quick brown fox ju" if include else "the quick br")
    assert n < len(ids) - 1  # stopped early


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_apply_chat_template(bl):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo"}]
    with pytest.raises(InvalidRequestError) as e:
        apply_chat_template(bl, msgs)
    assert e.value.param == "chat_template"
    ids = apply_chat_template(bl, msgs, chat_template=CHATML)
    text = bl.decode(ids)
    assert text.endswith("<|im_start|>assistant\n") and "héllo" in text
    assert ids.count(bl.convert_tokens_to_ids("<|im_start|>")) == 3  # special tokens, not text
    no_gen = apply_chat_template(bl, msgs, add_generation_prompt=False, chat_template=CHATML)
    assert ids[:len(no_gen)] == no_gen and len(no_gen) < len(ids)
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                          "text": "b"}]}]
    assert "a\nb" in bl.decode(apply_chat_template(bl, parts, chat_template=CHATML))


@pytest.mark.parametrize("messages", [
    [], "hi", [{"content": "x"}], [{"role": "", "content": "x"}], ["hi"], [{"role": "user"}],
    [{"role": "user", "content": 5}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
])
def test_malformed_messages(bl, messages):
    with pytest.raises(InvalidRequestError) as e:
        apply_chat_template(bl, messages, chat_template=CHATML)
    assert e.value.param == "messages"


def test_template_exception_is_invalid_request(bl):
    tpl = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}x"
    with pytest.raises(InvalidRequestError) as e:
        apply_chat_template(bl, [{"role": "assistant", "content": "x"}], chat_template=tpl)
    assert e.value.param == "messages" and "first must be user" in str(e.value)


def test_decode_token(bl):
    eos = bl.convert_tokens_to_ids("</s>")
    assert decode_token(bl, eos) == "</s>"
    for i in bl.encode("café 日本"):
        assert decode_token(bl, i) == bl.decode([i])


def test_backend_decoder_taken_for_plain_fast_tokenizers_only(bl, spl):
    """The detokenizer decodes through the ``tokenizers`` backend when that is what
    ``tokenizer.decode`` does (so the stream tests above compare the two), and through the
    wrapper when a subclass overrides decoding."""
    from jaxserve.engine.tokenizer import backend_decoder

    rng = np.random.default_rng(1)
    for tok in (bl, spl):
        dec = backend_decoder(tok)
        assert dec is not None
        for _ in range(50):
            ids = [int(t) for t in rng.integers(0, len(tok), size=int(rng.integers(1, 20)))]
            for skip in (True, False):
                assert dec(ids, skip_special_tokens=skip) == _dec(tok, ids, skip)

    class Shouting(type(bl)):
        def _decode(self, *a, **kw):
            return super()._decode(*a, **kw).upper()

    loud = Shouting(tokenizer_object=bl.backend_tokenizer, bos_token="<s>", eos_token="</s>")
    assert backend_decoder(loud) is None
    det = IncrementalDetokenizer(loud, [], True, True)
    ids = bl.encode("the quick brown fox")
    det.add_tokens(ids)
    assert det.text == "THE QUICK BROWN FOX"
