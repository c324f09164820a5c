"""Outputs decoded and parsed by deepseek-recipe's stream processor: the incremental text equals a
whole decode, stop strings give what matching on whole decodes gave without re-decoding the output,
a chat turn's reasoning_content and tool_calls are parsed from the official markup, and streamed
deltas concatenate to the whole output."""
import random

import pytest
import torch
from test_runtime_scheduler import FakeExecutor

from deepinfer import LLM, SamplingParams
from deepinfer.models.checkpoint import make_checkpoint
from deepinfer.models.tokenizer import Tokenizer, default_tokenizer
from deepinfer.runtime.engine import LLMEngine
from deepinfer.runtime.sequence import RequestOutput

MODEL = "v4.1-flash-tiny"


def run_all(engine):
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    return outs


def test_the_text_stream_is_the_whole_decode():
    """Random ids with lone UTF-8 bytes (incomplete characters, also at the end), control tokens
    and leading newlines, which the processor's content drops and the raw text keeps."""
    tok = default_tokenizer()
    byte_tokens = [i for i in range(256, 128000) if len(tok.token_bytes[i]) == 1 and tok.token_bytes[i][0] >= 0x80]
    newline = tok.encode("\n")[0]
    rng = random.Random(0)
    for _ in range(150):
        ids = [newline] * rng.randrange(3) + [
            rng.choice(byte_tokens) if rng.random() < 0.4 else rng.randrange(128000, 129280) if rng.random() < 0.1
            else rng.randrange(3, 128000) for _ in range(rng.randrange(1, 25))]
        for skip in (True, False):
            stream = tok.text_stream(skip)
            assert "".join(stream.push(t) for t in ids) + stream.finish() == tok.decode(ids, skip_special_tokens=skip)


def stop_by_whole_decodes(tok, out: list[int], params: SamplingParams):
    """What stop strings did before: after each token, decode the whole output and search it."""
    for k in range(1, len(out) + 1):
        if k < params.min_tokens:
            continue
        text = tok.decode(out[:k], skip_special_tokens=True)
        # (a stop string had to end in the tokens from min_tokens on)
        start = len(tok.decode(out[:params.min_tokens - 1], skip_special_tokens=True)) if params.min_tokens > 1 else 0
        hits = [(at, s) for s in params.stop if (at := text.find(s, max(0, start - len(s) + 1))) >= 0]
        if hits:
            at, s = min(hits)
            return out[:k], text[:at + len(s)] if params.include_stop_str_in_output else text[:at], s
    return out, tok.decode(out, skip_special_tokens=True), None


