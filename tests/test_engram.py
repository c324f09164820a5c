import json
import shutil

import numpy as np
import pytest
import torch

from deepinfer.models import engram
from deepinfer.models.engram import (
    ENGRAM_COMPRESSED_VOCAB_SIZE_V41,
    ENGRAM_DEAD,
    build_engram_token_map,
    compress_token_ids,
    engram_constants,
    engram_hash,
    load_engram_token_map,
    normalize_engram_key,
)
from deepinfer.models.tokenizer import default_tokenizer

V41_MULT_1 = [76632096046245, 4839876093313, 35959672319349, 73987337458391]
V41_MULT_14 = [67716810739261, 51510806800915, 30921347202721, 82619226485591]
V41_PRIMES_1 = [
    16000057, 16000079, 16000081, 16000097, 16000121, 16000129, 16000133, 16000183,
    16000189, 16000207, 16000211, 16000253, 16000277, 16000289, 16000307, 16000321,
    16000339, 16000381, 16000393, 16000399, 16000403, 16000409, 16000447, 16000463,
]
V41_PRIMES_14 = [
    16000477, 16000487, 16000499, 16000507, 16000511, 16000573, 16000609, 16000627,
    16000667, 16000669, 16000693, 16000697, 16000711, 16000729, 16000759, 16000769,
    16000781, 16000799, 16000813, 16000819, 16000841, 16000877, 16000879, 16000889,
]


@pytest.fixture(scope="module")
def token_map():
    return load_engram_token_map()


# ---------------------------------------------------------------- compressed vocabulary

def test_shipped_map_shape_and_size(token_map):
    assert token_map.dtype == np.int32
    assert token_map.shape == (129280,)
    assert int(token_map.min()) == 0
    assert int(token_map.max()) + 1 == ENGRAM_COMPRESSED_VOCAB_SIZE_V41 == 99092
    assert len(np.unique(token_map)) == 99092
    # ids are handed out in order of first appearance
    assert np.all(token_map <= np.concatenate([[0], np.maximum.accumulate(token_map)[:-1] + 1]))


def test_special_tokens_keep_their_own_ids(token_map):
    assert token_map[:3].tolist() == [0, 1, 2]  # BOS, EOS, pad: first three keys
    specials = token_map[[0, 1, 2, 128799, 129264, 129279]]
    assert len(set(specials.tolist())) == 6


@pytest.mark.parametrize("group", [
    [19923, 33310, 44388, 45948],  # "Hello", "hello", " hello", " Hello"
    [69292, 57664],  # " cafe", " café": accents stripped
    [35, 65503],  # "A" and full-width "Ａ": NFKC
    [223, 201, 200, 262, 271, 539],  # " ", "\n", "\t", "  ", "\n\n", " \n": all one space
])
def test_normalised_collisions(token_map, group):
    tok = default_tokenizer()
    assert len(set(token_map[group].tolist())) == 1, [tok.decode([t]) for t in group]


def test_partial_utf8_tokens_are_keyed_by_raw_string(token_map):
    tok = default_tokenizer()
    partial = [97, 130, 168, 286]  # single bytes / byte pairs that are not whole UTF-8 characters
    assert all("\ufffd" in tok.decode([t]) for t in partial)
    assert len(set(token_map[partial].tolist())) == len(partial)


def test_normalize_engram_key():
    assert normalize_engram_key(" Hello") == "hello"
    assert normalize_engram_key("Café") == "cafe"
    assert normalize_engram_key("ＡＢ") == "ab"
    assert normalize_engram_key(" ") == " "
    assert normalize_engram_key("\n\t ") == " "
    assert normalize_engram_key("  x \n y ") == "x y"
    assert normalize_engram_key("\x1c") == "\x1c"  # not Unicode White_Space, so not stripped
    assert normalize_engram_key("\u0301") == ""


def test_rebuild_matches_shipped_file(token_map):
    tok = default_tokenizer()
    rebuilt = build_engram_token_map(tok)
    assert rebuilt.dtype == np.int32
    np.testing.assert_array_equal(rebuilt, token_map)
    provenance = json.loads(engram.TOKEN_MAP_PROVENANCE_PATH.read_text(encoding="utf-8"))
    assert provenance["tokenizer_json_sha256"] == tok.tokenizer_json_sha256
    assert provenance["built_from_package"] == tok.source_package
    assert provenance["built_from_package_version"] == tok.source_package_version
    assert provenance["compressed_vocab_size"] == 99092


