"""Which models can draft for which: the fingerprint's verdict against llama.cpp's own check
(common_speculative_are_compatible: vocabulary type, BOS/EOS ids and add flags as llama.cpp loads them,
sizes within 128, token texts from id 5), damaged headers and caches as one-line errors, a bridged pair
(different vocabulary sizes) token for token the target alone, and the session's bad -m/-md input."""
import json
import os
import struct
import time
from pathlib import Path

import gguf
import llama_cpp
import numpy as np
import pytest
from click.testing import CliRunner

from ggufspec import SpeculativeDecoder
from ggufspec.cli import main
from ggufspec.errors import IncompatibleModelsError, ModelFileError
from ggufspec.finddraft import check_draft, choose_draft
from ggufspec.fingerprint import FINGERPRINTS_FILE, differences, fingerprint_of_bytes, read_fingerprint
from ggufspec.tinymodels import Shape, _finish, _write_transformer_dims, make_weights, vocabulary
from reference import prompts

KEEP = object()


def write(path, tokens=None, types=None, *, model="llama", pre=None, bos=1, eos=2, eot=None, add_bos=KEEP,
          add_eos=KEEP, n_layer=1, weights=None, merges=None):
    """A tiny llama-architecture GGUF whose tokenizer keys are as given (None: the key left out)."""
    base, base_types = vocabulary()
    tokens, types = tokens or base, types or base_types
    shape = Shape(n_layer=n_layer)
    if weights is None:
        weights = make_weights(shape, seed=0)
        for name in ("token_embd.weight", "output.weight"):
            weights[name] = np.resize(weights[name], (len(tokens), shape.n_embd))
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    if model == "llama":
        writer.add_token_scores([0.0] * 3 + [-1000.0] * 256 + [-float(i) for i in range(len(tokens) - 259)])
    if merges is not None:
        writer.add_token_merges(merges)
    writer.add_token_types(types)
    for value, add in ((bos, writer.add_bos_token_id), (eos, writer.add_eos_token_id), (eot, writer.add_eot_token_id)):
        if value is not None:
            add(value)
    for value, add, default in ((add_bos, writer.add_add_bos_token, True), (add_eos, writer.add_add_eos_token, False)):
        if value is not None:
            add(default if value is KEEP else value)
    _write_transformer_dims(writer, shape)
    writer.add_rope_dimension_count(shape.n_embd // shape.n_head)
    return _finish(writer, weights, Path(path))


def llama_cpp_special(path):
    """(vocab type, BOS, EOS, add-BOS, add-EOS) as llama.cpp loads them."""
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    try:
        v = llama_cpp.llama_model_get_vocab(llm.model)
        return (llama_cpp.llama_vocab_type(v), llama_cpp.llama_vocab_bos(v), llama_cpp.llama_vocab_eos(v),
                bool(llama_cpp.llama_vocab_get_add_bos(v)), bool(llama_cpp.llama_vocab_get_add_eos(v)))
    finally:
        llm.close()


def test_special_ids_left_out_or_out_of_range_pair_as_llama_cpp_loads_them(tmp_path):
    """A conversion without tokenizer.ggml.bos/eos_token_id (or naming an id past the vocabulary) gets
    llama.cpp's default (SPM: 1 and 2): such a draft pairs with one that names them (was 'BOS id None vs 1')."""
    target = write(tmp_path / "target.gguf", n_layer=2)
    for name, keys in (("no-bos", {"bos": None}), ("no-eos", {"eos": None}), ("bos-past", {"bos": 99999}),
                       ("eos-past", {"eos": 99999}), ("no-flags", {"add_bos": None, "add_eos": None})):
        draft = write(tmp_path / f"{name}.gguf", **keys)
        assert llama_cpp_special(draft) == llama_cpp_special(target), name
        assert differences(read_fingerprint(target), read_fingerprint(draft), target, draft) == [], name
        check_draft(target, draft)
    with SpeculativeDecoder(target, tmp_path / "no-bos.gguf", n_ctx=64, n_threads=1) as decoder:  # llama.cpp's check
        assert decoder.generate([1, 260, 261], n_predict=4, n_draft=2).stats.stop_reason != "error"


def test_what_llama_cpp_does_not_compare_does_not_keep_a_draft_out(tmp_path):
    """llama.cpp pairs models whose pre-tokenizers differ, or whose EOS differs where none is added (a
    base draft's <|endoftext|> for an instruct target's <|im_end|>): the draft reads the target's ids and
    the target alone decides the end. They were refused here ('EOS id 3 vs 2'); the greedy text is the
    target alone's. An EOS that is added still keeps them apart, in both checks."""
    target = write(tmp_path / "target.gguf", n_layer=2)
    for name, keys in (("eos3", {"eos": 3}), ("pre", {"pre": "smaug-bpe"})):
        draft = write(tmp_path / f"{name}.gguf", **keys)
        assert differences(read_fingerprint(target), read_fingerprint(draft), target, draft) == [], name
        check_draft(target, draft)
        with SpeculativeDecoder(target, draft, n_ctx=64, n_threads=1, strict=True) as decoder:
            alone = decoder.generate([1, 260, 261], n_predict=12, n_draft=0)
            drafted = decoder.generate([1, 260, 261], n_predict=12, n_draft=3)
        assert drafted.tokens == alone.tokens and drafted.stats.n_drafted > 0, name
    adding, adding_other = (write(tmp_path / f"add-{eos}.gguf", eos=eos, add_eos=True) for eos in (2, 3))
    with pytest.raises(IncompatibleModelsError, match="EOS id 3 vs 2"):
        check_draft(adding, adding_other)
    with pytest.raises(IncompatibleModelsError, match="EOS ids differ"):
        SpeculativeDecoder(adding, adding_other, n_ctx=64, n_threads=1).close()


def byte_level_tokens():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:] + [256 + n for n in range(256 - len(bs))]
    bs += [b for b in range(256) if b not in bs]
    return [chr(c) for _, c in sorted(zip(bs, cs))] + ["Ġthe", "<|endoftext|>"] + [f"x{i}" for i in range(20)]