def test_stop_strings_match_as_on_whole_decodes_without_redecoding(monkeypatch):
    """The fake model's tokens (ids below 50: single characters) with the real tokenizer: every stop
    string case ends where searching whole decodes ended, and no decode reads the output."""
    tok = Tokenizer()
    ex = FakeExecutor(4, 32, 4)
    engine = LLMEngine(ex, tok, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    prompt = [5, 9, 14]
    first = engine.add_request(prompt_token_ids=prompt, params=SamplingParams(temperature=0, max_tokens=30))
    plain = run_all(engine)[first]
    text = plain.text
    cases = [SamplingParams(temperature=0, max_tokens=30, stop=[text[7:10]]),
             SamplingParams(temperature=0, max_tokens=30, stop=[text[12:14], text[5:9]], include_stop_str_in_output=True),
             SamplingParams(temperature=0, max_tokens=30, stop=[text[1:3]], min_tokens=5),
             SamplingParams(temperature=0, max_tokens=30, stop=["never there"])]
    calls = []
    decode = Tokenizer.decode
    monkeypatch.setattr(Tokenizer, "decode", lambda self, ids, **kw: calls.append(len(ids)) or decode(self, ids, **kw))
    ids = [engine.add_request(prompt_token_ids=prompt, params=p) for p in cases]
    outs = run_all(engine)
    assert max(calls, default=0) <= 3  # (at most a held incomplete character at the end)
    monkeypatch.undo()
    for rid, params in zip(ids, cases):
        tokens, want_text, stop = stop_by_whole_decodes(tok, plain.token_ids, params)
        o = outs[rid]
        assert (o.token_ids, o.text, o.stop_reason) == (tokens, want_text, stop)
        assert o.finish_reason == ("stop" if stop else "length")


class ScriptedExecutor:
    """Greedy logits whose argmax is the script's next token: the output is the script."""
    num_slots, num_pages, page_tokens, max_draft_len = 2, 4, 128, 0

    def __init__(self, script: list[int], vocab_size: int, prompt_len: int):
        self.script, self.vocab_size, self.prompt_len, self.fed = script, vocab_size, prompt_len, {}

    def reset_slot(self, slot):
        self.fed[slot] = 0

    def step(self, chunks):
        rows = []
        for c in chunks:
            self.fed[c.slot] = c.start + len(c.tokens)
            if c.sample:
                row = torch.zeros(self.vocab_size)
                row[self.script[self.fed[c.slot] - self.prompt_len]] = 10.0
                rows.append(row)
        return torch.stack(rows)


THOUGHT = "The user wants Paris's weather: call the tool."
ANSWER = "Let me check."
CALL = ('\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
        '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="days" string="false">2</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>')


def scripted_engine(text: str, eos: bool = True):
    tok = default_tokenizer()
    script = tok.encode(text) + ([tok.eos_id] if eos else [])
    ex = ScriptedExecutor(script, tok.vocab_size, prompt_len=2)
    return LLMEngine(ex, tok, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=256), script


def test_reasoning_and_tool_calls_are_parsed_as_the_official_api_does():
    engine, script = scripted_engine(THOUGHT + "</think>" + ANSWER + CALL)
    rid = engine.add_request(prompt_token_ids=[0, 5], params=SamplingParams(temperature=0, max_tokens=200),
                             chat=True, thinking=True, stream=True)
    samples = engine.request_samples(rid)
    deltas = []
    while engine.has_unfinished_requests():
        engine.step()
        delta = RequestOutput.delta_of(samples)
        if delta is not None:
            deltas.append(delta.outputs[0])
    (o,) = RequestOutput.of(samples).outputs
    assert o.token_ids == script and o.finish_reason == "stop"
    assert (o.reasoning_content, o.text) == (THOUGHT, ANSWER)
    ((call),) = o.tool_calls
    assert (call.type, call.function.name, call.function.arguments) == ("function", "get_weather",
                                                                       '{"city": "Paris", "days": 2}')
    assert call.id
    # streamed: the reasoning first, then the answer, the call whole with the last delta
    assert "".join(d.reasoning_content for d in deltas) == THOUGHT and "".join(d.text for d in deltas) == ANSWER
    assert len(deltas) > 3 and all(not d.tool_calls for d in deltas[:-1]) and deltas[-1].tool_calls == o.tool_calls
    assert sum((d.token_ids for d in deltas), []) == script
    # without thinking the turn starts in the answer; a generate request keeps the raw text
    engine, script = scripted_engine(ANSWER + CALL)
    chat = engine.add_request(prompt_token_ids=[0, 5], params=SamplingParams(temperature=0, max_tokens=200), chat=True)
    raw = engine.add_request(prompt_token_ids=[0, 5], params=SamplingParams(temperature=0, max_tokens=200))
    outs = run_all(engine)
    c, r = outs[chat].outputs[0], outs[raw].outputs[0]
    assert (c.text, c.reasoning_content, [t.function.name for t in c.tool_calls]) == (ANSWER, "", ["get_weather"])
    assert (r.text, r.reasoning_content, r.tool_calls) == (ANSWER + CALL, None, None)


def test_a_stop_string_ends_the_parsed_answer_too():
    engine, _ = scripted_engine(THOUGHT + "</think>" + ANSWER + " More text.")
    rid = engine.add_request(prompt_token_ids=[0, 5], params=SamplingParams(temperature=0, max_tokens=200,
                                                                            stop=[" check"]), chat=True, thinking=True)
    (o,) = run_all(engine)[rid].outputs
    assert (o.reasoning_content, o.text, o.stop_reason, o.finish_reason) == (THOUGHT, "Let me", " check", "stop")


@pytest.fixture(scope="module")
def llm(tmp_path_factory, one_torch_thread):
    ckpt = make_checkpoint(MODEL, tmp_path_factory.mktemp("ckpt") / "tiny", seed=0)
    return LLM(MODEL, ckpt, max_num_seqs=4, max_model_len=96, speculative=0)


def test_streamed_deltas_concatenate_to_the_output(llm):
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=6, n=2)
    whole = llm.generate(["Hello", "Hi"], params, use_tqdm=False)
    (first,) = llm.generate(["Hello"], SamplingParams(temperature=1.0, seed=2, max_tokens=6), use_tqdm=False)
    stop = first.text[len(first.text) // 2:][:2]
    stopped = SamplingParams(temperature=1.0, seed=2, max_tokens=6, stop=[stop])
    (cut,) = llm.generate(["Hello"], stopped, use_tqdm=False)
    assert cut.finish_reason == "stop"
    streams = [list(llm.generate(["Hello", "Hi"], params, stream=True)), list(llm.generate(["Hello"], stopped,
                                                                                          stream=True))]
    for want, deltas in ((whole, streams[0]), ([cut], streams[1])):
        by_request = {}
        for d in deltas:
            by_request.setdefault(d.request_id, []).append(d)
        assert len(by_request) == len(want)
        for out, ds in zip(want, by_request.values()):
            assert [d.finished for d in ds] == [False] * (len(ds) - 1) + [True]
            for c in out.outputs:
                parts = [p for d in ds for p in d.outputs if p.index == c.index]
                assert len(parts) > 1
                assert "".join(p.text for p in parts) == c.text
                assert sum((p.token_ids for p in parts), []) == c.token_ids
                assert parts[-1].finish_reason == c.finish_reason and parts[-1].stop_reason == c.stop_reason
    # a stream left early aborts what it had not finished
    stream = llm.generate(["Hello"], SamplingParams(temperature=1.0, seed=2, max_tokens=6), stream=True)
    next(stream)
    stream.close()
    assert not llm.engine.has_unfinished_requests()