def test_write_then_load_roundtrip(tmp_path):
    tok = default_tokenizer()
    npy, meta = tmp_path / "map.npy", tmp_path / "map.json"
    written = engram.write_engram_token_map(tok, npy, meta)
    np.testing.assert_array_equal(load_engram_token_map(npy, meta), written)
    assert npy.read_bytes() == engram.TOKEN_MAP_PATH.read_bytes()


def test_damaged_map_is_rejected(tmp_path):
    npy, meta = tmp_path / "map.npy", tmp_path / "map.json"
    shutil.copyfile(engram.TOKEN_MAP_PATH, npy)
    shutil.copyfile(engram.TOKEN_MAP_PROVENANCE_PATH, meta)
    data = bytearray(npy.read_bytes())
    data[-1] ^= 0x01
    npy.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match="damaged") as info:
        load_engram_token_map(npy, meta)
    assert "\n" not in str(info.value)
    npy.unlink()
    with pytest.raises(RuntimeError, match="unreadable"):
        load_engram_token_map(npy, meta)


def test_compress_token_ids(token_map):
    raw = torch.tensor([0, 19923, 129264, 2, 129280, -5])
    out = compress_token_ids(raw, token_map)
    assert out.dtype == torch.int64
    assert out.tolist() == [0, int(token_map[19923]), ENGRAM_DEAD, 2, ENGRAM_DEAD, ENGRAM_DEAD]


# ---------------------------------------------------------------- hash constants

def test_v41_constants():
    consts = engram_constants([1, 14], 16_000_000, 8, 4, 99092)
    assert list(consts) == [1, 14]
    assert consts[1].multipliers.dtype == np.int64
    assert consts[1].multipliers.tolist() == V41_MULT_1
    assert consts[14].multipliers.tolist() == V41_MULT_14
    assert consts[1].primes.tolist() == V41_PRIMES_1
    assert consts[14].primes.tolist() == V41_PRIMES_14
    assert consts[1].rows == 384_006_168
    assert consts[14].rows == 384_016_682
    for layer in consts.values():
        assert layer.offsets.dtype == np.int64
        assert layer.offsets.tolist() == [0, *np.cumsum(layer.primes)[:-1].tolist()]
        assert all(m % 2 == 1 for m in layer.multipliers.tolist())


def test_tiny_constants():
    consts = engram_constants([1, 4], 1000, 2, 4, 99092)
    assert consts[1].primes.tolist() == [1009, 1013, 1019, 1021, 1031, 1033]
    assert consts[4].primes.tolist() == [1039, 1049, 1051, 1061, 1063, 1069]
    assert [c.rows for c in consts.values()] == [6126, 6332]
    assert consts[1].multipliers.tolist() == V41_MULT_1
    assert consts[4].multipliers.tolist() == [82260218638837, 5037792023067, 73653454411355, 18954862957863]
    assert consts[4].offsets.tolist() == [0, 1039, 2088, 3139, 4200, 5263]


def test_medium_constants():
    consts = engram_constants([1, 14], 1_000_000, 8, 4, 99092)
    assert [c.rows for c in consts.values()] == [24_003_916, 24_010_950]
    all_primes = np.concatenate([c.primes for c in consts.values()])
    assert all_primes.min() == 1_000_003 and all_primes.max() == 1_000_619
    assert len(set(all_primes.tolist())) == 48
    assert consts[14].multipliers.tolist() == V41_MULT_14


def test_constants_reject_bad_arguments():
    with pytest.raises(ValueError, match="appears twice"):
        engram_constants([1, 1], 1000, 2, 4, 99092)
    with pytest.raises(ValueError, match="max_ngram"):
        engram_constants([1], 1000, 2, 1, 99092)


# ---------------------------------------------------------------- per-token hash