def test_bpe_defaults_follow_the_pre_tokenizer_as_in_llama_cpp(tmp_path):
    """BPE: BOS and EOS default to 11, and a llama-bpe vocabulary adds a BOS unless its header says not."""
    tokens = byte_level_tokens()
    common = dict(tokens=tokens, types=[1] * len(tokens), model="gpt2", merges=["Ġ t", "Ġt h", "Ġth e"])
    given = write(tmp_path / "given.gguf", pre="llama-bpe", bos=11, eos=11, add_bos=True, add_eos=False, **common)
    bare = write(tmp_path / "bare.gguf", pre="llama-bpe", bos=None, eos=None, add_bos=None, add_eos=None, **common)
    assert llama_cpp_special(bare) == llama_cpp_special(given) == (2, 11, 11, True, False)
    assert differences(read_fingerprint(given), read_fingerprint(bare)) == []
    qwen = write(tmp_path / "qwen.gguf", pre="qwen2", bos=None, eos=None, add_bos=None, add_eos=None, **common)
    assert llama_cpp_special(qwen)[3] is False and read_fingerprint(qwen).add_bos is False


def gguf_bytes(*kvs):
    def string(text):
        return struct.pack("<Q", len(text.encode())) + text.encode()
    return b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(string(key) + value for key, value in kvs)