def _reference_rows(history, pos, layer, pad, max_ngram, n_heads):
    """§4.3c-d with Python integers, one token at a time."""
    grams, blocked = [], False
    for r in range(max_ngram):
        if pos < r or history[pos - r] == ENGRAM_DEAD:
            blocked = True
        grams.append(pad if blocked else history[pos - r])
    mult = [int(m) for m in layer.multipliers]
    products = [g * m for g, m in zip(grams, mult)]
    acc, cols = products[0], []
    for o in range(1, max_ngram):
        acc ^= products[o]
        for h in range(n_heads):
            col = (o - 1) * n_heads + h
            cols.append(acc % int(layer.primes[col]) + int(layer.offsets[col]))
    return cols


def test_hash_hand_computed_first_token():
    consts = engram_constants([1, 4], 1000, 2, 4, 99092)
    history = torch.tensor([5, 7, 9])
    rows = engram_hash(history, torch.tensor([0]), consts, pad_id=2)
    assert rows.shape == (1, 2, 6) and rows.dtype == torch.int64
    # pos 0: g = [5, pad, pad, pad]; acc1 = 5*m0 ^ 2*m1, acc2 = acc1 ^ 2*m2, acc3 = acc2 ^ 2*m3
    m0, m1, m2, m3 = V41_MULT_1
    acc1 = 5 * m0 ^ 2 * m1
    acc2 = acc1 ^ 2 * m2
    acc3 = acc2 ^ 2 * m3
    expected_layer1 = [acc1 % 1009, acc1 % 1013 + 1009, acc2 % 1019 + 2022, acc2 % 1021 + 3041,
                       acc3 % 1031 + 4062, acc3 % 1033 + 5093]
    assert expected_layer1 == [800, 1976, 2494, 3841, 4554, 5412]
    assert rows[0, 0].tolist() == expected_layer1


def test_hash_blocking_and_dead():
    consts = engram_constants([1, 4], 1000, 2, 4, 99092)
    pad = 2
    history = [5, 7, ENGRAM_DEAD, 9, 11, 13, 99091, 0]
    positions = torch.arange(len(history))
    rows = engram_hash(torch.tensor(history), positions, consts, pad_id=pad)
    for i, pos in enumerate(positions.tolist()):
        for j, layer in enumerate(consts.values()):
            assert rows[i, j].tolist() == _reference_rows(history, pos, layer, pad, 4, 2), (pos, layer.layer_id)
    # the image at position 2 cuts n-grams: position 4 sees [11, 9, pad, pad], not [11, 9, pad, 7]
    cut = engram_hash(torch.tensor([123, 456, 9, 11]), torch.tensor([3]), consts, pad_id=pad)
    history_with_pad = torch.tensor([pad, pad, 9, 11])
    same = engram_hash(history_with_pad, torch.tensor([3]), consts, pad_id=pad)
    assert not torch.equal(cut, same)  # 3-/4-grams differ when nothing is dead
    dead_cut = engram_hash(torch.tensor([123, ENGRAM_DEAD, 9, 11]), torch.tensor([3]), consts, pad_id=pad)
    assert torch.equal(dead_cut, same)
    assert torch.equal(rows[4], engram_hash(torch.tensor([9, 11]), torch.tensor([1]), consts, pad_id=pad)[0])
    # a dead current token pads every slot
    assert torch.equal(rows[2], engram_hash(torch.tensor([pad]), torch.tensor([0]), consts, pad_id=pad)[0])


def test_hash_real_constants_no_overflow_and_in_range():
    consts = engram_constants([1, 14], 16_000_000, 8, 4, 99092)
    history = [99091, 99090, 99089, 99091, 0, 1, 99091]
    rows = engram_hash(torch.tensor(history), torch.arange(len(history)), consts, pad_id=2)
    assert rows.shape == (7, 2, 24)
    for j, layer in enumerate(consts.values()):
        offsets = torch.tensor(layer.offsets)
        primes = torch.tensor(layer.primes)
        assert bool(((rows[:, j] >= offsets) & (rows[:, j] < offsets + primes)).all())
        for pos in range(len(history)):
            assert rows[pos, j].tolist() == _reference_rows(history, pos, layer, 2, 4, 8)


def test_hash_rejects_positions_outside_history():
    consts = engram_constants([1], 1000, 2, 4, 99092)
    with pytest.raises(ValueError, match="positions"):
        engram_hash(torch.tensor([1, 2]), torch.tensor([2]), consts, pad_id=2)