def test_damaged_headers_are_one_line_errors_and_skipped_as_drafts(tmp_path):
    """A string length near 2**63 inside an array (OverflowError), and an array count far past the file
    (a zero-filled sparse file: walked 8 bytes at a time it took minutes): one ModelFileError, at once."""
    long_string = gguf_bytes(("tokenizer.ggml.merges", struct.pack("<IIQ", 9, 8, 2) + struct.pack("<QQ", 2**63, 0)))
    long_token = gguf_bytes(("tokenizer.ggml.tokens", struct.pack("<IIQ", 9, 8, 2) + struct.pack("<QQ", 2**63, 0)))
    drafts = tmp_path / "drafts"
    drafts.mkdir()
    for name, data in (("string", long_string), ("token", long_token)):
        path = drafts / f"{name}.gguf"
        path.write_bytes(data)
        with pytest.raises(ModelFileError):
            read_fingerprint(path)
        with pytest.raises(ModelFileError):
            fingerprint_of_bytes(data, name)
    huge = tmp_path / "huge-count.gguf"
    huge.write_bytes(gguf_bytes(("tokenizer.ggml.merges", struct.pack("<IIQ", 9, 8, 2**40))))
    os.truncate(huge, 64 << 20)
    started = time.perf_counter()
    with pytest.raises(ModelFileError, match="runs past the end of the file"):
        read_fingerprint(huge)
    assert time.perf_counter() - started < 1.0
    target = write(tmp_path / "target.gguf", n_layer=2)
    assert choose_draft(target, [drafts]).kind == "ngram"  # damaged files in the folder are no candidates


def test_a_file_rewritten_in_place_with_its_size_and_mtime_is_read_again(tmp_path):
    """The fingerprint cache is keyed by the file's change time and inode too: a header fixed in place
    (same size, mtime put back, as `cp -p`/`touch -r` do) is not answered from the cache."""
    target = write(tmp_path / "target.gguf", n_layer=2)
    draft = write(tmp_path / "draft.gguf")
    fixed = write(tmp_path / "fixed.gguf", eos=3)
    assert draft.stat().st_size == fixed.stat().st_size
    assert differences(read_fingerprint(target), read_fingerprint(draft)) == []
    stat = draft.stat()
    time.sleep(0.05)  # past the file system's coarse clock tick
    with open(draft, "r+b") as f:
        f.write(fixed.read_bytes())
    os.utime(draft, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert draft.stat().st_size == stat.st_size and draft.stat().st_mtime_ns == stat.st_mtime_ns
    assert read_fingerprint(draft).eos == 3


def test_a_damaged_fingerprint_cache_is_read_again(tmp_path, ggufspec_home):
    """fingerprints.json is JSON but its entries are not fingerprints (a hand edit, a foreign writer):
    the header is read again instead of a TypeError deep in the comparison."""
    target = write(tmp_path / "target.gguf", n_layer=2)
    draft = write(tmp_path / "draft.gguf")
    expected = read_fingerprint(draft), read_fingerprint(target)
    cache = ggufspec_home / FINGERPRINTS_FILE
    data = json.loads(cache.read_text())
    for entry in data.values():
        entry.update(n_vocab="many", bos=True)
    cache.write_text(json.dumps(data))
    assert (read_fingerprint(draft), read_fingerprint(target)) == expected
    check_draft(target, draft)
    cache.write_text("{not json")
    assert read_fingerprint(draft) == expected[0]


def run_lines(*args):
    result = CliRunner().invoke(main, ["run", *args, "-p", "the cat", "-n", "4", "-c", "128", "-t", "1"])
    return result.exit_code, [line for line in result.output.splitlines() if line.strip()]


def test_empty_model_paths_are_one_line_errors(tmp_path):
    """(The target as its own draft stays allowed: self-drafting is how the GPU benchmark and
    llama-speculative-simple measure a verification's cost at full acceptance.)"""
    target = write(tmp_path / "target.gguf", n_layer=2)
    for args, message in ((["-m", str(target), "-md", ""], "-md is empty"), (["-m", ""], "-m is empty")):
        code, lines = run_lines(*args)
        assert code == 2 and len(lines) == 1 and message in lines[0], (args, lines)


EXTRA = ["▁日本", "語", "▁é", "😀", "▁ü", "ñ", "▁Ω", "<|im_end|>"]  # the target's alone; the last ends a turn


@pytest.fixture(scope="module")
def bridged(tmp_path_factory):
    """A target with multi-byte words and an end-of-turn control token its draft lacks (a bridged pair)."""
    folder = tmp_path_factory.mktemp("bridged")
    base, base_types = vocabulary()
    tokens = base + EXTRA
    types = base_types + [gguf.TokenType.NORMAL] * (len(EXTRA) - 1) + [gguf.TokenType.CONTROL]
    weights = make_weights(Shape(extra_words=len(EXTRA)), seed=3)
    weights["output.weight"][len(base):] *= 3.0
    weights["output.weight"][-1] *= 1.5
    weights["output.weight"][2] *= 0.0
    target = write(folder / "t.gguf", tokens, types, eot=len(tokens) - 1, n_layer=2, weights=weights)
    small = {k: (v[:len(base)] if k in ("token_embd.weight", "output.weight") else v) for k, v in weights.items()
             if not k.startswith("blk.") or k.startswith("blk.0.")}
    return target, write(folder / "d.gguf", weights=small), len(base)


def test_a_bridged_pair_is_the_target_alone_token_for_token(bridged):
    """--strict: greedy output identical, with tokens the draft cannot express (multi-byte UTF-8 words,
    a control end of turn), at the end of generation, and after a stream left early (a stop string)."""
    target, draft, n_shared = bridged
    assert differences(read_fingerprint(target), read_fingerprint(draft), target, draft) == []
    seen_extra = 0
    with SpeculativeDecoder(target, None, n_ctx=256, n_threads=1, strict=True) as alone, \
            SpeculativeDecoder(target, draft, n_ctx=256, n_threads=1, strict=True) as decoder:
        assert type(decoder.draft).__name__ == "VocabBridge"
        for prompt in prompts(4, seed=5) + ["the cat 日本語 é", "😀 ñ the"]:
            expected = alone.generate(prompt, n_predict=32, n_draft=0)
            seen_extra += sum(t >= n_shared for t in expected.tokens)
            for k, drafter in ((1, "model"), (3, "model"), (3, "hybrid"), ("auto", "model")):
                got = decoder.generate(prompt, n_predict=32, n_draft=k, drafter=drafter)
                assert (got.tokens, got.text, got.stats.stop_reason) == \
                    (expected.tokens, expected.text, expected.stats.stop_reason), (prompt, k, drafter)
            stream = decoder.stream(prompt, n_predict=32, n_draft=3)
            head = [next(stream).token for _ in range(min(3, len(expected.tokens)))]
            stream.close()
            rest = alone.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
            again = alone.generate(rest + head, n_predict=16, n_draft=0)
            assert decoder.generate(rest + head, n_predict=16, n_draft=3).tokens == again.tokens
    assert seen_extra > 0, "the target never wrote a token its draft lacks: the test proves nothing"


def test_the_fingerprint_cache_keeps_the_latest_files(tmp_path, ggufspec_home, monkeypatch):
    """The cache keeps the FINGERPRINTS_KEPT latest files, not the first ones by path (the file is written
    with sorted keys, so 'the last entries' were the alphabetically last and a new early path was dropped)."""
    from ggufspec import fingerprint
    monkeypatch.setattr(fingerprint, "FINGERPRINTS_KEPT", 3)
    first = write(tmp_path / "first.gguf")
    for name in "dcba":
        (tmp_path / f"{name}.gguf").write_bytes(first.read_bytes())
        read_fingerprint(tmp_path / f"{name}.gguf")
    kept = json.loads((ggufspec_home / FINGERPRINTS_FILE).read_text())
    assert sorted(key.split("|")[1].rsplit("/", 1)[1] for key in kept) == ["a.gguf", "b.gguf", "c.gguf"]


def test_gemma4_adds_a_bos_whatever_its_header_says_as_llama_cpp_loads_it():
    """llama-vocab.cpp forces add-BOS on for Gemma 4's tokenizer (its PR 21500), over the header's key."""
    def header(add_bos: bool):
        string = lambda text: struct.pack("<Q", len(text.encode())) + text.encode()
        return gguf_bytes(("tokenizer.ggml.model", struct.pack("<I", 8) + string("gemma4")),
                          ("tokenizer.ggml.add_bos_token", struct.pack("<I?", 7, add_bos)))
    assert fingerprint_of_bytes(header(False), "gemma4").add_bos is True
    assert fingerprint_of_bytes(header(True), "gemma4").add_bos is True
